"""What a run is built from, refused with the cause before any step (train/build.py, loader.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import micro_params
from training import run

from gpt2.core.errors import UserError


def test_block_size_longer_than_the_model_is_refused(tmp_path, tokens):
    with pytest.raises(UserError, match="train.block_size 64 exceeds the model's block_size 32"):
        run(tmp_path, tokens, micro_params(block_size=64))


def test_cuda_without_cuda_is_an_error(tmp_path, tokens):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match="train.device is cuda but this machine has no usable CUDA device"):
        run(tmp_path, tokens, micro_params(device="cuda"))


def test_split_shorter_than_a_window_is_refused(tmp_path):
    from conftest import make_tokens

    small = make_tokens(tmp_path / "t", n_train=2000, n_val=8)
    with pytest.raises(UserError, match="val.bin has 8 tokens, fewer than block_size \\+ 1 = 17"):
        run(tmp_path, small, micro_params())


@pytest.mark.parametrize("bad_id, loading", [(60000, "preload"), (50300, "preload"), (50300, "memmap")])
def test_token_ids_outside_the_vocab_are_refused_with_the_cause(tmp_path, tokens, bad_id, loading):
    """Past the embedding (an IndexError deep in torch) or in its padded rows (an infinite loss blamed on lr)."""
    ids = np.fromfile(tokens / "train.bin", dtype=np.uint16)
    ids[::13] = bad_id  # in every window: the first batch read from the map meets one
    ids.tofile(tokens / "train.bin")
    with pytest.raises(UserError, match=rf"train.bin holds token id {bad_id}, outside the vocab of 50257 .* run the "
                                        "tokenize stage again"):
        run(tmp_path, tokens, micro_params(data_loading=loading))


@pytest.mark.parametrize("meta", [[1, 2], {"dtype": "uint16", "vocab_size": 50257, "eot_id": 50256},
                                  {"dtype": "uint16", "vocab_size": 50257, "eot_id": 50256, "splits": {"train": {}}}])
def test_a_malformed_meta_json_is_named_not_a_traceback(tmp_path, tokens, meta):
    (tokens / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"meta.json (holds a JSON list|lacks .*splits).*run the tokenize stage again"):
        run(tmp_path, tokens, micro_params())
