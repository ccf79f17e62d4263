"""gpt2 grid's judgement: settings, their order, each against the baseline with its noise (the DVC run is in
tests/test_pipeline.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpt2.core import paths
from gpt2.core.errors import UserError
from gpt2.measure import experiments, grid, procedure
from gpt2.measure.experiments import Experiment

ROOT = Path(__file__).resolve().parents[1]


def run(name: str, tokens_per_s: float, loss: float = 6.0, se: float = 0.02, evaluated: float | None = None):
    metrics = {paths.TRAIN_METRICS: {"perf": {"tokens_per_s": tokens_per_s, "step_ms": 1e6 / tokens_per_s},
                                     "mem": {"peak_gb": 1.0}, "val": {"loss": loss, "loss_se": se}}}
    if evaluated is not None:
        metrics[paths.EVAL_METRICS] = {"eval": {"val_loss": evaluated, "val_loss_se": se / 2}}
    return Experiment(name, "rev", "t", {}, metrics)


def test_the_comparisons_dvc_logs_are_never_tracked_by_git():
    """Tried with a real grid: once `git add -A` had committed reports/grid/dvc.log, every `dvc exp run` put the
    committed file back over the one the grid was writing, and the grid ended with an empty log (a failed run's
    output with it). The project's .gitignore keeps both logs out of git."""
    ignored = set((ROOT / ".gitignore").read_text().splitlines())
    assert {f"/{paths.GRID_REPORTS}/*.dvc.log", f"/{paths.LADDER_REPORTS}/dvc.log"} <= ignored


def test_settings_in_dvcs_order():
    sets = grid.parse_sets(("train.lr=1.0e-3,2.0e-3", "model.attention=flash,manual"))
    combos = grid.settings(sets)
    assert combos[0] == {"train.lr": 0.001, "model.attention": "flash"} and combos[1]["model.attention"] == "manual"
    assert len(combos) == 4
    # YAML 1.2's booleans, as DVC reads -S: "off" is the word params.yaml documents, not PyYAML's False
    words = grid.parse_sets(("train.fp8=off,rowwise", "train.compile=true,False"))
    assert words == {"train.fp8": ["off", "rowwise"], "train.compile": [True, False]}
    assert grid.describe(grid.settings(words)[0]) == "train.fp8=off · train.compile=true"



def test_values_with_commas_of_their_own_and_the_mistakes_a_set_can_hold():
    """A list's commas are its own (DVC's -S reads the list); a key given twice, an empty value and an unclosed
    bracket are each one line naming the fix, not a silent last-one-wins, a null setting or a YAML traceback."""
    betas = grid.parse_sets(("train.betas=[0.9,0.95],[0.9, 0.99]", 'eval.prompts=["a, b"],[c]'))
    assert betas == {"train.betas": [[0.9, 0.95], [0.9, 0.99]], "eval.prompts": [["a, b"], ["c"]]}
    words = grid.parse_sets(("eval.prompts=[it's],['a, b', 'it''s']",))  # a quote inside a word is a letter
    assert words == {"eval.prompts": [["it's"], ["a, b", "it's"]]}
    assert grid.split_values("k", "'it''s, x',!!str 'a,b'") == ["'it''s, x'", "!!str 'a,b'"]  # YAML's '' and tag
    assert experiments._set_args({"train.betas": [0.9, 0.95]}) == ["-S", "train.betas=[0.9, 0.95]"]  # to DVC
    assert experiments._set_args({"eval.prompts": ["Café"]}) == ["-S", 'eval.prompts=["Café"]']  # as written
    for value in (r"eval.prompts=[a\b]", 'eval.prompts=["${train.lr}"]'):
        with pytest.raises(UserError, match=r"DVC's -S would not pass a backslash or \$\{\.\.\.\} on as written"):
            grid.parse_sets((value,))
    with pytest.raises(UserError, match=r"-S train.lr is given twice; give all its values in one -S: "
                                        r"-S train.lr=0.001,\.\.\."):
        grid.parse_sets(("train.lr=1.0e-3", "train.lr=2.0e-3"))
    with pytest.raises(UserError, match=r"value 2 of 3 is empty; remove the extra comma"):
        grid.parse_sets(("train.lr=1.0e-3,,2.0e-3",))
    with pytest.raises(UserError, match=r"a bracket or a quote is not closed; quote the whole -S"):
        grid.parse_sets(("train.betas=[0.9,0.95",))
    with pytest.raises(UserError, match=r"'@flash' is not a value YAML can read \(found character '@' that cannot"):
        grid.parse_sets(("model.attention=@flash",))


def fake_grid(monkeypatch, tmp_path, results, params="train:\n  mlflow: false\n  seed: 7\n", committed=None):
    """run_grid with DVC replaced: ``results(name, sets)`` gives each planned run's experiment (None: failed)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(params)
    planned = []
    monkeypatch.setattr(experiments, "check_repo", lambda root: None)
    monkeypatch.setattr(experiments, "pending", lambda root, states=(): [])
    monkeypatch.setattr(experiments, "uncommitted_params", lambda root, path: "")
    monkeypatch.setattr(procedure, "run_in_turn", lambda root, runs, *a, **k: planned.extend(runs))
    monkeypatch.setattr(experiments, "finished", lambda root, files=(): [
        e for r in planned if (e := results(r.name, r.sets)) is not None])
    monkeypatch.setattr(experiments, "val_curve", lambda root, rev: None)
    monkeypatch.setattr(experiments, "_json_at", lambda root, rev, path: committed)
    return planned


def test_a_grid_stopped_by_ctrl_c_goes_on_from_its_finished_runs_when_run_again(tmp_path, monkeypatch, caplog):
    """Ctrl-C in the third of four runs ends the grid with the usual error and keeps its plan; the same command
    again (its default name a minute later) takes the same names, keeps the two finished runs and makes the other
    two; a name it had not used, which another grid took meanwhile, gets one of its own. A finished grid keeps no
    plan: the command once more measures all four anew."""
    real_run_in_turn, store, made, stop_at = procedure.run_in_turn, {}, [], [3]
    fake_grid(monkeypatch, tmp_path, lambda name, sets: None)
    monkeypatch.setattr(procedure, "run_in_turn", real_run_in_turn)
    monkeypatch.setattr(experiments, "finished", lambda root, files=(): list(store.values()))

    def run_now(root, name, sets, target, log, run_name=None):
        made.append(name)
        if len(made) == stop_at[0]:
            raise KeyboardInterrupt
        store[name] = run(name, 100 + sets["train.seed"], loss=6.0 + 0.01 * sets["train.seed"])
        return 0

    monkeypatch.setattr(experiments, "run_now", run_now)
    command = {"sets": ("train.lr=1.0e-3,3.0e-3",), "target": "train", "repeats": 2}
    plans = lambda: list((tmp_path / ".dvc/tmp").glob("gpt2-grid-interrupted-*.json"))  # noqa: E731
    monkeypatch.setattr(grid.time, "strftime", lambda pattern: "12-01 10:00")
    with pytest.raises(UserError, match=r"finished runs are kept \(dvc exp show\); the same command again goes on "
                                        r"from them \(to measure them all anew instead: rm \.dvc/tmp/gpt2-grid-"
                                        r"interrupted-[0-9a-f]{12}\.json\)"):
        grid.run_grid(**command)
    names = [f"grid-12-01-10-00-{arm}-{repeat}" for arm, repeat in ((1, 1), (2, 1), (2, 2), (1, 2))]
    assert made == names[:3] and len(plans()) == 1
    store[names[3]] = run(names[3], 50.0)  # another grid's run, made under a name this one had not used yet
    monkeypatch.setattr(grid.time, "strftime", lambda pattern: "12-01 10:01")
    stop_at[0] = 0
    with caplog.at_level("INFO", logger="gpt2.grid"):
        data = grid.run_grid(**command)
    assert made[3:] == [names[2], f"{names[3]}-2"]  # the stopped run again, then the one not begun
    assert "going on from the grid stopped before: 2 of its 4 runs finished then and are kept" in caplog.text
    assert "[3/4] train.lr=0.003, run 2 (grid-12-01-10-00-2-2)" in caplog.text
    assert [[r["name"] for r in row["runs"] if r["ok"]] for row in data["rows"]] == [  # the kept runs read too
        [names[0], f"{names[3]}-2"], names[1:3]]
    assert not (tmp_path / "reports/grid/grid-12-01-10-01.md").exists()
    assert (tmp_path / "reports/grid/grid-12-01-10-00.md").is_file()  # under the stopped grid's name
    assert not plans()
    monkeypatch.setattr(grid.time, "strftime", lambda pattern: "12-01 10:00")
    assert "holds an earlier grid" not in caplog.text  # the stopped grid's own report, written once
    with caplog.at_level("INFO", logger="gpt2.grid"):
        grid.run_grid(**command)  # a finished grid is measured anew, under names of its own
    assert made[5:] == [f"{names[0]}-2", f"{names[1]}-2", f"{names[2]}-2", f"{names[3]}-3"]
    assert ("grid: reports/grid/grid-12-01-10-00.md held an earlier grid named 'grid 12-01 10:00': kept as "
            "reports/grid/grid-12-01-10-00.before-") in caplog.text
    kept = sorted(p.name for p in (tmp_path / "reports/grid").glob("grid-12-01-10-00.before-*"))
    assert [name.rsplit(".", 1)[-1] for name in kept] == ["json", "md", "png"]  # nothing of the first is lost
    caplog.clear()
    with caplog.at_level("INFO", logger="gpt2.grid"):
        grid.run_grid(**command, name="grid-12-01-10-00")  # another name, the same file name
    assert "held an earlier grid named 'grid 12-01 10:00': kept as" in caplog.text


def test_a_grid_stopped_with_other_uncommitted_code_keeps_none_of_its_runs(tmp_path, monkeypatch, caplog):
    """Its runs trained the code the workspace held then: mixed with runs of the code it holds now, the verdict
    would compare two programs and say nothing of it. Tried as a user: an edit, Ctrl-C, the edit undone, the same
    command again."""
    real_run_in_turn, store, made = procedure.run_in_turn, {}, []
    fake_grid(monkeypatch, tmp_path, lambda name, sets: None)
    monkeypatch.setattr(procedure, "run_in_turn", real_run_in_turn)
    monkeypatch.setattr(experiments, "finished", lambda root, files=(): list(store.values()))
    code = ["edited"]
    monkeypatch.setattr(experiments, "code_digest", lambda root: code[0])

    def run_now(root, name, sets, target, log, run_name=None):
        made.append(name)
        if len(made) == 2:
            raise KeyboardInterrupt
        store[name] = run(name, 100.0)
        return 0

    monkeypatch.setattr(experiments, "run_now", run_now)
    command = {"sets": ("train.lr=1.0e-3,3.0e-3",), "target": "train", "name": "mix"}
    with pytest.raises(UserError, match="finished runs are kept"):
        grid.run_grid(**command)
    code[0] = ""  # the edit undone
    with caplog.at_level("INFO", logger="gpt2.grid"):
        grid.run_grid(**command)
    assert ("grid: the same grid stopped before with other uncommitted code (1 finished runs, .dvc/tmp/gpt2-grid-"
            "interrupted-") in caplog.text
    assert "going on from" not in caplog.text and made[2:] == ["mix-1-1-2", "mix-2-1"]  # both anew


def test_repeat_r_trains_its_own_seed_in_every_setting_and_the_grid_judges_them(tmp_path, monkeypatch, capsys):
    """Seeds differ between repeats, never between the settings of one repeat, and never equal the committed
    run's (DVC would skip that stage); the report names them, a large change reads outside noise."""
    def results(name, sets):
        lr, seed = sets.get("train.lr", 0.001), sets["train.seed"]
        return run(name, 100 + seed, loss=(6.0 if lr == 0.001 else 5.7) + 0.01 * (seed % 3), se=0.01)

    planned = fake_grid(monkeypatch, tmp_path, results)
    data = grid.run_grid(("train.lr=1.0e-3,3.0e-3",), name="lr", target="train", repeats=3)
    assert [(r.sets["train.lr"], r.sets["train.seed"]) for r in planned] == [
        (0.001, 8), (0.003, 8), (0.003, 9), (0.001, 9), (0.001, 10), (0.003, 10)]
    assert [run["seed"] for run in data["rows"][1]["runs"]] == [8, 9, 10]
    loss = data["rows"][1]["versus"]["loss"]
    assert loss["delta"] == pytest.approx(-0.3) and loss["apart"] and loss["test"]["p"] < 0.01
    assert "repeat r trains seed 8, 9, 10 (train.seed) for every setting" in data["verdict"]
    assert "Lower val loss outside noise: train.lr=0.003 (-0.300, p" in data["verdict"]
    text = (tmp_path / "reports/grid/lr.md").read_text()
    assert "| 0.001 | 3/3 |" in text and "| lr-2-1, lr-2-2, lr-2-3 |" in text
    assert capsys.readouterr().out.strip() == text.strip()  # the report on stdout, as the ladder's
    assert data["apply"] == {"train.lr": 0.003} and "val loss -0.300 (p < 0.0001)" in data["apply_why"]["train.lr"]
    planned.clear()  # a grid over the seed itself: its values are the settings, the repeats do not change them
    grid.run_grid(("train.seed=1,2",), name="seeds", target="train", repeats=1, mlflow=False)
    assert sorted(r.sets["train.seed"] for r in planned) == [1, 2]


def test_a_key_given_one_value_is_every_runs_and_no_settings_label(tmp_path, monkeypatch, caplog):
    """-S train.max_steps=100 -S model.attention=flash,manual compares two settings, each trained 100 steps: the
    labels name the attention only, the report and the JSON say what every run had."""
    planned = fake_grid(monkeypatch, tmp_path, lambda name, sets: run(
        name, (100 if sets["model.attention"] == "flash" else 150) + sets["train.seed"]))
    with caplog.at_level("INFO", logger="gpt2.grid"):
        data = grid.run_grid(("train.max_steps=100", "model.attention=flash,manual"), name="attn", repeats=1)
    assert all(r.sets["train.max_steps"] == 100 for r in planned) and len(planned) == 2
    assert [row["setting"] for row in data["rows"]] == [{"model.attention": "flash"}, {"model.attention": "manual"}]
    assert [row["label"] for row in data["rows"]] == ["model.attention=flash", "model.attention=manual"]
    assert data["grid"] == {"model.attention": ["flash", "manual"]} and data["held"] == {"train.max_steps": 100}
    assert "2 settings × 1 run(s) (model.attention; every run with train.max_steps=100)" in caplog.text
    assert grid.swept({"train.max_steps": [100]}) == ({}, {"train.max_steps": 100})  # beside --rev's revisions
    assert "each run trains train.max_steps=100; the first setting" in (tmp_path / "reports/grid/attn.md").read_text()
    planned.clear()  # a winner measured under a setting params.yaml lacks: the verdict names what --apply leaves
    data = grid.run_grid(("train.max_steps=100", "model.attention=flash,manual"), name="held", repeats=3,
                         mlflow=False)
    assert data["apply"] == {"model.attention": "manual"}
    assert ("The winner was measured with train.max_steps=100 on every run, which params.yaml does not hold and "
            "`--apply` does not write") in data["verdict"]


def test_a_run_that_kept_the_committed_figures_did_not_run_in_the_comparison(tmp_path, monkeypatch, caplog):
    """DVC skips a train stage whose params equal dvc.lock's and reports the committed run's figures, measured
    some other time: such a run is missing from the comparison, and said so."""
    committed = run("x", 1675.0).metrics[paths.TRAIN_METRICS]
    fake_grid(monkeypatch, tmp_path, lambda name, sets: run(name, 1675.0) if sets["train.seed"] == 1 else
              run(name, 400.0), params="train:\n  mlflow: false\n", committed=committed)
    with pytest.raises(UserError, match=r"grid: g-1-1, g-3-1 did not finish"):
        grid.run_grid(("train.lr=1.0e-3,2.0e-3", "train.seed=1,2"), name="g", target="train")
    assert "g-1-1 did not train: DVC found its train stage unchanged from the last commit" in caplog.text
    assert "g-2-1 did not train" not in caplog.text  # seed 2: trained in its turn


def test_the_report_marks_noise_and_failures_and_plots_them(tmp_path, monkeypatch):
    rates = {"a-1": 100, "a-2": 100, "b-1": 80, "b-2": 80.05}  # one setting, two pairs: one degree of freedom
    fake_grid(monkeypatch, tmp_path, lambda name, sets: run(name, rates[name], evaluated=5.9) if name in rates
              else None)
    monkeypatch.setattr(grid, "_free", lambda name, taken: {"gemm-1-1": "a-1", "gemm-1-2": "a-2", "gemm-2-1": "b-1",
                                                            "gemm-2-2": "b-2"}.get(name, name))
    with pytest.raises(UserError, match=r"gemm-3-1, gemm-3-2 did not finish"):
        grid.run_grid(("train.cpu_gemm=auto,blas,onednn",), name="gemm", target="evaluate", repeats=2)
    text = (tmp_path / "reports/grid/gemm.md").read_text()
    assert text.startswith("# gemm\n\n**2 of 6 runs failed** (gemm-3-1, gemm-3-2; their output is in gemm.dvc.log)")
    assert "| blas | 2/2 | " in text and "| 0.80× |" in text and "evaluate's val loss" in text
    assert "| onednn | 0/2 | failed |" in text and "Slower outside noise: train.cpu_gemm=blas (0.80×)" in text
    assert (tmp_path / "reports/grid/gemm.png").read_bytes().startswith(b"\x89PNG")
    data = json.loads((tmp_path / "reports/grid/gemm.json").read_text())
    assert data["failed"] == ["gemm-3-1", "gemm-3-2"] and data["apply"] == {}



def test_a_setting_that_can_only_fail_is_refused_before_the_first_run(tmp_path, monkeypatch):
    """Every setting is checked as its run's stages will check it: a typo stops the grid at once, not after the
    settings before it have trained."""
    planned = fake_grid(monkeypatch, tmp_path, lambda name, sets: run(name, 100))
    with pytest.raises(UserError, match=r"grid: the setting train.lr=0.001 · model.attention=mnaual cannot run: "
                                        r"params: model.attention = 'mnaual' is not allowed; expected one of 'flash'"):
        grid.run_grid(("train.lr=1.0e-3,2.0e-3", "model.attention=flash,mnaual"), name="g")
    assert planned == []
    grid.run_grid(("train.min_lr=3.0e-5,1.0e-5",), name="small")  # DVC writes 3e-05 (YAML 1.2): a float to the stage
    assert [r.sets["train.min_lr"] for r in planned] == [3e-05, 1e-05]

def test_a_name_with_nothing_to_name_files_after_is_refused(tmp_path, monkeypatch):
    """Tried as a user: --name "" ran the grid under the default name, without a word."""
    planned = fake_grid(monkeypatch, tmp_path, lambda name, sets: run(name, 100))
    for name in ("", " ", "--"):
        with pytest.raises(UserError, match=r"has no letter or digit to name the report's files after"):
            grid.run_grid(("train.lr=1.0e-3,2.0e-3",), name=name)
    assert planned == []


def test_a_target_that_is_no_stage_is_refused_before_the_first_run(tmp_path, monkeypatch):
    """Tried as a user: --target evalute ran every run, each failing in DVC, and the cause was only in the log."""
    planned = fake_grid(monkeypatch, tmp_path, lambda name, sets: run(name, 100))
    (tmp_path / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    with pytest.raises(UserError, match=r"^--target 'evalute' is no stage of dvc.yaml \(validate, download, tokenize, "
                                        r"stats, train, evaluate\); did you mean 'evaluate'\?$"):
        grid.run_grid(("train.lr=1.0e-3,2.0e-3",), name="g", target="evalute")
    assert planned == [] and not (tmp_path / "reports").exists()
    grid.run_grid(("train.lr=1.0e-3,2.0e-3",), name="g", target="dvc.yaml:evaluate")  # a form DVC reads
    assert len(planned) == 2


def test_a_grid_says_what_runs_alike_and_the_uncommitted_code_every_run_trains(tmp_path, monkeypatch, caplog):
    """A grid of params runs the workspace's code, edits and all: its records name the commit, so the report says
    which files differed. A value given twice is an A/A comparison, said before the runs."""
    fake_grid(monkeypatch, tmp_path, lambda name, sets: run(name, 100))
    monkeypatch.setattr(experiments, "uncommitted_code", lambda root: ["gpt2/train/step.py"])
    with caplog.at_level("INFO", logger="gpt2.grid"):
        data = grid.run_grid(("train.lr=1.0e-3,0.001,2.0e-3",), name="g")
    assert "grid: -S train.lr gives 0.001 more than once: those settings train alike (an A/A" in caplog.text
    assert ("grid: 1 run(s) per setting (--repeats 1): the report will give figures and no verdict; --repeats 3 or "
            "more for one") in caplog.text
    assert "grid: every run trains the workspace's code with its uncommitted changes to gpt2/train/step.py (" in \
        caplog.text
    assert data["uncommitted_code"] == ["gpt2/train/step.py"] and data["log"] == "reports/grid/g.dvc.log"
    assert ("as a DVC experiment on the workspace's code with its uncommitted changes to gpt2/train/step.py; "
            in (tmp_path / "reports/grid/g.md").read_text())


def test_uncommitted_code_is_the_code_the_stages_run_as_dvc_yaml_lists_it(tmp_path):
    """An edited test, benchmark or comparison module changes no run: only the stages' deps count, named from the
    project's folder also where it is a subfolder of its git repository."""
    import subprocess

    from conftest import environment

    root = tmp_path / "sub project"
    for name in ("gpt2/train/step.py", "gpt2/measure/grid.py", "tests/test_x.py", "stages/train.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x = 1\n")
    (root / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    for command in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "c"]):
        subprocess.run(command, cwd=tmp_path, check=True, env=environment())
    assert experiments.uncommitted_code(root) == [] and experiments.code_digest(root) == ""
    for name in ("gpt2/train/step.py", "gpt2/measure/grid.py", "tests/test_x.py", "gpt2/train/new.py", "tests/new.py"):
        (root / name).write_text("x = 2\n")
    assert experiments.uncommitted_code(root) == ["gpt2/train/step.py", "gpt2/train/new.py"]
    digest = experiments.code_digest(root)
    (root / "gpt2/train/step.py").write_text("x = 3\n")
    assert experiments.code_digest(root) not in ("", digest)  # the content, not only the names


def test_a_grid_refuses_to_time_beside_a_running_experiment_and_leaves_queued_ones_alone(tmp_path, monkeypatch):
    planned = fake_grid(monkeypatch, tmp_path, lambda name, sets: run(name, 100))
    queue = {"q-1": "Queued", "r-1": "Running"}
    monkeypatch.setattr(experiments, "pending", lambda root, states=(): [n for n, s in queue.items() if s in states])
    with pytest.raises(UserError, match=r"1 queued DVC experiment\(s\) running \(r-1\); a grid times one experiment "
                                        r"at a time .*dvc queue kill"):
        grid.run_grid(("train.lr=1.0e-3,2.0e-3",), name="g")
    assert planned == []
    del queue["r-1"]  # one that waits in the queue shares nothing with the runs timed here
    grid.run_grid(("train.lr=1.0e-3,2.0e-3",), name="g")
    assert len(planned) == 2


def test_json_is_printed_before_a_failed_run_is_an_error(tmp_path, monkeypatch, capsys):
    """An agent reads the comparison even when a run failed; the command still ends with one error line."""
    fake_grid(monkeypatch, tmp_path, lambda name, sets: run(name, 100) if name == "g-1-1" else None)
    with pytest.raises(UserError, match=r"grid: g-2-1 did not finish; see reports/grid/g.dvc.log; the report marks"):
        grid.run_grid(("train.lr=1.0e-3,2.0e-3",), name="g", target="train", apply=False, as_json=True,
                      time_budget_s=30.0)
    said = json.loads(capsys.readouterr().out)
    assert said["failed"] == ["g-2-1"] and said["time_budget_s"] == 30.0 and said["rows"][1]["runs"][0]["ok"] is False
    assert said["verdict"].startswith("**1 of 2 runs failed** (g-2-1; their output is in g.dvc.log): no setting could "
                                      "be compared, so there is no verdict.")


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
    assert uncommitted_params(tmp_path, tmp_path / "params.yaml") == "train.compile=true"
    assert uncommitted_params(tmp_path / "nowhere", tmp_path / "params.yaml") == ""  # no repository: nothing said


def test_apply_scores_held_out_windows_and_refuses_a_win_that_does_not_hold_there(tmp_path, monkeypatch):
    """The verdict's windows picked the winner; --apply writes it only where it holds on windows no verdict read."""
    import subprocess

    from conftest import environment

    def results(name, sets):
        lower = sets["train.lr"] == 0.003
        exp = run(name, 100 + sets["train.seed"], loss=(5.7 if lower else 6.0) + 0.01 * (sets["train.seed"] % 3),
                  se=0.01)
        exp.files[paths.TRAIN_SUMMARY] = {"val": {"holdout_loss": 6.1 + 0.01 * (sets["train.seed"] % 2),
                                                  "holdout_loss_se": 0.01}}  # the same for both: it did not hold
        return exp

    planned = fake_grid(monkeypatch, tmp_path, results)
    for command in (["git", "init", "-q"], ["git", "add", "params.yaml"], ["git", "commit", "-qm", "params"]):
        subprocess.run(command, cwd=tmp_path, check=True, env=environment())
    before = (tmp_path / "params.yaml").read_text()
    data = grid.run_grid(("train.lr=1.0e-3,3.0e-3",), name="lr", target="train", repeats=3, apply=True)
    assert {r.sets["train.holdout_windows"] for r in planned} == {80}  # as much text as the verdict's
    assert data["rows"][1]["versus"]["loss"]["apart"] and data["apply"] == {}
    assert "Not confirmed on the held-out windows, so not applied: train.lr=0.003 (held-out val loss" in data["verdict"]
    assert (tmp_path / "params.yaml").read_text() == before
    table = (tmp_path / "reports/grid/lr.md").read_text()
    assert "| held-out loss vs baseline |" in table and "| +0.000 ± " in table  # beside the verdict's -0.300
    planned.clear()  # a verdict on more text than params.yaml's: the held-out windows are as many
    grid.run_grid(("train.lr=1.0e-3,3.0e-3", "train.eval_windows=120"), name="lr-more", repeats=1, apply=True)
    assert {r.sets["train.holdout_windows"] for r in planned} == {120}


def test_a_revision_trains_the_workspace_s_params_where_it_knows_them(tmp_path):
    """--rev: the same params for every revision, except keys an older revision's code does not know (said)."""
    from pathlib import Path

    from gpt2.measure import revisions

    old = revisions.Checkout("main", "a" * 40, Path("x"), {"train": {"lr": 0.001, "seed": 1}, "eval": {"seed": 3}})
    workspace = {"train": {"lr": 0.002, "seed": 1, "new_flag": True}, "eval": {"seed": 4}}
    params = revisions.params_for(old, workspace, {"train.seed": 1339, "train.max_steps": 5})
    assert params == {"train": {"lr": 0.002, "seed": 1339, "max_steps": 5}, "eval": {"seed": 4}}
    assert revisions.unknown_keys(old, workspace) == ["train.new_flag"]
    assert old.label == "main (aaaaaaa)"
    with pytest.raises(UserError, match=r"names a revision twice; to compare a commit with itself, give it two"):
        revisions.parse_revs("main,main")
    with pytest.raises(UserError, match=r"give two or more git revisions"):
        revisions.parse_revs("main")


def test_a_grid_over_the_seed_refuses_repeats_that_would_train_a_seed_again(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"-S train.seed makes the seeds the settings: .* give --repeats 1"):
        grid.run_grid(("train.seed=1,2",), repeats=3)


def test_what_a_comparison_will_cost_is_said_before_it_starts(tmp_path):
    """Each run's training at the pace of the workspace's last training (its ms per step, its evals' share), plus
    the start and save of each; without a pace or a budget, it says the cost is measured after the first run."""
    from gpt2.measure.planned import RUN_START_S, Planned, expected_cost, keep_run_start

    (tmp_path / "params.yaml").write_text("train:\n  max_steps: 100\n")
    budget = Planned("a", {"train.time_budget_s": 60, "train.max_steps": None}, "a", "a")
    steps = Planned("b", {"train.lr": 0.1}, "b", "b")
    assert "measured once the first ends" in expected_cost(tmp_path, [steps], "grid")  # no training here yet
    assert "about 0:01:30 in all: 60 s" in expected_cost(tmp_path, [budget], "grid")  # a budget needs no pace
    summary = tmp_path / paths.TRAIN_SUMMARY
    summary.parent.mkdir(parents=True)
    summary.write_text(json.dumps({"perf": {"step_ms": 500.0}, "train_s": 100.0, "wall_s": 110.0}))
    said = expected_cost(tmp_path, [budget, steps], "grid")  # 66 s + 55 s of training and evals, two starts
    assert RUN_START_S == 30 and "2 run(s), about 0:03:01 in all" in said and "(a 2-core CPU's)" in said
    (tmp_path / ".dvc").mkdir()  # a comparison here took 12 s and 17 s beyond its 66 s and 55 s of training
    keep_run_start(tmp_path, [(budget, 78.0), (steps, 72.0)])
    said = expected_cost(tmp_path, [budget, steps], "grid")
    assert "about 0:02:30 in all" in said and "about 14 s to start and save it (the median of the last " \
                                                  "comparison's 2 run(s) here)" in said


def test_an_agent_loop_keeps_only_what_holds_on_held_out_text(tmp_path, monkeypatch, capsys):
    """docs/experiments.md's loop, scripted: measure the noise (an A/A grid), then propose learning rates one at a
    time, each against the current one at a fixed budget, reading the JSON and committing what --apply wrote. In
    this made-up world 3e-3 is better everywhere, 1e-2 only on the windows the verdict read: the loop keeps 3e-3
    and discards 1e-2, which a loop without held-out text would have kept."""
    import subprocess

    from conftest import environment

    val = {0.001: 6.0, 0.003: 5.7, 0.01: 5.5}
    held_out = {0.001: 6.0, 0.003: 5.72, 0.01: 6.1}

    def results(name, sets):
        lr, seed = sets["train.lr"] if "train.lr" in sets else current(), sets["train.seed"]
        exp = run(name, 100 + seed % 2, loss=val[lr] + 0.01 * (seed % 3), se=0.01)
        exp.files[paths.TRAIN_SUMMARY] = {"val": {"holdout_loss": held_out[lr] + 0.01 * (seed % 3),
                                                  "holdout_loss_se": 0.01}}
        return exp

    def current():
        import yaml

        return yaml.safe_load((tmp_path / "params.yaml").read_text())["train"]["lr"]

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, env=environment(), capture_output=True, text=True)

    fake_grid(monkeypatch, tmp_path, results, params="train:\n  mlflow: false\n  seed: 7\n  lr: 1.0e-3\n")
    git("init", "-q"), git("add", "params.yaml"), git("commit", "-qm", "baseline")
    kept = []
    for proposal in ("train.log_interval=10,12", "train.lr={current},3.0e-3", "train.lr={current},1.0e-2"):
        grid.run_grid((proposal.format(current=current()),), repeats=3, time_budget_s=60.0, apply=True, as_json=True)
        verdict = json.loads(capsys.readouterr().out)
        if git("diff", "--quiet", "params.yaml").returncode:
            git("commit", "-qam", f"keep: {verdict['apply']}")
            kept.append(verdict["apply"])
    assert kept == [{"train.lr": 0.003}]  # the A/A grid and the overfit 1e-2 wrote nothing
    assert current() == 0.003 and git("rev-list", "--count", "HEAD").stdout.strip() == "2"
    assert "Not confirmed on the held-out windows" in verdict["verdict"]


def test_a_setting_that_changes_no_step_s_work_is_never_called_faster_and_its_move_is_the_noise(tmp_path, monkeypatch):
    """The learning rate changes what a step computes, not how much: its runs reading 0.80x is the machine (here a
    fake one), so it is flagged, counted as noise, and a 0.90x of another setting falls inside that noise; its
    val loss is still judged."""
    def results(name, sets):
        slow = (0.8 if sets["train.lr"] == 0.003 else 1.0) * (0.9 if sets["model.attention"] == "manual" else 1.0)
        seed = sets["train.seed"]
        return run(name, 1000 * slow + seed, loss=(6.0 if sets["train.lr"] == 0.001 else 5.7) + 0.01 * (seed % 3),
                   se=0.01)

    fake_grid(monkeypatch, tmp_path, results)
    data = grid.run_grid(("train.lr=1.0e-3,3.0e-3", "model.attention=flash,manual"), name="g", target="train",
                         repeats=3)
    said = data["verdict"]
    lr_only, manual = "train.lr=0.003 · model.attention=flash", "train.lr=0.001 · model.attention=manual"
    assert f"**Speed moved where it cannot:** {lr_only} (0.80×) changes what a step computes" in said
    assert "Slower outside noise: train.lr=0.003 · model.attention=manual (0.72×)." in said  # past the 20%
    assert f"Lower val loss outside noise: {lr_only} (-0.300" in said
    rows = {r["label"]: r for r in data["rows"]}
    assert rows[lr_only]["same_work"] and rows[lr_only]["versus"]["speed"]["inside_noise"]
    assert not rows[manual]["same_work"] and rows[manual]["versus"]["speed"]["inside_noise"]  # 0.90x: inside 20%


def test_runs_too_short_to_time_are_named_before_the_first_starts(tmp_path):
    """A budget that ends inside the warm-up a training here took, a handful of timed steps, or steps that end
    inside the learning rate's warm-up: said up front (each run's own warning would only reach dvc.log)."""
    from gpt2.measure.planned import Planned, too_short

    (tmp_path / "reports/train").mkdir(parents=True)
    (tmp_path / "reports/train/summary.json").write_text(json.dumps({"perf": {"warmup_s": 38.0, "step_ms": 500}}))
    (tmp_path / "params.yaml").write_text("train:\n  max_steps: 12\n  timing_warmup_steps: 5\n  warmup_steps: 2\n"
                                          "  eval_interval: 4\n")
    runs = [Planned(f"g-{i}-1", {"train.lr": 0.001 * i}, "", "") for i in (1, 2)]
    assert too_short(tmp_path, runs, "grid") == [
        "grid: g-1-1, g-2-1: only 7 step(s) past train.timing_warmup_steps are timed, and a speed read from fewer "
        "than 10 is no measurement; train longer (-S train.max_steps=N) before trusting a speed verdict"]
    budget = [Planned("b-1-1", {"train.time_budget_s": 20.0}, "", "")]
    assert too_short(tmp_path, budget, "ladder") == [
        "ladder: the time budget of b-1-1 (20 s) ends inside the warm-up a training here took (38 s of compilation "
        "and first steps, reports/train/summary.json): no step of theirs would be timed; give them a larger "
        "train.time_budget_s"]
    assert too_short(tmp_path, [Planned("l-1-1", {"train.max_steps": 40}, "", "")], "grid") == []
    warming = [Planned("w-1-1", {"train.max_steps": 30, "train.warmup_steps": 40}, "", "")]
    assert too_short(tmp_path, warming, "grid") == [
        "grid: w-1-1: their 30 steps end before the learning rate's warm-up does (train.warmup_steps 40): they never "
        "train at train.lr, so their speeds hold but their losses compare warm-ups; lower train.warmup_steps or "
        "train longer"]
    warming = [Planned(f"w-{n}-1", {"train.max_steps": n, "train.warmup_steps": 40}, "", "") for n in (13, 30, 40)]
    assert "grid: w-13-1, w-30-1: their 13–30 steps end before" in too_short(tmp_path, warming, "grid")[0]
    few = [Planned("e-1-1", {"train.max_steps": 40, "train.eval_interval": 40}, "", ""),  # the final eval only
           Planned("e-2-1", {"train.max_steps": 41, "train.eval_interval": 40}, "", ""),  # one, and the final
           Planned("e-3-1", {"train.max_steps": 120, "train.eval_interval": 40, "train.final_eval": False}, "", "")]
    assert too_short(tmp_path, few, "grid") == [
        "grid: e-1-1, e-2-1, e-3-1: 1–2 eval(s) a run (train.eval_interval 40): too few to read when a run reaches the "
        "baseline's val loss, so the figures at equal loss will be missing or rough; evaluate more often "
        "(-S train.eval_interval=N, a few evals a run)"]


def test_a_stopped_plan_that_cannot_be_read_is_no_plan(tmp_path):
    """A plan file cut short, from another plan or without its run names: the comparison starts afresh."""
    path = procedure.interrupted_file(tmp_path, "grid", "k" * 64)
    path.parent.mkdir(parents=True)
    for text in ('{"key": "kkk', json.dumps({"key": "other", "names": [["a"]]}), json.dumps({"key": "k" * 64})):
        path.write_text(text)
        assert procedure.interrupted(tmp_path, "grid", "k" * 64) is None
    path.write_text(json.dumps({"key": "k" * 64, "names": [["a"]]}))
    assert procedure.interrupted(tmp_path, "grid", "k" * 64)["names"] == [["a"]]


def test_a_stopped_grid_of_revisions_says_it_keeps_nothing_and_its_runs_leave_the_start_estimate_alone(
        tmp_path, monkeypatch):
    """A revision's run is no DVC experiment: Ctrl-C keeps nothing to go on from (its checkout ends with the grid),
    and its start, seconds shorter than an experiment's, is not what the next comparison's estimate reads."""
    from gpt2.measure import planned as planned_module
    from gpt2.measure import revisions

    (tmp_path / ".dvc").mkdir()
    (tmp_path / "params.yaml").write_text("train: {}\n")
    kept: list[list[str]] = []
    monkeypatch.setattr(procedure, "keep_run_start", lambda root, runs: kept.append([r.name for r, _ in runs]))
    monkeypatch.setattr(planned_module, "too_short", lambda *a: [])
    calls = []

    def run(checkout, name, params, target, log, run_name=None):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return 0

    monkeypatch.setattr(revisions, "run", run)
    monkeypatch.setattr(revisions, "collect", lambda checkout, name: None)
    runs = [planned_module.Planned(f"rev-{i}", {}, f"revision={i}", f"r{i}", checkout=object(),
                                   params={"train": {"max_steps": 10}}) for i in (1, 2)]
    with pytest.raises(UserError, match="the running run was stopped; the revisions' checkouts end with the grid, "
                                        "which keeps none of its runs: the same command again starts over"):
        procedure.run_in_turn(tmp_path, runs, "train", tmp_path / "dvc.log", "grid")
    assert calls == ["rev-1", "rev-2"] and kept == []


@pytest.mark.parametrize("sets", [("train.warmup_steps=1000", "train.max_steps=10"), ("train.seed=5",)])
def test_a_grid_of_one_setting_is_refused_before_it_runs(tmp_path, monkeypatch, sets):
    """Every -S with one value (a comma forgotten): one setting, nothing to compare it with, refused before a run."""
    planned = fake_grid(monkeypatch, tmp_path, lambda name, sets: None)
    with pytest.raises(UserError, match="every -S gives one value, so the grid is one setting with nothing to "
                                        "compare it with; give the key you compare two values or more"):
        grid.run_grid(sets, name="one")
    assert not planned


def test_a_lower_loss_measured_inside_the_learning_rates_warm_up_is_never_applied(tmp_path, monkeypatch):
    """Runs that end before train.warmup_steps never train at train.lr: a learning rate that lowers their loss
    wins the first steps only. The verdict says so by name and --apply writes nothing, though the loss is lower
    on every seed and on the held-out windows too; the same runs trained past the warm-up are applied."""
    import subprocess

    from conftest import environment

    warmup = [40]

    def results(name, sets):
        lower = sets["train.lr"] == 0.003
        exp = run(name, 100 + sets["train.seed"], loss=(5.7 if lower else 6.0) + 0.01 * (sets["train.seed"] % 3),
                  se=0.01)
        exp.params["train"] = {"warmup_steps": warmup[0]}
        exp.files[paths.TRAIN_SUMMARY] = {"steps": 30, "val": {"holdout_loss": (5.7 if lower else 6.0) + 0.01 * (
            sets["train.seed"] % 2), "holdout_loss_se": 0.01}}
        return exp

    fake_grid(monkeypatch, tmp_path, results)
    for command in (["git", "init", "-q"], ["git", "add", "params.yaml"], ["git", "commit", "-qm", "params"]):
        subprocess.run(command, cwd=tmp_path, check=True, env=environment())
    before = (tmp_path / "params.yaml").read_text()
    data = grid.run_grid(("train.lr=1.0e-3,3.0e-3",), name="lr", target="train", repeats=3, apply=True)
    assert data["rows"][1]["versus"]["loss"]["apart"] and data["apply"] == {}
    assert ("Measured inside the learning rate's warm-up, so not applied: train.lr=0.003 (its runs end at step 30, "
            "inside the learning rate's warm-up (train.warmup_steps 40): their val losses compare warm-ups"
            in data["verdict"])
    assert (tmp_path / "params.yaml").read_text() == before
    warmup[0] = 3
    subprocess.run(["git", "commit", "-qam", "x", "--allow-empty"], cwd=tmp_path, check=True, env=environment())
    data = grid.run_grid(("train.lr=1.0e-3,3.0e-3",), name="lr-past", target="train", repeats=3, apply=True)
    assert data["apply"] == {"train.lr": 0.003} and "warm-up" not in data["verdict"]


def test_revisions_that_compare_no_code_are_said_before_the_first_run(tmp_path):
    """--rev compares code: a revision with the baseline's commit, or one that changes only params.yaml (which every
    run takes from the workspace), is said before the runs, and so is code edited and not committed."""
    import subprocess

    from conftest import environment

    from gpt2.measure.revisions import Checkout, same_code

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True,
                              env=environment()).stdout.strip()

    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2/step.py").write_text("x = 1\n")
    (tmp_path / "params.yaml").write_text("train:\n  lr: 1.0e-3\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "base")
    base = git("rev-parse", "HEAD")
    (tmp_path / "params.yaml").write_text("train:\n  lr: 2.0e-3\n")
    git("commit", "-qam", "params only")
    params_only = git("rev-parse", "HEAD")
    (tmp_path / "gpt2/step.py").write_text("x = 2\n")
    git("commit", "-qam", "code")
    code = git("rev-parse", "HEAD")
    at = {c: Checkout(name, c, tmp_path) for name, c in (("main", base), ("lr", params_only), ("mine", code))}
    assert same_code(tmp_path, [at[base], at[code]]) == []
    [said] = same_code(tmp_path, [at[base], at[params_only]])
    assert said.startswith("--rev lr changes none of main's code") and "compare params with -S key=a,b" in said
    [said] = same_code(tmp_path, [at[base], Checkout("HEAD~2", base, tmp_path)])
    assert said == f"--rev main and HEAD~2 are the same commit ({base[:7]}): the grid compares its code with itself " \
                   "(an A/A comparison, this machine's noise)"
    (tmp_path / "gpt2/step.py").write_text("x = 3\n")
    (tmp_path / "params.yaml").write_text("train:\n  lr: 3.0e-3\n")  # params are the workspace's anyway
    [said] = same_code(tmp_path, [at[base], at[code]])
    assert said == ("the workspace's uncommitted changes to gpt2/step.py are in no revision (each runs its commit): "
                    "to compare them, commit them on a branch of their own and add that branch to --rev")
    (tmp_path / "gpt2/new.py").write_text("x = 1\n")  # a new module, not yet added: code all the same
    [said] = same_code(tmp_path, [at[base], at[code]])
    assert "uncommitted changes to gpt2/step.py, gpt2/new.py are in no revision" in said
