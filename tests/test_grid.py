"""gpt2 grid's judgement: settings, their order, each against the baseline with its noise (the DVC run is in
tests/test_pipeline.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gpt2.core import paths
from gpt2.measure import grid
from gpt2.measure.experiments import Experiment


def run(name: str, tokens_per_s: float, loss: float = 6.0, se: float = 0.02, evaluated: float | None = None):
    metrics = {paths.TRAIN_METRICS: {"perf": {"tokens_per_s": tokens_per_s, "step_ms": 1e6 / tokens_per_s},
                            "mem": {"peak_gb": 1.0}, "val": {"loss": loss, "loss_se": se}}}
    if evaluated is not None:
        metrics[paths.EVAL_METRICS] = {"eval": {"val_loss": evaluated, "val_loss_se": se / 2}}
    return Experiment(name, "rev", "t", {}, metrics)


def test_settings_in_dvcs_order_and_runs_in_alternating_order():
    sets = grid.parse_sets(("train.lr=1.0e-3,2.0e-3", "model.attention=flash,manual"))
    combos = grid.settings(sets)
    assert combos[0] == {"train.lr": 0.001, "model.attention": "flash"} and combos[1]["model.attention"] == "manual"
    assert len(combos) == 4
    assert grid.schedule(3, 2) == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)]
    # YAML 1.2's booleans, as DVC reads -S: "off" is the word params.yaml documents, not PyYAML's False
    words = grid.parse_sets(("train.fp8=off,rowwise", "train.compile=true,False"))
    assert words == {"train.fp8": ["off", "rowwise"], "train.compile": [True, False]}
    assert grid.describe(grid.settings(words)[0]) == "train.fp8=off · train.compile=true"


def test_each_setting_is_judged_against_the_baseline_run_by_run():
    combos = [{"train.compile": False}, {"train.compile": True}, {"train.threads": 1}, {"train.lr": 9.0}]
    names = [[f"g-{i}-{r}" for r in (1, 2, 3)] for i in range(4)]
    found = {e.name: e for e in [
        run("g-0-1", 100), run("g-0-2", 90), run("g-0-3", 110),  # the machine drifts: the pairs cancel it
        run("g-1-1", 150), run("g-1-2", 135), run("g-1-3", 165),  # 1.5x in every pair: a gain
        run("g-2-1", 104), run("g-2-2", 88), run("g-2-3", 112),  # 1.04, 0.98, 1.02: straddles 1
        run("g-3-1", 100, loss=6.5), run("g-3-2", 90, loss=6.5)]}  # its third run failed; worse loss
    rows = grid.judge(combos, names, found)
    assert rows[1].speedup == 1.5 and rows[1].speed_inside_noise is False
    assert rows[2].speed_inside_noise is True
    assert rows[3].runs == 2 and rows[3].loss_delta == 0.5 and rows[3].loss_apart is True
    assert rows[1].loss_apart is False  # the same loss: inside noise
    said = grid.verdict(rows, 3)
    assert said.startswith("Noise: each setting's runs, paired with the baseline's of the same repeat")
    assert "Faster outside noise: train.compile=true (1.50×)" in said
    assert "Higher val loss outside noise: train.lr=9.0 (+0.500)" in said


def test_one_run_per_setting_decides_nothing_and_says_so(tmp_path):
    combos = [{"train.compile": False}, {"train.compile": True}]
    rows = grid.judge(combos, [["a"], ["b"]], {"a": run("a", 100), "b": run("b", 300)})
    assert rows[1].speedup == 3.0 and rows[1].speed_inside_noise is True
    said = grid.verdict(rows, 1)
    assert said.startswith("**One run per setting: no interval")
    assert "(-S train.max_steps=...) or more repeats (--repeats)" in said and "--steps" not in said  # grid's options
    assert "No setting differs from the baseline outside noise" in said


def test_the_report_marks_noise_and_failures_and_plots_them(tmp_path):
    combos = [{"model.attention": "flash"}, {"model.attention": "manual"}, {"model.attention": "x"}]
    names = [["a-1", "a-2"], ["b-1", "b-2"], ["c-1", "c-2"]]
    found = {e.name: e for e in [run("a-1", 100, evaluated=5.9), run("a-2", 100, evaluated=5.9),
                                 run("b-1", 80, evaluated=5.95), run("b-2", 79, evaluated=5.9)]}
    rows = grid.judge(combos, names, found)
    text, data = grid.write_report(tmp_path, "attn", "attn", {"model.attention": ["flash", "manual", "x"]}, rows, 2,
                                   "evaluate")
    # evaluate's loss (more windows) decides where both have it: 5.95 against 5.90, ± 0.01 each, is apart
    assert "| manual | 2/2 | 6.000 ± 0.020 | 5.950 ± 0.010 | +0.050 | 80 (79–80) | 0.80× |" in text
    assert "| x | 0/2 | failed |" in text and "Slower outside noise: model.attention=manual (0.80×)" in text
    assert (tmp_path / "attn.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attn.json", "attn.md", "attn.png"]
    assert data["failed"] == ["c-1", "c-2"] and data["apply"] == {}
    assert json.loads((tmp_path / "attn.json").read_text()) == data


def curve(seconds_per_eval: float, losses: list[float]):
    return [(seconds_per_eval * (i + 1), 1000.0 * (i + 1), loss) for i, loss in enumerate(losses)]


def test_settings_compare_at_the_baseline_s_final_loss_and_the_winner_is_decided(tmp_path):
    """Equal quality: each run's curve is read where it first reaches its repeat's baseline's final val loss."""
    combos = [{"train.lr": lr, "train.compile": compile} for lr, compile in ((1.0e-3, False), (2.0e-3, False),
                                                                          (1.0e-3, True))]
    names = [[f"g-{i}-{r}" for r in (1, 2)] for i in range(3)]
    found = {e.name: e for e in [run("g-0-1", 100), run("g-0-2", 100), run("g-1-1", 100), run("g-1-2", 101),
                                 run("g-2-1", 130), run("g-2-2", 131, loss=6.5)]}
    curves = {"g-0-1": curve(10, [7.0, 6.5, 6.0]), "g-0-2": curve(10, [7.0, 6.4, 6.1]),  # baseline: 30 s to its end
              "g-1-1": curve(10, [6.5, 6.0, 5.5]), "g-1-2": curve(10, [6.4, 5.9, 5.4]),  # 20 s; 16.7 s to 6.1
              "g-2-1": curve(8, [7.5, 7.2, 7.0]), "g-2-2": curve(8, [7.5, 7.2, 7.0])}  # faster steps, never there
    rows = grid.judge(combos, names, found, curves)
    assert rows[0].quality.speedup == 1.0 and rows[0].quality.time_s.median == 30.0
    higher = rows[1].quality
    assert (higher.paired == pytest.approx([1.5, 30 / (10 + 10 * 0.3 / 0.5)]) and higher.reached == 2
            and not higher.inside_noise)
    assert higher.tokens == pytest.approx(1000 * (2 + 1.6) / 2)
    assert rows[2].quality.reached == 0 and rows[2].quality.speedup == pytest.approx(10 / 24)  # at 7.0, its end
    changes = grid.decide(rows, None, tmp_path / "lr.md")
    assert [(c.key, c.value) for c in changes] == [("train.lr", 2.0e-3), ("train.compile", False)]  # compile: faster
    # steps, a worse loss
    assert "sooner to the baseline's val loss, outside noise" in changes[0].why and "lr.md" in changes[0].why
    said = grid.verdict(rows, 2, None, changes)
    assert "Sooner to the baseline's val loss outside noise: train.lr=0.002" in said
    assert "The winner, which `--apply` writes into params.yaml: train.lr=0.002, train.compile=false." in said
    text, _ = grid.write_report(tmp_path, "lr", "lr", {"train.lr": [1.0e-3, 2.0e-3], "train.compile": [False, True]},
                                rows, 2, "train", None, changes)
    assert "| 30.0 (30.0–30.0) | baseline |" in text and "not reached (0/2)" in text


def test_at_equal_time_the_lower_loss_outside_noise_wins():
    combos = [{"train.lr": 1.0e-3}, {"train.lr": 3.0e-3}, {"train.lr": 9.0e-3}]
    names = [["a"], ["b"], ["c"]]
    found = {"a": run("a", 100, loss=6.0), "b": run("b", 100, loss=5.8), "c": run("c", 200, loss=5.99)}
    assert grid.decide(grid.judge(combos, names, found), 60.0, "r.md") == []  # one run each: no winner
    names = [[n, n + "2"] for n in "abc"]
    found |= {n + "2": dataclasses.replace(e, name=n + "2") for n, e in found.items()}
    rows = grid.judge(combos, names, found)
    changes = grid.decide(rows, 60.0, "r.md")
    assert [(c.key, c.value) for c in changes] == [("train.lr", 3.0e-3)]  # c is faster, but not better at 60 s
    assert changes[0].why == "val loss -0.200 at equal time, outside noise (runs of 60 s) (r.md)"
    assert "Lower val loss at equal time (60 s) outside noise: train.lr=0.003 (-0.200)" in grid.verdict(rows, 1, 60.0)


def test_json_is_printed_before_a_failed_run_is_an_error(tmp_path, monkeypatch, capsys):
    """An agent reads the comparison even when a run failed; the command still ends with one error line."""
    import pytest

    from gpt2.core.errors import UserError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("train:\n  mlflow: false\n")
    monkeypatch.setattr(grid.experiments, "check_repo", lambda root: None)
    monkeypatch.setattr(grid.experiments, "pending", lambda root: [])
    monkeypatch.setattr(grid.experiments, "run_in_turn", lambda *args, **kwargs: None)
    calls = []  # before the runs: none taken; after: g-1-1 finished, g-2-1 failed
    monkeypatch.setattr(grid.experiments, "finished", lambda root, files=(): calls.append(1) or
                        ([run("g-1-1", 100)] if len(calls) > 1 else []))
    monkeypatch.setattr(grid.experiments, "val_curve", lambda root, rev: None)
    with pytest.raises(UserError, match=r"grid: g-2-1 did not finish; see reports/grid/dvc.log"):
        grid.run_grid(("train.lr=1.0e-3,2.0e-3",), name="g", target="train", apply=False, as_json=True,
                      time_budget_s=30.0)
    said = json.loads(capsys.readouterr().out)
    assert said["failed"] == ["g-2-1"] and said["time_budget_s"] == 30.0 and said["rows"][1]["runs"] == 0


def test_a_budget_and_a_length_in_the_grid_are_refused(tmp_path, monkeypatch):
    import pytest

    from gpt2.core.errors import UserError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"-S train.max_steps and --time-budget both set the run's length"):
        grid.run_grid(("train.max_steps=10,20",), time_budget_s=30.0)


def test_a_name_too_long_for_a_file_is_refused_before_any_run(tmp_path, monkeypatch):
    import pytest

    from gpt2.core.errors import UserError

    monkeypatch.chdir(tmp_path)  # not a DVC project: the name is checked before anything else
    with pytest.raises(UserError, match=r"--name is 300 bytes long; .* give one of at most 100"):
        grid.run_grid(("train.lr=1.0e-3,2.0e-3",), name="x" * 300)


FAKE_DVC = """
import os, signal, sys, time
workspace = os.path.join(os.getcwd(), ".dvc", "tmp", "exps", "tmp123")
os.makedirs(workspace)
def clean(*_):  # what DVC does on Ctrl-C: remove its temporary workspace
    os.rmdir(workspace)
    sys.exit(130)
signal.signal(signal.SIGINT, clean)
print("started", flush=True)
time.sleep(60)
"""


def test_a_sigterm_to_the_group_stops_dvc_as_ctrl_c_does_and_leaves_no_workspace(tmp_path):
    """A scheduler's SIGTERM to a grid's or a ladder's process group: DVC would die of it with its temporary
    workspace (a copy of the repo) left in .dvc/tmp; it runs in its own session and gets Ctrl-C instead."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "fake/dvc").mkdir(parents=True)
    (tmp_path / "fake/dvc/__init__.py").write_text("")  # a regular package: it comes before the real one
    (tmp_path / "fake/dvc/__main__.py").write_text(FAKE_DVC)
    child = ("import sys\nfrom pathlib import Path\nfrom gpt2.core.cli import user_errors\n"
             "from gpt2.measure.experiments import run_now\n"
             "user_errors(lambda: run_now(Path.cwd(), 'e', {}, 'train', Path('log.txt')))()\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'fake'}:{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen([sys.executable, "-c", child], cwd=tmp_path, env=env, start_new_session=True,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while "started" not in ((tmp_path / "log.txt").read_text() if (tmp_path / "log.txt").exists() else ""):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGTERM)  # the whole group, as a scheduler does
    assert process.wait(timeout=60) == 143, process.stderr.read()
    assert not (tmp_path / ".dvc/tmp/exps/tmp123").exists()


def test_a_setting_an_earlier_experiment_left_in_params_yaml_is_named_before_a_comparison(tmp_path):
    """`dvc exp run -S train.compile=true` leaves it in the workspace: every later experiment would compile."""
    import subprocess

    from conftest import ROOT, environment

    from gpt2.measure.experiments import uncommitted_params

    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    for command in (["git", "init", "-q"], ["git", "add", "params.yaml"], ["git", "commit", "-qm", "params"]):
        subprocess.run(command, cwd=tmp_path, check=True, env=environment())
    assert uncommitted_params(tmp_path, tmp_path / "params.yaml") == ""
    edited = (tmp_path / "params.yaml").read_text().replace("  compile: false", "  compile: true", 1)
    (tmp_path / "params.yaml").write_text(edited)
    assert uncommitted_params(tmp_path, tmp_path / "params.yaml") == "compile=true"
    assert uncommitted_params(tmp_path / "nowhere", tmp_path / "params.yaml") == ""  # no repository: nothing said
