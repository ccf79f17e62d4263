"""--apply: the winning settings written into a committed params.yaml, line by line, comments kept."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from conftest import ROOT

from gpt2.core.errors import UserError
from gpt2.measure.apply import Change, apply, set_line


def git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"})


@pytest.fixture
def committed(tmp_path):
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "params.yaml")
    git(tmp_path, "commit", "-qm", "params")
    return tmp_path / "params.yaml"


def test_each_line_keeps_its_comment_and_the_file_reads_as_the_changes(committed):
    before = committed.read_text()
    done = apply([Change("train.compile", True, "1.30× the baseline's tokens/s, outside noise (reports/grid/c.md)"),
                  Change("train.min_lr", 2.0e-5, "x"), Change("model.attention", "manual", "y"),
                  ], committed)
    after = committed.read_text()
    assert "-  compile: false          # torch.compile the model" in done
    assert "+  compile: true           # torch.compile the model" in done  # the comment stays in its column
    assert "train.compile=true: 1.30× the baseline's tokens/s, outside noise (reports/grid/c.md)" in done
    assert "  min_lr: 2.0e-5 " in after  # as the line wrote it (1.0e-4), with the dot YAML needs (2e-5 is text)
    data, old = yaml.safe_load(after), yaml.safe_load(before)
    old["train"].update(compile=True, min_lr=2.0e-5)
    old["model"]["attention"] = "manual"
    assert data == old and len(after.splitlines()) == len(before.splitlines())


def test_a_float_is_written_as_the_value_it_replaces_was():
    text = "train:\n  lr: 1.0e-3   # peak\n  seed: 0.5\n  grad_clip: 1e+2\n"
    assert "  lr: 3.0e-3   # peak\n" in set_line(text, "train.lr", 0.003)  # the diff shows one figure changed
    assert "  lr: 6.0e-4   # peak\n" in set_line(text, "train.lr", 6.0e-4)
    assert "  seed: 0.25\n" in set_line(text, "train.seed", 0.25)
    assert "  grad_clip: 2.5e+2\n" in set_line(text, "train.grad_clip", 250.0)  # YAML reads 2.5e2 as text
    assert yaml.safe_load(set_line(text, "train.grad_clip", 250.0))["train"]["grad_clip"] == 250.0


def test_nothing_to_apply_changes_nothing_and_says_why(committed):
    before = committed.read_text()
    assert "nothing to apply: no setting is better than the baseline outside noise" in apply([], committed)
    assert "already holds every winning setting" in apply([Change("train.lr", 1.0e-3, "x")], committed)
    assert committed.read_text() == before


def test_a_winner_that_auto_already_runs_here_keeps_auto(committed, monkeypatch):
    """The ladder measures oneDNN against BLAS; on an AMD CPU params.yaml's cpu_gemm auto is oneDNN already, and
    writing onednn would make the file slow on an Intel CPU."""
    import torch

    from gpt2.model import loss

    if not (torch.backends.mkldnn.is_available() and loss.onednn_available()):
        pytest.skip("no oneDNN in this PyTorch build")
    before = committed.read_text()
    monkeypatch.setattr(loss, "cpu_vendor", lambda: "AuthenticAMD")
    done = apply([Change("train.cpu_gemm", "onednn", "x")], committed)
    assert "already holds every winning setting: train.cpu_gemm=onednn (train.cpu_gemm auto runs it here" in done
    assert committed.read_text() == before
    monkeypatch.setattr(loss, "cpu_vendor", lambda: "GenuineIntel")  # auto is BLAS there: onednn is a change
    assert "+  cpu_gemm: onednn" in apply([Change("train.cpu_gemm", "onednn", "x")], committed)


def test_a_dtype_auto_resolves_here_to_the_winner_is_kept(committed, monkeypatch):
    """dtype auto is bf16 on an H100 and fp32 on a CPU: a bf16 rung that wins on the GPU leaves auto in the file."""
    from gpt2.run import device

    before = committed.read_text()
    monkeypatch.setattr(device, "dtype_for", lambda asked, where: "bf16")
    assert "train.dtype=bf16 (train.dtype auto runs it here" in apply([Change("train.dtype", "bf16", "x")], committed)
    assert committed.read_text() == before
    monkeypatch.undo()
    assert "+  dtype: bf16" in apply([Change("train.dtype", "bf16", "x")], committed)  # fp32 on this CPU


def test_uncommitted_edits_and_bad_values_are_never_written(committed):
    committed.write_text(committed.read_text().replace("seed: 1337 ", "seed: 7    ", 1))
    edited = committed.read_text()
    with pytest.raises(UserError, match="params.yaml has uncommitted edits; --apply never overwrites them: commit"):
        apply([Change("train.compile", True, "x")], committed)
    assert committed.read_text() == edited
    git(committed.parent, "commit", "-qam", "seed")
    with pytest.raises(UserError, match=r"--apply: params: train.lr = -1.0 .*left as it was"):
        apply([Change("train.lr", -1.0, "x")], committed)
    assert committed.read_text() == edited


def test_a_missing_key_or_section_is_added_and_a_block_value_replaced():
    text = "train:\n  lr: 1.0  # peak\neval:\n  prompts:\n    - a\n    - b\n  top_k: 3\n"
    assert yaml.safe_load(set_line(text, "train.compile", True))["train"] == {"lr": 1.0, "compile": True}
    assert yaml.safe_load(set_line(text, "eval.prompts", ["c"]))["eval"] == {"prompts": ["c"], "top_k": 3}
    assert yaml.safe_load(set_line(text, "model.attention", "manual"))["model"] == {"attention": "manual"}


def changed_lines(before: str, after: str) -> list[str]:
    import difflib

    return [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(), n=0, lineterm="")
            if line[:1] in "+-" and line[:3] not in ("+++", "---")]


@pytest.mark.parametrize("override", ["train.lr=0.003", "train.max_tokens=100000", "train.distributed=ddp"])
def test_params_yaml_is_in_the_form_dvc_writes_so_a_set_value_is_one_changed_line(tmp_path, override):
    """`dvc exp run -S` writes params.yaml back through DVC's own YAML writer (dvc.utils.hydra.apply_overrides): the
    file is already in that form, so one value set is one line changed, its comment kept."""
    from dvc.utils.hydra import apply_overrides

    before = (ROOT / "params.yaml").read_text()
    path = tmp_path / "params.yaml"
    path.write_text(before)
    apply_overrides(str(path), [override])
    key = override.split("=")[0].split(".")[1]
    [removed, added] = changed_lines(before, path.read_text())
    assert removed.startswith(f"-  {key}:") and added.startswith(f"+  {key}: {override.split('=')[1]} ")
    assert added.split(" # ")[1] == removed.split(" # ")[1]


def test_a_bare_off_is_the_choice_off(committed):
    """params.yaml's `distributed: off` reads as false in YAML 1.1: it already holds a winning "off"."""
    before = committed.read_text()
    said = apply([Change("train.distributed", "off", "y")], committed)
    assert said == "params.yaml already holds every winning setting: train.distributed=\"off\""
    assert committed.read_text() == before


def test_what_apply_writes_dvc_writes_back_unchanged(committed):
    """--apply's lines are DVC's form too (null as nothing, off bare): a later `dvc exp run -S` rewrites none."""
    from dvc.utils.hydra import apply_overrides

    apply([Change("train.max_tokens", None, "x"), Change("train.distributed", "off", "y"),
           Change("train.price_per_hour", 2.5, "z")], committed)  # the first two: as params.yaml has them
    git(committed.parent, "commit", "-qam", "applied")
    applied = committed.read_text()
    apply([Change("train.price_per_hour", None, "back"), Change("model.attention", "manual", "m")], committed)
    written = committed.read_text()
    git(committed.parent, "commit", "-qam", "second")
    assert [line.split("#")[0].rstrip() for line in changed_lines(applied, written)] == [
        "-  attention: flash", "+  attention: manual", "-  price_per_hour: 2.5", "+  price_per_hour:"]
    apply([Change("train.betas", [0.9, 0.99], "b")], committed)  # a list, as DVC writes one: an item a line
    git(committed.parent, "commit", "-qam", "betas")
    assert changed_lines(written, committed.read_text()) == ["-  - 0.95", "+  - 0.99"]
    written = committed.read_text()
    apply_overrides(str(committed), ["train.lr=0.003"])
    assert [line[:8] for line in changed_lines(written, committed.read_text())] == ["-  lr: 1", "+  lr: 0"]
