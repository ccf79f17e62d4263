"""train.deterministic and train.threads: bit-identical reruns, and the process left as it was."""

from __future__ import annotations

import subprocess
import sys

import torch
from conftest import micro_params

from gpt2.train.determinism import reproducible
from gpt2.train.trainer import train


def weights(path):
    return torch.load(path, weights_only=True)["model"]


def test_a_deterministic_run_repeats_bit_for_bit_while_the_machine_is_loaded(tmp_path, tokens):
    params = micro_params(deterministic=True, threads=2, max_steps=8, eval_interval=4)
    first = train(params, tokens, tmp_path / "a" / "ckpt.pt", tmp_path / "a")
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]  # more than the cores
    try:
        second = train(params, tokens, tmp_path / "b" / "ckpt.pt", tmp_path / "b")
    finally:
        for process in load:
            process.kill()
    assert second["runtime"]["threads"] == 2 and second["runtime"]["deterministic"] is True
    a, b = weights(tmp_path / "a" / "ckpt.pt"), weights(tmp_path / "b" / "ckpt.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert first["val"]["loss"] == second["val"]["loss"] and first["train"]["loss"] == second["train"]["loss"]


def test_the_settings_hold_for_the_run_and_are_restored_after_it():
    threads = torch.get_num_threads()
    with reproducible(threads=3, deterministic=True) as used:
        assert used == 3 == torch.get_num_threads() and torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
        assert not torch.utils.deterministic.fill_uninitialized_memory  # no NaN fill of every fresh tensor
    assert torch.get_num_threads() == threads and not torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory
    with reproducible(threads=0, deterministic=False) as used:  # 0: PyTorch's default, nothing forced
        assert used == threads and not torch.are_deterministic_algorithms_enabled()
