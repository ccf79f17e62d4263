"""Shared fixtures: small corpora, params files and a CLI runner."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

WORDS = ("the king queen lord thou art my good sweet love night day fair death life heaven "
         "O speak hath doth what why where come go well ill noble friend").split()


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
    return " ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";"])


def document(rng: random.Random, lines: int) -> str:
    """Play-like text with the whitespace shapes that matter to BPE: blank lines, indents, trailing spaces."""
    out = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.1:
            out.append("")
        elif kind < 0.2:
            out.append("  " + sentence(rng) + "  ")
        else:
            out.append(sentence(rng))
    return "\n".join(out) + "\n"


def make_corpus(folder: Path, n_docs: int = 12, lines: int = 40, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(n_docs):
        (folder / f"doc{i:02d}.txt").write_text(document(rng, lines))
    return folder


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return make_corpus(tmp_path / "corpus")


def write_params(path: Path, **sections: dict) -> Path:
    path.write_text(yaml.safe_dump(sections))
    return path


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def make_tokens(folder: Path, n_train: int = 20_000, n_val: int = 4_000, seed: int = 0) -> Path:
    """A token folder in the real format, with a learnable pattern (no tokenizer needed)."""
    import json

    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    splits = {}
    for name, n in (("train", n_train), ("val", n_val)):
        base = rng.integers(0, 500, size=n // 4).repeat(4)  # repeated runs: something to learn
        base[rng.random(len(base)) < 0.01] = 50256
        base[-1] = 50256
        base.astype(np.uint16).tofile(folder / f"{name}.bin")
        splits[name] = {"file": f"{name}.bin", "tokens": len(base), "documents": int((base == 50256).sum()),
                        "bytes": 3 * len(base)}
    meta = {"format": "gpt2-tokens/1", "dtype": "uint16", "vocab_size": 50257, "eot_id": 50256,
            "tokenizer": {"name": "gpt2"}, "manifest_sha256": "test", "split": {"mode": "documents"},
            "splits": splits, "decode": {"on_error": "replace", "replaced_chars": 0}}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


MICRO_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}
MICRO_TRAIN = {"micro_batch_size": 4, "block_size": 16, "max_steps": 12, "warmup_steps": 3, "eval_interval": 4,
               "eval_iters": 2, "log_interval": 1, "checkpoint_interval": 100, "mlflow": False,
               "timing_warmup_steps": 1, "lr": 1.0e-2}


def micro_params(model: dict | None = None, **train):
    """Params for a model small enough to train a dozen steps in about a second on a CPU."""
    from gpt2.config import Params, build

    return build(Params, {"model": {**MICRO_MODEL, **(model or {})}, "train": {**MICRO_TRAIN, **train}}, "")


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    return make_tokens(tmp_path / "tokens")
