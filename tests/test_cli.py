from __future__ import annotations

import json

import pytest

from conftest import write_params

from gpt2.cli import main


def test_help_lists_every_stage(runner):
    out = runner.invoke(main, ["--help"]).output
    for name in ("download", "tokenize", "stats"):
        assert name in out


def test_full_chain_through_the_cli(runner, tmp_path, corpus):
    params = write_params(tmp_path / "p.yaml", download={"source": str(corpus)})
    raw, tokens, report = tmp_path / "raw", tmp_path / "tokens", tmp_path / "report"
    for args in (["download", "--out", raw], ["tokenize", "--raw", raw, "--out", tokens],
                 ["stats", "--tokens", tokens, "--out", report]):
        result = runner.invoke(main, [*map(str, args), "--params", str(params)])
        assert result.exit_code == 0, result.output
    assert json.loads((report / "metrics.json").read_text())["documents"] == 12
    # a folder that holds anything the command does not write is the user's: refused, and kept
    from conftest import micro_params, make_tokens

    from gpt2.train.trainer import train

    ckpt = tmp_path / "ckpt.pt"
    train(micro_params(max_steps=1), make_tokens(tmp_path / "micro"), ckpt, None)
    for name, args in (("raw", ["download", "--params", str(params), "--out"]),
                       ("tokens", ["tokenize", "--params", str(params), "--raw", str(raw), "--out"]),
                       ("export", ["export", str(ckpt)]), ("ladder", ["ladder", "--out"])):
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        (folder / "notes.txt").write_text("mine")
        result = runner.invoke(main, [*args, str(folder)])
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert result.output.startswith(f"error: {folder} holds notes.txt, which ") and "does not write" in result.output
        assert (folder / "notes.txt").read_text() == "mine"


def test_user_error_is_one_line_and_exit_2(runner, tmp_path):
    params = write_params(tmp_path / "p.yaml", tokenize={"workers": -1})
    result = runner.invoke(main, ["tokenize", "--params", str(params), "--out", str(tmp_path / "t")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: params: tokenize.workers = -1 is not allowed; expected an integer >= 0 (0 = all cores)"]
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("sections, message", [
    ({"model": {"n_head": 5}}, "model.n_head = 5 is not allowed; expected a divisor of the width, model.n_embd 128"),
    ({"train": {"block_size": 256}}, "train.block_size = 256 is not allowed; expected at most the model's context"),
    ({"train": {"batch_tokens": 1000}}, "train.batch_tokens = 1000 is not allowed; expected a multiple of the sequence"),
    ({"train": {"batch_tokens": 2560, "micro_batch_size": 8}}, "train.micro_batch_size = 8 is not allowed; expected "
                                                               "auto or a divisor of the 20 sequences"),
    ({"train": {"init_from": "gpt3"}}, "train.init_from = 'gpt3' is not allowed; expected scratch, gpt2, gpt2-medium"),
    ({"train": {"device": "cuda"}}, "train.device cuda, but CUDA is not available here"),
])
def test_validate_refuses_what_the_train_stage_would_refuse(runner, tmp_path, sections, message):
    """Before DVC deletes any stage's outputs: the shapes and the device, from params alone."""
    import torch

    if "cuda" in message and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    params = write_params(tmp_path / "p.yaml", **sections)
    result = runner.invoke(main, ["validate", "--params", str(params), "--out", str(tmp_path / "ok")])
    assert result.exit_code == 2 and message in result.output and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "ok").exists()


def test_missing_params_file(runner, tmp_path):
    result = runner.invoke(main, ["stats", "--params", str(tmp_path / "none.yaml")])
    assert result.exit_code == 2 and "not found" in result.output


def test_a_grid_setting_without_values_is_refused_before_anything_is_queued(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no DVC project here: the setting is checked first
    result = runner.invoke(main, ["grid", "-S", "train.lr"])
    assert result.exit_code == 2 and result.output.strip() == (
        "error: -S 'train.lr': write section.key=value[,value...], e.g. -S train.lr=1.0e-3,2.0e-3")
    result = runner.invoke(main, ["grid", "-S", "train.lr=1.0e-3"])
    assert result.exit_code == 2 and "has no dvc.yaml; run from the project root" in result.output
