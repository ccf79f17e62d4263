"""End to end: the real DVC pipeline in a temporary git repo, on a small corpus."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import (commit_all, dvc, environment, exp_rows, mlflow_store, new_project, project_copy, run,
                      set_params)

from gpt2.measure import experiments

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return project_copy(tmp_path_factory, tmp_path_factory.mktemp("e2e"), "all")


def test_repro_produces_every_output(project):
    manifest = json.loads((project / "data/raw/manifest.json").read_text())
    meta = json.loads((project / "data/tokens/meta.json").read_text())
    metrics = json.loads((project / "reports/stats/metrics.json").read_text())
    assert manifest["documents"] == 10
    assert meta["dtype"] == "uint16"
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 10
    assert metrics["tokens"] == meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    for name in ("doc_lengths.tsv", "rank_frequency.tsv", "doc_lengths.png", "rank_frequency.png"):
        assert (project / "reports/stats" / name).stat().st_size > 0
    train = json.loads((project / "reports/train/summary.json").read_text())
    assert train["steps"] == 12 and train["val"]["loss"] > 0
    assert (project / "reports/train/plots/curves.png").read_bytes().startswith(b"\x89PNG")
    assert (project / "reports/validate/params.ok").is_file()
    assert (project / "reports/train/plots/train.tsv").read_text().startswith("step\tloss")
    assert (project / "checkpoints/ckpt.pt").stat().st_size > 0
    evaluation = json.loads((project / "reports/eval/summary.json").read_text())
    assert evaluation["val"]["tokens"] == meta["splits"]["val"]["tokens"] - 1
    assert evaluation["baseline"]["unigram_loss"] > 0
    assert evaluation["checkpoint_run_uid"] == train["run_uid"]  # which run's checkpoint it scored
    assert (project / "reports/eval/samples.md").read_text().startswith("# Samples")


def test_second_repro_does_nothing(project):
    out = dvc(project, "repro").stdout
    assert "Running stage" not in out
    assert "Data and pipelines are up to date" in dvc(project, "status").stdout


def test_a_code_change_reruns_exactly_the_stages_that_run_it(project):
    """Deps are folders: a change anywhere in gpt2/model re-runs train and evaluate, not the data stages; a change
    to the training loop re-runs train alone (evaluate scores the checkpoint, whatever code wrote it)."""
    bytecode = project / "gpt2" / "core" / "__pycache__"
    bytecode.mkdir(exist_ok=True)
    (bytecode / "stray.pyc").write_bytes(b"bytecode")  # not code: ignored
    assert "Data and pipelines are up to date" in dvc(project, "status").stdout
    for edited, stages in (("model/gpt.py", {"train", "evaluate"}), ("train/step.py", {"train"})):
        code = project / "gpt2" / edited
        original = code.read_text()
        try:
            code.write_text(original + "\n# an edit\n")
            assert changed_stages(project) == stages, edited
        finally:
            code.write_text(original)
    assert "Data and pipelines are up to date" in dvc(project, "status").stdout


def changed_stages(project: Path) -> set[str]:
    """The stages ``dvc status`` lists as out of date."""
    return {line.strip().rstrip(":") for line in dvc(project, "status").stdout.splitlines()
            if line and not line.startswith((" ", "\t"))}


def test_metrics_show_lists_the_compared_figures_only(project):
    out = dvc(project, "metrics", "show").stdout
    assert "tokens" in out and "documents" in out and "bytes_per_token" in out and "vocab_coverage" in out
    assert "perf.step_ms" in out and "val.loss" in out and "reports/eval/metrics.json" in out
    assert "runtime" not in out and "top_tokens" not in out and "unigram" not in out  # in the summary.json files


def test_a_params_typo_deletes_nothing_and_the_fixed_rerun_does_not_retrain(project):
    outputs = ["checkpoints/ckpt.pt", "reports/train/metrics.json", "reports/train/plots/train.tsv",
               "reports/eval/metrics.json", "reports/eval/samples.md", "data/tokens/train.bin"]
    before = {name: (project / name).read_bytes() for name in outputs}
    original = (project / "params.yaml").read_text()
    for section, typo, message in (
            ("train", {"foo": 1}, "unknown key 'train.foo'"),
            ("tokenize", {"val_fractoin": 0.2},
             "unknown key 'tokenize.val_fractoin'; did you mean 'tokenize.val_fraction'?")):
        set_params(project, **{section: typo})
        result = dvc(project, "repro", check=False)
        assert result.returncode == 255, result.stdout  # DVC's status for a failed stage (the stage exits 2)
        assert message in result.stderr + result.stdout
        assert "Running stage 'train'" not in result.stdout and "Running stage 'tokenize'" not in result.stdout
        assert {name: (project / name).read_bytes() for name in outputs} == before  # nothing deleted
        assert (project / "reports/validate/params.ok").is_file()  # the last pass's mark: the stages stay up to date
        (project / "params.yaml").write_text(original)
    assert "Data and pipelines are up to date" in dvc(project, "status").stdout
    out = dvc(project, "repro").stdout
    assert "Running stage 'train'" not in out
    # DVC deletes a stage's outs before it runs: a finished checkpoint of the same params rebuilds them
    (project / "reports/train/metrics.json").unlink()
    result = dvc(project, "repro")
    assert "is a finished run of these params and data" in result.stderr + result.stdout
    assert "step 1/" not in result.stderr + result.stdout  # no training step ran
    assert {name: (project / name).read_bytes() for name in outputs} == before


def test_a_failing_evaluate_keeps_the_previous_results(project):
    before = {name: (project / name).read_bytes() for name in ("reports/eval/metrics.json", "reports/eval/samples.md")}
    set_params(project, eval={"prompts": ["word " * 100]})  # longer than the context: evaluate fails
    result = dvc(project, "repro", check=False)
    assert result.returncode != 0 and "longer than the model's context" in result.stderr + result.stdout
    assert {name: (project / name).read_bytes() for name in before} == before
    set_params(project, eval={"prompts": ["The king"]})
    dvc(project, "repro")


def test_speed_only_params_do_not_rerun_but_split_params_do(project):
    original = (project / "params.yaml").read_text()
    set_params(project, tokenize={"workers": 1, "chunk_kb": 64})
    ran = re.findall(r"Running stage '(\w+)'", dvc(project, "repro").stdout)
    assert ran == ["validate"]  # params.yaml is checked again, and nothing else runs
    set_params(project, tokenize={"val_fraction": 0.3})
    out = dvc(project, "repro", "tokenize").stdout
    assert "Running stage 'tokenize'" in out and "Running stage 'download'" not in out
    assert json.loads((project / "data/tokens/meta.json").read_text())["splits"]["val"]["documents"] == 3
    assert changed_stages(project) == {"stats", "train", "evaluate"}  # every stage that reads the new tokens
    (project / "params.yaml").write_text(original)  # back: DVC's run cache brings the old tokens, nothing reruns
    ran = re.findall(r"Running stage '(\w+)'", dvc(project, "repro").stdout)
    assert "train" not in ran and "Data and pipelines are up to date" in dvc(project, "status").stdout


def test_bad_param_stops_the_pipeline_with_one_clear_message(tmp_path):
    root = new_project(tmp_path)
    set_params(root, tokenize={"val_fraction": 0.9})
    result = dvc(root, "repro", check=False)
    assert result.returncode != 0
    assert "tokenize.val_fraction = 0.9 is not allowed; expected a number in (0, 0.5]" in result.stderr + result.stdout
    assert not (root / "data" / "raw").exists()  # checked before the first stage wrote anything


def test_stage_script_error_exit_code_and_no_traceback(tmp_path):
    root = new_project(tmp_path)
    set_params(root, download={"source": str(tmp_path / "missing")})
    result = run(root, sys.executable, "-m", "stages.download", check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("error: download.source: no such file or directory")
    assert "Traceback" not in result.stderr
    assert not (root / "data" / "raw").exists()


def test_a_grid_compares_code_revisions_each_in_its_own_checkout(tmp_path, tmp_path_factory):
    """`gpt2 grid --rev A,B`: B adds a sleep to every step and changes no arithmetic. Each revision runs its own
    code on the workspace's data and params, paired by seed: B reads slower, and its losses are A's to the last
    digit, seed by seed (p = 1: no difference in quality)."""
    mlflow = pytest.importorskip("mlflow")
    root = project_copy(tmp_path_factory, tmp_path)
    set_params(root, train={"mlflow": True})
    mlflow_store(tmp_path_factory, root)
    commit_all(root)
    head = lambda: run(root, "git", "rev-parse", "HEAD").stdout.strip()  # noqa: E731
    a = head()
    step = root / "gpt2/train/step.py"
    step.write_text(step.read_text().replace('    total = torch.zeros((), device=runtime.device)\n',
                                             '    import time\n    time.sleep(0.2)\n'
                                             '    total = torch.zeros((), device=runtime.device)\n'))
    commit_all(root)
    b = head()
    run(root, "git", "checkout", "-q", a)  # the workspace's own code is the baseline's; its params go to all three
    done = run(root, sys.executable, "-m", "gpt2.cli", "grid", "--rev", f"{a},{b}", "--repeats", "2",
               "--target", "train", "--name", "code", "--json")
    said = json.loads(done.stdout)
    assert said["revisions"] == {a: a, b: b}
    base, slow = said["rows"]
    # 0.2 s a step: below 0.6× also on a CPU twice as slow as a 2-core AMD EPYC. Two repeats give the speed test
    # one degree of freedom: it decides where the two pairs agree closely, else the verdict says it could not
    assert slow["versus"]["speed"]["median"] < 0.6
    assert (f"Slower outside noise: revision={b}" in said["verdict"]) is (slow["versus"]["speed"]["inside_noise"]
                                                                         is False)
    assert (f"Too few repeats to decide the speed of: revision={b} (" in said["verdict"]) is slow["versus"]["speed"][
        "inside_noise"]
    assert slow["versus"]["loss"]["per_seed"] == [0.0, 0.0] and slow["versus"]["loss"]["test"]["p"] == 1.0
    assert [r["seed"] for r in base["runs"]] == [r["seed"] for r in slow["runs"]] == [1338, 1339]
    assert said["apply"] == {}  # the baseline is fastest: no winner
    report = (root / "reports/grid/code.md").read_text()
    assert "each the `train` stage of its revision in a checkout of its own (not a DVC experiment" in report
    assert "| run names |" in report and "DVC experiment;" not in report
    assert not (root / ".dvc/tmp/gpt2-revisions").exists() or not any((root / ".dvc/tmp/gpt2-revisions").iterdir())
    assert run(root, "git", "worktree", "list").stdout.count("\n") == 1  # the checkouts are gone
    client = mlflow.MlflowClient(f"sqlite:///{root.resolve()}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("gpt2").experiment_id])
    [parent] = [r for r in runs if r.data.tags.get("kind") == "grid"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["git_commit"] for r in children) == sorted([a, a, b, b])


def test_a_grid_runs_as_dvc_experiments_grouped_under_one_mlflow_run(tmp_path, tmp_path_factory):
    """As a new user: a pipeline run (here recorded with `dvc commit`), commit, then a grid whose first setting is
    the committed one. DVC would find that setting's stages unchanged and hand back the committed run's figures,
    measured some other time: every run of a grid trains in its turn, its own seed (the committed one plus its
    repeat), and is timed there."""
    mlflow = pytest.importorskip("mlflow")
    root = project_copy(tmp_path_factory, tmp_path, "all")
    set_params(root, train={"mlflow": True}, eval={"mlflow": True})
    mlflow_store(tmp_path_factory, root)
    dvc(root, "commit", "-f")  # the pipeline's outputs stand for these params: every stage up to date
    assert "up to date" in dvc(root, "status").stdout
    commit_all(root)
    committed = json.loads((root / "reports/train/metrics.json").read_text())
    lr = yaml.safe_load((root / "params.yaml").read_text())["train"]["lr"]
    # one run per setting: the repeats' order and pairing are tests/test_grid.py's, on figures it chooses
    done = run(root, sys.executable, "-m", "gpt2.cli", "grid", "-S", f"train.lr={lr},3.0e-2", "--name", "lr",
               "--json")
    assert "grid: [2/2] train.lr=0.03, run 1 (lr-2-1)" in done.stderr
    assert "repeat r trains train.seed 1338" in done.stderr and "grid: 2 run(s), about " in done.stderr
    kept = json.loads((root / ".dvc/tmp/gpt2-run-start.json").read_text())  # the next estimate's start and save
    assert kept["runs"] == 2 and kept["run_start_s"] > 0
    table = (root / "reports/grid/lr.md").read_text()
    said = table.split("\n\n")[1:3]  # beside the other test worker, its first words may name the runs it slowed
    assert any(part.startswith("**One run per setting: no interval") for part in said), table
    assert "| train.lr | runs | ms/step median (min–max) | tokens/s median (min–max) | speed vs baseline |" in table
    assert "| 0.03 | 1/1 |" in table and " ± " in table and "× (inside noise) |" in table
    said = json.loads(done.stdout)  # the comparison alone on stdout, for a script or an agent
    assert said["apply"] == {} and said["failed"] == [] and said["judged_by"] == "training's val loss"
    assert said["rows"][0]["at_quality"]["vs_baseline"]["median"] == 1.0 and said["rows"][1]["at_quality"]["runs"] == 1
    exps = {e.name: e for e in experiments.finished(root)}
    assert sorted(exps) == ["lr-1-1", "lr-2-1"]
    baseline = exps["lr-1-1"]  # the committed params but its seed: trained and timed here, not the committed run
    assert baseline.params["train"]["seed"] == 1338 and baseline.params["train"]["lr"] == lr
    assert baseline.metrics["reports/train/metrics.json"]["perf"] != committed["perf"]
    assert baseline.metrics["reports/train/metrics.json"]["val"]["loss"] != committed["val"]["loss"]  # its seed
    for exp in exps.values():
        figures = exp.metrics["reports/train/metrics.json"]
        assert figures["cost"]["device_hours"] > 0 and figures["cost"].get("usd") is None  # a CPU has no price
        # evaluate's outputs persist: without the train stage withdrawing them, the committed run's evaluation
        # would be recorded (and shown) as every train-only experiment's
        assert (exp.metrics["reports/eval/metrics.json"].get("eval") or {}).get("val_loss") is None
    assert (root / "reports/grid/lr.dvc.log").read_text().count("withdrew the evaluation in reports/eval") == 2
    shown_as_users_see_it(root)

    client = mlflow.MlflowClient(f"sqlite:///{root.resolve()}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("gpt2").experiment_id])
    [parent] = [r for r in runs if r.data.tags.get("kind") == "grid"]
    assert parent.info.run_name == "lr" and parent.data.params["grid.train.lr"] == f"{lr},0.03"
    assert parent.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"lr.md", "lr.json", "lr.png"}
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.start_time <= min(r.info.start_time for r in children)  # it lasts as long as the grid
    assert parent.data.metrics["speed vs ref: train.lr 0.03"] > 0 and parent.inputs.dataset_inputs  # each by name
    assert parent.data.tags["apply"] == "nothing"
    assert parent.data.tags["mlflow.note.content"].startswith("**Nothing for `--apply` to write**: no setting wins")
    assert sorted(float(r.data.params["train.lr"]) for r in children) == [lr, 0.03]
    assert {r.data.tags["dvc_exp_name"] for r in children} == set(exps)
    assert {r.data.params["train.seed"] for r in children} == {"1338"}
    [other] = [r for r in children if float(r.data.params["train.lr"]) == 0.03]
    assert other.info.run_name == "train.lr=0.03 · lr" and other.data.tags["grid.setting"] == "train.lr=0.03"
    assert other.data.metrics["speed vs ref"] > 0 and other.data.metrics["speed in noise"] == 1
    assert "One run per setting" in parent.data.tags["mlflow.note.content"]  # the report, as its description
    view = json.loads(client.get_experiment(parent.info.experiment_id)
                      .tags[f"mlflow.sharedViewState.gpt2-grid-{parent.info.run_id}"])  # its runs, by setting
    assert view["searchFilter"] == f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    assert view["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "grid.setting"}]
    assert [c for c in view["selectedColumns"] if c.startswith("params.")] == ["params.`train.lr`"]  # what differs
    assert f"viewStateShareKey=gpt2-grid-{parent.info.run_id}" in done.stderr
    for child in children:  # each training run names the exact data and weights
        assert "eval/val_loss" not in child.data.metrics  # the grid ran to the train stage
        lock = yaml.safe_load(run(root, "git", "show", f"{exps[child.data.tags['dvc_exp_name']].rev}:dvc.lock").stdout)
        outs = {o["path"]: o["md5"] for stage in lock["stages"].values() for o in stage.get("outs", [])}
        assert child.data.tags["checkpoint_dvc_hash"] == outs["checkpoints"]
        inputs = {i.tags[0].value: i.dataset for i in child.inputs.dataset_inputs}
        assert set(inputs) == {"training"}
        assert {d.digest for d in inputs.values()} == {outs["data/tokens"].removesuffix(".dir")}
    assert not list((root / ".dvc" / "tmp").rglob("mlflow.db"))  # nothing landed in the temp copies
    # every model traceable: from the MLflow model of a run to its exact checkpoint (docs/experiments.md)
    models = client.search_logged_models([parent.info.experiment_id])
    [model] = [m for m in models if m.source_run_id == other.info.run_id]
    assert "val loss final" in {m.key for m in model.metrics}
    assert model.tags["get_weights"] == f"dvc exp apply {other.data.tags['dvc_exp_name']}"
    run(root, sys.executable, "-m", "dvc", *shlex.split(model.tags["get_weights"].removeprefix("dvc ")))
    assert hashlib.md5((root / model.tags["checkpoint_path"]).read_bytes()).hexdigest() == model.tags["checkpoint_md5"]


def shown_as_users_see_it(root: Path) -> None:
    """`dvc exp show` of a grid's experiments: training's estimate and evaluate's full pass under distinct names
    (`-` where a train-only run has none), and the README's command within 120 columns, cutting off nothing it
    needs."""
    rows = exp_rows(root)
    [committed] = [r for r in rows if r["rev"] not in ("workspace", "") and not r["Experiment"]]  # the commit
    assert float(committed["val.loss"]) > 0 and float(committed["eval.val_loss"]) > 0
    assert all(float(r["val.loss"]) > 0 and r["eval.val_loss"] == "" for r in rows if r["Experiment"])
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"<!-- exp-show -->\s*```bash\n(.+?)\n```", readme).group(1)
    assert "--no-pager" in command  # DVC's pager cuts every line at the terminal's edge
    shown = run(root, *shlex.split(command.replace("dvc ", f"{sys.executable} -m dvc ", 1)),
                env={"COLUMNS": "120"}).stdout
    assert max(map(len, shown.splitlines())) <= 120, shown
    header = next(line for line in shown.splitlines() if "Experiment" in line)
    for column in ("val.loss", "perf.tokens_per_s", "perf.tokens_per_s_iqr", "train.lr"):  # what changed, too
        assert column in header, shown
    assert "params.yaml" not in header and "train.loss" not in header and "…" not in shown
    table = run(root, *shlex.split(command.replace("dvc ", f"{sys.executable} -m dvc ", 1)), "--md").stdout
    assert table.startswith("| Experiment") and "| train.lr" in table and "…" not in table  # a file's, whole


def test_sigterm_saves_a_checkpoint_and_the_next_run_resumes(tmp_path, tmp_path_factory):
    root = project_copy(tmp_path_factory, tmp_path)
    set_params(root, train={"max_steps": 100000, "eval_interval": 100000, "checkpoint_interval": 100000})
    process = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=root, env=environment(), text=True,
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    for line in process.stderr:
        if line.startswith("step 3/"):
            process.send_signal(signal.SIGTERM)
            break
    err = process.stderr.read()
    assert process.wait(timeout=120) == 143
    assert "error: interrupted by SIGTERM at step" in err and "checkpoint saved to checkpoints/ckpt.pt" in err
    stopped_at = int(err.split("at step ")[1].split("/")[0])
    set_params(root, train={"max_steps": stopped_at + 2})  # a longer run would pass too, just slower
    result = run(root, sys.executable, "-m", "stages.train", check=False)
    assert result.returncode == 0, result.stderr
    assert f"train: resuming at step {stopped_at}/{stopped_at + 2}" in result.stderr
    assert "train.max_steps changed: 100000 → " in result.stderr
