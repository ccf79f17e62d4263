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
