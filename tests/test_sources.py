"""The download stage's sources: folders, files, globs, JSONL, archives; empty or binary files; failures that write
nothing."""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import pytest

from gpt2.core.config import DownloadConfig
from gpt2.core.errors import UserError
from gpt2.data.sources import download


def fetch(tmp_path: Path, source: str | Path, **kwargs) -> tuple[dict, Path]:
    out = tmp_path / "raw"
    return download(DownloadConfig(source=str(source), **kwargs), out), out


def test_directory_source_copies_every_document_with_manifest(tmp_path, corpus):
    manifest, out = fetch(tmp_path, corpus)
    assert manifest["documents"] == 12
    assert len(manifest["files"]) == 12
    assert json.loads((out / "manifest.json").read_text()) == manifest
    for entry in manifest["files"]:
        data = (out / entry["path"]).read_bytes()
        assert len(data) == entry["bytes"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
    assert manifest["bytes"] == sum(p.stat().st_size for p in corpus.iterdir())


def test_single_file_and_glob(tmp_path, corpus):
    manifest, _ = fetch(tmp_path, corpus / "doc03.txt")
    assert manifest["documents"] == 1
    manifest, _ = fetch(tmp_path, f"{corpus}/doc0*.txt")
    assert manifest["documents"] == 10


def test_a_folder_only_the_workspace_holds_is_named_in_a_temporary_copys_error(tmp_path, corpus, monkeypatch):
    """`dvc exp run --temp` copies what git and DVC track: an untracked corpus is in the workspace (DVC_ROOT) and
    not in the copy the stage runs in; the error says so, and how to bring it, instead of 'no such file'."""
    workspace, copy = tmp_path / "workspace", tmp_path / "copy"
    (workspace / "corpus").mkdir(parents=True)
    copy.mkdir()
    monkeypatch.chdir(copy)
    monkeypatch.setenv("DVC_ROOT", str(workspace))
    with pytest.raises(UserError, match=r"download.source: 'corpus' is in the workspace \(.*workspace/corpus\) but not "
                                        r"in this run's copy of it: .*`dvc add corpus` and commit its .dvc file"):
        fetch(tmp_path, "corpus")
    with pytest.raises(UserError, match=r"no such file or directory 'elsewhere'"):  # in neither: the usual words
        fetch(tmp_path, "elsewhere")


def test_jsonl_one_document_per_line(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"body": "first doc"}\n\n{"body": "second doc"}\n{"body": ""}\n')
    manifest, out = fetch(tmp_path, src, text_field="body")
    assert manifest["documents"] == 2
    lines = (out / manifest["files"][0]["path"]).read_text().splitlines()
    assert [json.loads(line)["text"] for line in lines] == ["first doc", "second doc"]


def test_jsonl_without_the_field_is_a_clear_error(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"body": "first doc"}\n')
    with pytest.raises(UserError, match="line 1 has no string field 'text'.*download.text_field"):
        fetch(tmp_path, src)
    assert not (tmp_path / "raw").exists()


def test_archives_and_gzip(tmp_path, corpus, monkeypatch):
    from gpt2.data import sources

    shown = []

    class Progress(sources.Progress):  # the progress line counts bytes of the files on disk: it ends at 100%
        def __exit__(self, *exc):
            shown.append((self.done, self.total))
            return super().__exit__(*exc)

    monkeypatch.setattr(sources, "Progress", Progress)
    tar_path = tmp_path / "c.tar.gz"
    with tarfile.open(tar_path, "w:gz") as archive:
        archive.add(corpus, arcname="corpus")
    zip_path = tmp_path / "c.zip"
    with zipfile.ZipFile(zip_path, "w") as archive:
        for file in sorted(corpus.iterdir()):
            archive.write(file, f"corpus/{file.name}")
    gz_path = tmp_path / "one.txt.gz"
    gz_path.write_bytes(gzip.compress((corpus / "doc00.txt").read_bytes()))
    assert fetch(tmp_path, tar_path)[0]["documents"] == 12
    assert fetch(tmp_path, zip_path)[0]["documents"] == 12
    manifest, out = fetch(tmp_path, gz_path)
    assert (out / manifest["files"][0]["path"]).read_bytes() == (corpus / "doc00.txt").read_bytes()
    assert [done for done, _ in shown] == [total for _, total in shown] == [p.stat().st_size for p in
                                                                             (tar_path, zip_path, gz_path)]


def test_a_downloaded_archive_is_known_by_its_url_not_its_cache_name(tmp_path, corpus, monkeypatch):
    """The HTTP cache stores a download under a hashed name: the URL's name says what it is."""
    cached = tmp_path / "cache" / "4f1c2a9e8b7d6c5a.done"
    cached.parent.mkdir()
    with tarfile.open(cached, "w:gz") as archive:
        archive.add(corpus, arcname="corpus")
    monkeypatch.setattr("gpt2.data.sources.download_url", lambda url, **kwargs: cached)
    manifest, _ = fetch(tmp_path, "https://example.org/corpus.tar.gz")
    assert manifest["documents"] == 12


def test_empty_files_in_a_directory_are_skipped_and_said_once(tmp_path, corpus, caplog):
    for n in range(5):
        (corpus / f"empty{n}.txt").write_text("")
    (corpus / ".hidden.txt").write_text("secret")
    assert fetch(tmp_path, corpus)[0]["documents"] == 12
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert said == ["download: skipped 5 files with no bytes (e.g. empty0.txt, empty1.txt, empty2.txt, …)"]


def test_a_binary_file_is_refused_by_name_and_nothing_is_written(tmp_path, corpus):
    (corpus / "program").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(64) + b"text after")
    with pytest.raises(UserError, match=r"download.source: program is not a text file \(a NUL byte at offset 7\)"):
        fetch(tmp_path, corpus)
    assert not (tmp_path / "raw").exists()
    with pytest.raises(UserError, match="not a text file"):
        fetch(tmp_path, sys.executable)  # the python binary itself, as a one-file source


def _zero_byte_file(d: Path) -> Path:
    (d / "zero.txt").write_text("")
    return d / "zero.txt"


def _empty_dir(d: Path) -> Path:
    (d / "emptydir").mkdir()
    return d / "emptydir"


def _dir_of_empty_files(d: Path) -> Path:
    (d / "blanks").mkdir()
    (d / "blanks" / "a.txt").write_text("")
    return d / "blanks"


@pytest.mark.parametrize("make, match", [
    (lambda d: d / "nope.txt", "no such file or directory"),
    (lambda d: str(d / "*.nothing"), "matched no files"),
    (_zero_byte_file, r"is empty \(0 bytes\)"),
    (_empty_dir, "has no files"),
    (_dir_of_empty_files, "empty corpus"),
    (lambda d: "ftp://example.org/x.txt", "unsupported scheme"),
])
def test_bad_sources_fail_cleanly_and_write_nothing(tmp_path, make, match):
    source = make(tmp_path)
    with pytest.raises(UserError, match=match):
        fetch(tmp_path, source)
    assert not (tmp_path / "raw").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".raw")]


def test_failed_run_keeps_the_previous_output(tmp_path, corpus):
    fetch(tmp_path, corpus)
    before = (tmp_path / "raw" / "manifest.json").read_text()
    with pytest.raises(UserError):
        fetch(tmp_path, tmp_path / "nope")
    assert (tmp_path / "raw" / "manifest.json").read_text() == before


def test_hf_without_datasets_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(UserError, match=r"pip install -e '.\[hf\]'"):
        fetch(tmp_path, "hf:tiny_shakespeare")


def fake_datasets(monkeypatch, load):
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load))


def test_hf_unreachable_hub_is_a_clear_error(tmp_path, monkeypatch):
    def load(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'x' on the Hub (LocalEntryNotFoundError)")

    fake_datasets(monkeypatch, load)
    with pytest.raises(UserError, match="could not read Hugging Face dataset 'x:cfg'.*hub may be unreachable"):
        fetch(tmp_path, "hf:x:cfg")
    assert not (tmp_path / "raw").exists()


def test_hf_rows_are_sharded_into_jsonl(tmp_path, monkeypatch):
    calls = []

    def load(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter({"text": f"document {i}", "id": i} for i in range(25))

    fake_datasets(monkeypatch, load)
    manifest, out = fetch(tmp_path, "hf:org/set", hf_docs_per_shard=10)
    assert calls == [("org/set", None, "train", True)]
    assert manifest["documents"] == 25
    assert [f["documents"] for f in manifest["files"]] == [10, 10, 5]
    assert manifest["hf_dataset"] == "org/set"


def test_hf_missing_field(tmp_path, monkeypatch):
    fake_datasets(monkeypatch, lambda *a, **k: iter([{"content": "x"}]))
    with pytest.raises(UserError, match="no field 'text'.*content"):
        fetch(tmp_path, "hf:x")


def test_hf_shards_are_stored_compressed_and_tokenized_in_place(tmp_path, monkeypatch):
    """hf_gzip_level: .jsonl.gz on disk, the same tokens as plain JSON Lines, progress counting text bytes."""
    from gpt2.core.config import TokenizeConfig
    from gpt2.core.tokens import open_tokens
    from gpt2.data.encode import text_bytes, tokenize_corpus

    texts = [f"Document {i}: " + "the king and the queen " * (i % 7 + 1) for i in range(60)]
    fake_datasets(monkeypatch, lambda *a, **k: iter({"text": t} for t in texts))
    tokens = {}
    for level in (0, 6):
        manifest, out = fetch(tmp_path / f"l{level}", "hf:org/set", hf_docs_per_shard=25, hf_gzip_level=level)
        paths = [f["path"] for f in manifest["files"]]
        assert all(p.endswith(".jsonl.gz" if level else ".jsonl") for p in paths)
        tokenize_corpus(TokenizeConfig(), out, tmp_path / f"t{level}")
        tokens[level] = [open_tokens(tmp_path / f"t{level}", s).tolist() for s in ("train", "val")]
        if level:
            lines = gzip.decompress((out / paths[0]).read_bytes()).decode().splitlines()
            assert [json.loads(line)["text"] for line in lines] == texts[:25]
            assert manifest["bytes"] < text_bytes(manifest) / 3  # repetitive text: well over 3x smaller
            assert text_bytes(manifest) == sum(len(json.dumps({"text": t}) + "\n") for t in texts)
    assert tokens[0] == tokens[6]


def test_a_local_text_file_is_copied_never_linked_into_what_dvc_caches(tmp_path, corpus):
    """DVC moves data/raw's files into its cache: a hard link would make the user's file the cache object, and
    an edit of it (root writes through the read-only bit) would change the cache behind DVC's back."""
    (tmp_path / "via-symlink.txt").symlink_to(corpus / "doc01.txt")
    manifest, out = fetch(tmp_path, corpus)
    first = out / manifest["files"][0]["path"]
    assert first.stat().st_ino != (corpus / "doc00.txt").stat().st_ino
    assert first.read_bytes() == (corpus / "doc00.txt").read_bytes()
    manifest, out = fetch(tmp_path, tmp_path / "via-symlink.txt")
    assert (out / manifest["files"][0]["path"]).read_bytes() == (corpus / "doc01.txt").read_bytes()


def test_a_local_source_dvc_does_not_watch_says_what_to_run_after_editing_it(tmp_path, corpus, monkeypatch, capsys):
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    stage = {"stages": {"download": {"cmd": "python -m stages.download", "deps": ["gpt2/data"]}}}
    (project / "dvc.yaml").write_text(json.dumps(stage))
    fetch(tmp_path, corpus)
    assert (f"download: DVC does not watch {corpus} (not a dependency of download in dvc.yaml): after you change "
            "or add files there, run `dvc repro -f download`") in capsys.readouterr().err
    stage["stages"]["download"]["deps"].append(str(corpus.parent))  # the docs' recipe: the folder is a dependency
    (project / "dvc.yaml").write_text(json.dumps(stage))
    fetch(tmp_path, f"{corpus}/*.txt")
    assert "DVC does not watch" not in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # no pipeline: nothing to say
    fetch(tmp_path, corpus)
    assert "DVC does not watch" not in capsys.readouterr().err
