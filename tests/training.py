"""Helpers for the tests that train a micro model: a run, its logged losses, a Ctrl-C at a chosen step, and a
fake run for the rules that need no training."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import micro_params

from gpt2.train import trainer
from gpt2.train.trainer import TrainingInterrupted, train


def run(tmp_path, tokens, params, name="run"):
    return train(params, tokens, tmp_path / name / "ckpt.pt", tmp_path / name / "reports")


def losses(tmp_path, name="run"):
    rows = (tmp_path / name / "reports/plots/train.tsv").read_text().splitlines()
    return [float(r.split("\t")[1]) for r in rows[1:]]


def interrupt_at(monkeypatch, step_to_stop: int, sig=signal.SIGINT):
    """Send ``sig`` to this process while step ``step_to_stop`` runs, as Ctrl-C or a scheduler would."""
    original = trainer.lr_at

    def lr_at(step, cfg, *rest):
        if step == step_to_stop:
            os.kill(os.getpid(), sig)
        return original(step, cfg, *rest)

    monkeypatch.setattr(trainer, "lr_at", lr_at)


def stop_at_step_3(tmp_path, tokens, monkeypatch, params):
    """Train ``params`` until a Ctrl-C in step 3 stops it: the checkpoint holds step 3 of 12."""
    interrupt_at(monkeypatch, 2)
    with pytest.raises(TrainingInterrupted):
        run(tmp_path, tokens, params)
    monkeypatch.undo()


def fake_run(**train):
    """What the resume, keep and save rules read of a run (its params, model config, data, steps and rank),
    without building a model."""
    from types import SimpleNamespace

    from gpt2.model.gpt import GPTConfig

    params = micro_params(**train)
    return SimpleNamespace(params=params, model_cfg=GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=16),
                           data_identity={"manifest_sha256": "m", "tokens": 100}, total_steps=params.train.max_steps,
                           dist=SimpleNamespace(main=True))
