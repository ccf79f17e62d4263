"""MLflow tracking: one run per training, resumed with the run, in a DB at the project root."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal

import pytest
from conftest import micro_params, mlflow_store

from gpt2.run.figures import TRACKED
from gpt2.run import checkpoint, mlflow_ui, names, tracking
from gpt2.run.mlflow_store import older_store, tracking_uri
from gpt2.train import trainer
from gpt2.train.trainer import TrainingInterrupted, train

pytest.importorskip("mlflow")


def test_default_uri_is_an_absolute_sqlite_db_at_the_dvc_root(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.chdir("/")
    assert tracking_uri() == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking_uri() == "http://127.0.0.1:5000"


def test_the_printed_link_opens_the_run_where_it_is_and_the_runs_compared():
    server = mlflow_ui.where_to_see("http://mlflow.lab:8080/", "3", "abc")
    assert server.startswith("open http://mlflow.lab:8080/#/experiments/3/runs/abc?workflowType=machine_learning "
                             "(every run compared: http://mlflow.lab:8080/#/experiments/3/runs?viewStateShareKey="
                             "gpt2-compare&workflowType=machine_learning)")
    local = mlflow_ui.where_to_see("sqlite:////p/my runs/mlflow.db", "1", "abc")
    assert local.startswith("see it with `MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --backend-store-uri "
                            "'sqlite:////p/my runs/mlflow.db' --workers 1`, then open "
                            "http://127.0.0.1:5000/#/experiments/1/runs/abc")


def test_a_run_is_named_after_what_it_changes_and_never_twice_the_same(tmp_path, tmp_path_factory, monkeypatch):
    before = {"train.lr": 0.001, "train.seed": 1, "eval.seed": 1, "model.attention": "flash", "train.compile": False}
    after = {**before, "train.lr": 0.002, "train.seed": 2, "model.attention": "manual"}
    assert names.changes_name(before, after) == "lr=0.002 · train.seed=2 · attention=manual"
    assert names.changes_name(before, {**after, "train.compile": True}, most=2) == ("lr=0.002 · train.seed=2 · "
                                                                                        "+2 more")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store(tmp_path_factory, tmp_path))
    titles = []
    for _ in range(3):  # the same change run again is another run, and reads as one
        with tracking.MlflowTracker("gpt2", run_name="lr=0.002") as tracker:
            titles.append(tracker.run.info.run_name)
    assert titles == ["lr=0.002", "lr=0.002 (2)", "lr=0.002 (3)"]
    import mlflow

    experiment = mlflow.MlflowClient().get_experiment_by_name("gpt2")
    view = json.loads(experiment.tags["mlflow.sharedViewState.gpt2-compare"])  # the runs list the link opens
    assert "metrics.`tokens/s IQR`" in view["selectedColumns"]
    assert "metrics.`speed vs ref`" in view["selectedColumns"]
    assert "metrics.`loss p vs ref`" in view["selectedColumns"]


def test_flatten():
    assert names.flatten({"train": {"lr": 1.0, "betas": (0.9, 0.95)}, "x": 1}) == {
        "train.lr": 1.0, "train.betas": (0.9, 0.95), "x": 1}


def test_training_logs_params_metrics_tags_and_artifact(tmp_path, tmp_path_factory, tokens, monkeypatch):
    import mlflow

    uri = mlflow_store(tmp_path_factory, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("DVC_EXP_NAME", "my-exp")
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Ada L")  # who ran it: git's author, as a teammate's commits name them
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "ada@example.org")
    params = micro_params(mlflow=True, max_steps=6, eval_interval=3, log_interval=2)
    original = trainer.lr_at

    def lr_at(step, cfg, *rest):  # interrupt once, at step 3, to check that resuming reuses the run
        if step == 3 and not os.environ.get("STOPPED"):
            os.environ["STOPPED"] = "1"
            os.kill(os.getpid(), signal.SIGINT)
        return original(step, cfg, *rest)

    monkeypatch.setattr(trainer, "lr_at", lr_at)
    monkeypatch.delenv("STOPPED", raising=False)
    with pytest.raises(TrainingInterrupted):
        train(params, tokens, tmp_path / "ckpt.pt", tmp_path / "reports")
    resumed = micro_params(mlflow=True, max_steps=6, eval_interval=3, log_interval=2, lr=5.0e-3)
    train(resumed, tokens, tmp_path / "ckpt.pt", tmp_path / "reports")

    client = mlflow.MlflowClient(uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("gpt2").experiment_id])}
    # MLflow never changes a run's params: resumed with another lr, the training goes on in a run of its own
    assert sorted(runs) == ["my-exp (2)", "my-exp (continued in my-exp (2))"]  # no baseline to compare: DVC's name
    run, first = runs["my-exp (2)"], runs["my-exp (continued in my-exp (2))"]
    assert run.info.status == "FINISHED" and first.info.status == "KILLED"
    assert first.data.tags["continued_in_run"] == run.info.run_id and run.data.tags["resumed_from_run"] == (
        first.info.run_id)
    assert first.data.tags["continued"] == "continued from step 4 with train.lr: 0.01 → 0.005"
    assert first.data.params["train.lr"] == "0.01" and run.data.params["train.lr"] == "0.005"  # what each ran
    assert run.data.tags["host"] and run.data.tags["mlflow.user"] == "Ada L"  # the git user, not the login (root)
    assert run.data.tags["git_user"] == "Ada L <ada@example.org>"
    assert run.data.params["model.n_layer"] == "2"
    assert run.data.tags["resume.step_4"] == "train.lr: 0.01 → 0.005"
    assert run.data.tags["dvc_exp_name"] == "my-exp"
    assert run.data.tags["torch_version"] and run.data.tags["device"] and run.data.tags["dtype"] == "fp32"
    assert run.data.tags["sdpa_backend"]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == [1, 2, 4, 6]  # step 1, every log_interval, the last step; none twice
    for name in ("train/lr", "train/grad_norm", "perf/step_ms", "perf/tokens_per_s", "mem/rss_gb", "val/loss",
                 "val/loss_se", "val/bpb", "val/best_loss", "val/best_step", "val/train_s", "val/tokens"):
        assert client.get_metric_history(run.info.run_id, name), name
    # the warm-up step (compilation) is its own figure, not a point of the speed series
    assert [m.step for m in client.get_metric_history(run.info.run_id, "perf/step_ms")] == [2, 4, 6]
    assert {"perf.warmup_s", "perf.warmup_s.session_2"} <= set(run.data.tags)  # each session's, as a tag
    # the compared figures are metrics (the runs list's columns), the rest of the summary tags: no one-point charts
    summary = sorted(k for k in run.data.metrics if k in TRACKED.values())  # told apart where a header is cut
    # MFU against the CPU's measured peak (conftest's stand-in); no price
    assert summary == ["MFU", "device-hours", "ms/step", "peak GB", "tokens/s", "tokens/s IQR", "val bpb",
                       "val loss final", "val loss se"]
    assert {"summary.train.loss", "summary.wall_s", "summary.perf.tokens_per_s_wall"} <= set(run.data.tags)
    one_point = [k for k in run.data.metrics if len(client.get_metric_history(run.info.run_id, k)) == 1]
    assert sorted(one_point) == summary, one_point
    assert run.data.metrics["val loss final"] == round(run.data.metrics["val loss final"], 4)  # read, not 9 digits
    experiment = client.get_experiment_by_name("gpt2")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "summary.json" in artifacts
    # what the run was made of: its tokens as a dataset input (once, though it resumed), its checkpoint's DVC hash
    [used] = run.inputs.dataset_inputs
    assert {t.key: t.value for t in used.tags} == {"mlflow.data.context": "training"}
    assert used.dataset.name == "tokens" and used.dataset.digest == "test"  # no dvc.lock: the manifest's hash
    assert json.loads(used.dataset.source) == {"uri": tokens.resolve().as_uri()}
    assert json.loads(used.dataset.profile) == {"train_tokens": 20_000, "val_tokens": 4_000, "train_documents": 188,
                                               "val_documents": 38, "tokenizer": "gpt2", "split": "documents",
                                               "digest_from": "meta.json manifest_sha256 (not a DVC output)"}
    md5 = hashlib.md5((tmp_path / "ckpt.pt").read_bytes()).hexdigest()
    assert run.data.tags["checkpoint_md5"] == md5
    # the finished model: an MLflow logged model of the run, its weights left in DVC's cache, named by their hash
    [model] = client.search_logged_models([experiment.experiment_id])
    assert model.source_run_id == run.info.run_id and model.name == "gpt2-tiny"
    assert model.tags["checkpoint_md5"] == md5 and model.tags["data_dvc_hash"] == "test"
    assert model.tags["dvc_cache_file"] == f".dvc/cache/files/md5/{md5[:2]}/{md5[2:]}"
    assert model.tags["get_weights"] == "dvc exp apply my-exp" and "git_commit" in model.tags
    # the code that trained it, as the checkpoint records it: a commit does not name uncommitted changes
    assert model.tags["training_code_md5"] == run.data.tags["training_code_md5"] == checkpoint.load(
        tmp_path / "ckpt.pt")["code"]
    assert model.tags["mlflow.note.content"].startswith("The weights are not in MLflow: `dvc exp apply my-exp` brings")
    assert model.tags["mlflow.user"] == "Ada L"  # the page's "Created by", as the run's
    assert model.params["train.lr"] == "0.005" and model.params["train.max_steps"] == "6"  # what made the weights
    assert {m.key for m in model.metrics} >= {"val loss final", "tokens/s"}
    assert {m.dataset_digest for m in model.metrics} == {run.inputs.dataset_inputs[0].dataset.digest}  # its data
    assert [o.model_id for o in run.outputs.model_outputs] == [model.model_id]  # the run page's "Logged models"
    assert [a.path for a in client.list_logged_model_artifacts(model.model_id)] == ["MLmodel"]  # no copy of the weights


def test_runs_outside_dvc_exp_are_named_after_what_they_trained(tmp_path, tmp_path_factory, tokens, monkeypatch):
    import mlflow

    uri = mlflow_store(tmp_path_factory, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    train(micro_params(mlflow=True, max_steps=2), tokens, tmp_path / "a" / "ckpt.pt", tmp_path / "a")
    train(micro_params(mlflow=True, max_steps=3, model={"attention": "manual"}), tokens, tmp_path / "b" / "ckpt.pt",
          tmp_path / "b")
    client = mlflow.MlflowClient(uri)
    names = sorted(r.info.run_name for r in client.search_runs([client.get_experiment_by_name("gpt2").experiment_id]))
    assert names[0].startswith("tiny 2 steps fp32 flash ") and names[1].startswith("tiny 3 steps fp32 manual ")


def test_the_suite_never_sees_the_users_mlflow_or_dvc_settings():
    """A team's tracking server or DVC config must not receive (or break) the test suite's runs:
    conftest's hermetic_environment removes them for every test and the subprocesses they start."""
    from conftest import USER_SETTINGS

    assert not [name for name in USER_SETTINGS if name in os.environ]
    assert os.environ["DVC_GLOBAL_CONFIG_DIR"] == os.environ["DVC_SYSTEM_CONFIG_DIR"]


def test_processes_that_open_a_fresh_store_at_once_all_log_their_runs(tmp_path):
    """What `dvc queue start -j 2` does on a new project: the store's tables are created once, not twice."""
    import subprocess
    import sys

    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    child = ("import pathlib, sys, time\n"
             "import mlflow\n"
             "from gpt2.run.tracking import MlflowTracker\n"
             "folder, me = pathlib.Path(sys.argv[1]), sys.argv[2]\n"
             "(folder / f'ready{me}').touch()  # imports done: both open the store once both are here\n"
             "deadline = time.time() + 60\n"
             "while len(list(folder.glob('ready*'))) < 2 and time.time() < deadline:\n"
             "    time.sleep(0.005)\n"
             "tracker = MlflowTracker('gpt2', None, 'run' + me)\n"
             "tracker.log_metrics({'train/loss': 1.0}, step=1)\n"
             "tracker.end()\n")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    children = [subprocess.Popen([sys.executable, "-c", child, str(tmp_path), str(i)], env=env,
                                 stderr=subprocess.PIPE, text=True) for i in range(2)]
    errors = [c.communicate(timeout=120)[1] for c in children]
    assert [c.returncode for c in children] == [0, 0], errors
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("gpt2").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["run0", "run1"]



def test_a_store_an_older_mlflow_made_is_kept_as_it_was_before_it_is_upgraded(tmp_path, monkeypatch, caplog):
    """MLflow upgrades such a store in place as it opens it (or refuses it, as here: one migration back, every
    table there), and the MLflow that made it can then no longer read it: the tracker says so, keeps a copy and
    upgrades it; the run is logged. `gpt2 plan`, which only reads, leaves it alone."""
    import mlflow
    import sqlalchemy
    from alembic import command
    from mlflow.store.db import utils

    from gpt2.core import paths
    from gpt2.measure import plan

    db = tmp_path / paths.MLFLOW_DB
    uri = f"sqlite:///{db}"
    mlflow.MlflowClient(uri).search_experiments()  # a current store, then one migration back: an older MLflow's
    config = utils._get_alembic_config(uri)
    with sqlalchemy.create_engine(uri).begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "-1")
    older = older_store(db)
    assert older is not None
    team = tmp_path / "team.db"  # a team server's store, upgraded as docs/sharing.md says
    shutil.copy(db, team)
    from click.testing import CliRunner
    from mlflow.db import commands  # `mlflow db`, in this process

    upgraded = CliRunner().invoke(commands, ["upgrade", f"sqlite:///{team}"])
    assert upgraded.exit_code == 0 and older_store(team) is None, upgraded.output
    monkeypatch.setattr(plan, "_has_metric", lambda db, key: True)
    assert plan._mlflow_mfu(None, "tiny", tmp_path) is None and older_store(db) == older  # untouched
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with tracking.MlflowTracker("gpt2", run_name="first") as tracker:
        assert tracker.run_id and not tracker.failed
    kept = db.with_name(f"{db.name}.schema-{older}")
    assert f"was made by an older MLflow (schema {older}); upgrading it to MLflow {mlflow.__version__}'s" in \
        caplog.text and f"the store as it was is kept in {kept}" in caplog.text
    assert older_store(db) is None and older_store(kept) == older
    caplog.clear()
    with tracking.MlflowTracker("gpt2", run_name="second"):
        pass
    assert "older MLflow" not in caplog.text  # said once: the store is current now

@pytest.mark.parametrize("fault", ["locked", "deleted", "unreachable"])
def test_a_failing_store_never_costs_the_run_its_checkpoint_reports_or_figures(tmp_path, tmp_path_factory, tokens,
                                                                              monkeypatch, capfd, fault):
    """A store locked for a while by another process's write, deleted mid-run, or a server that does not answer:
    one warning, the run trains to its end and writes everything. The tracker keeps what it could not send: a store
    that answers again gets it all, in order, and the run ends FINISHED; one that never does is named at the end
    with `gpt2 replay`, which sends it all later, nothing twice."""
    import sqlite3

    import mlflow
    from click.testing import CliRunner

    from gpt2.cli import main

    db = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI",
                       "http://127.0.0.1:9" if fault == "unreachable" else mlflow_store(tmp_path_factory, tmp_path))
    monkeypatch.setattr(tracking, "RETRY_BUDGET_S", 1.0)
    monkeypatch.setattr(tracking, "RETRY_EVERY_S", 0.0)  # try the store again at every call
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")  # its thread meets the failing store too
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")
    from mlflow.store.db import utils  # MLflow's SQLite sessions wait 20 s for a lock: 1 s here

    text = utils.sql.text
    monkeypatch.setattr(utils.sql, "text", lambda s, *a: text(s.replace("busy_timeout = 20000", "busy_timeout = 1000")))
    original, held = trainer.lr_at, []

    def lr_at(step, cfg, *rest):
        if step == 3 and not held and fault == "locked":  # as a long query in the UI or a script would
            lock = sqlite3.connect(db, isolation_level=None)
            lock.execute("BEGIN EXCLUSIVE")
            held.append(lock)
        elif step == 5 and held and fault == "locked":  # held over step 4: its eval and checkpoint
            held.pop().close()
        elif step == 3 and not held and fault == "deleted":
            db.unlink()
            held.append(None)
        return original(step, cfg, *rest)

    monkeypatch.setattr(trainer, "lr_at", lr_at)
    ckpt = tmp_path / "ckpt.pt"
    summary = train(micro_params(mlflow=True, checkpoint_interval=4), tokens, ckpt, tmp_path / "r")
    err = capfd.readouterr().err
    assert (summary["steps"] == 12 and (tmp_path / "r/metrics.json").is_file()
            and (tmp_path / "r/plots/val.tsv").is_file())
    from gpt2.run import checkpoint

    state = checkpoint.load(ckpt)
    assert state["step"] == 12
    assert err.count("MLflow could not") == 1 and f"its figures are also in {tmp_path / 'r'}" in err
    assert "Traceback" not in err and "Background on this error" not in err
    logged = [r["step"] for r in state["history"]["train"]]
    if fault == "locked":  # the store answered again: everything kept was sent, the run ended as it did
        assert err.count("answers again") == 1 and "lacks" not in err
        client = mlflow.MlflowClient(f"sqlite:///{db}")
        run = client.get_run(state["mlflow_run_id"])
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == logged
        assert run.info.status == "FINISHED" and "val loss final" in run.data.metrics
        return
    assert f"`gpt2 replay {ckpt}` sends them" in err and "is not marked FINISHED" in err
    if fault == "unreachable":
        return
    new = mlflow_store(tmp_path_factory, tmp_path / "replay")  # the run is not in this store: replay starts it again
    for _ in range(2):  # the second sends nothing twice
        result = CliRunner().invoke(main, ["replay", str(ckpt)], env={"MLFLOW_TRACKING_URI": new})
        assert result.exit_code == 0, result.output
    client = mlflow.MlflowClient(new)
    [run] = client.search_runs([client.get_experiment_by_name("gpt2").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == logged
    assert len(client.get_metric_history(run.info.run_id, "val/loss")) == len(state["history"]["val"])
    assert run.info.status == "FINISHED" and run.data.metrics["val loss final"] == round(summary["val"]["loss"], 4)
    assert run.data.params["train.lr"] == str(state["params"]["train"]["lr"])  # comparable by its params again
    assert run.data.params["model.n_layer"] == str(state["params"]["model"]["n_layer"])


def test_a_resume_that_died_before_its_checkpoint_is_continued_in_the_run_it_opened(tmp_path, tmp_path_factory,
                                                                                    monkeypatch):
    """Resumed with another lr, the session dies before it saves: the next try with that lr reopens its run; one
    with yet another lr opens a third, and the first run's name follows."""
    import mlflow

    from gpt2.run.tracking import MlflowTracker

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store(tmp_path_factory, tmp_path))

    def session(run_id=None, continues=None, lr="0.01", ended="KILLED"):
        tracker = MlflowTracker("gpt2", run_id, "exp", str(tmp_path), run_uid="uid-1", continues=continues,
                                params={"train.lr": lr})
        tracker.log_params({"train.lr": lr})
        if continues:
            tracker.set_tags({"resumed_from_run": continues})
            tracker.hand_over(continues, f"continued with train.lr {lr}")
        tracker.end(ended)
        return tracker.run_id

    first = session()
    died = session(continues=first, lr="0.005")
    assert session(continues=first, lr="0.005", ended="FINISHED") == died
    assert session(continues=first, lr="0.005") != died  # a finished continuation is another training's run
    other = session(continues=first, lr="0.002")
    client = mlflow.MlflowClient()
    names = {r.info.run_id: r.info.run_name for r in client.search_runs([client.get_experiment_by_name(
        "gpt2").experiment_id])}
    assert other not in (first, died) and len(names) == 4
    assert names[first] == f"exp (continued in {names[other]})"
    assert client.get_run(first).data.tags["continued_in_run"] == other


def test_a_model_whose_link_to_its_run_failed_is_logged_once(tmp_path, tmp_path_factory, monkeypatch):
    """The store fails after the model was made: the retry links it, and makes no second model."""
    import mlflow

    from gpt2.run.tracking import MlflowTracker

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store(tmp_path_factory, tmp_path))
    monkeypatch.setattr(tracking, "RETRY_BUDGET_S", 0.0)
    monkeypatch.setattr(tracking, "RETRY_EVERY_S", 0.0)
    link, failed = mlflow.MlflowClient.log_outputs, []

    def fails_once(self, *args, **kwargs):
        if not failed:
            failed.append(1)
            raise OSError("disk I/O error")
        return link(self, *args, **kwargs)

    monkeypatch.setattr(mlflow.MlflowClient, "log_outputs", fails_once)
    tracker = MlflowTracker("gpt2", run_name="r", kept_in=str(tmp_path))
    tracker.log_model("gpt2", {"checkpoint_md5": "0" * 32}, {"model.size": "tiny"})
    tracker.log_metrics({"val loss final": 5.0}, step=0)  # the store answers again: the kept link goes first
    tracker.end()
    client = mlflow.MlflowClient()
    models = client.search_logged_models([tracker.experiment_id])
    assert failed and len(models) == 1 and tracker.backlog == []
    assert [o.model_id for o in client.get_run(tracker.run_id).outputs.model_outputs] == [models[0].model_id]


def test_replay_says_so_when_the_store_does_not_answer(tmp_path, tokens, monkeypatch):
    from click.testing import CliRunner

    from gpt2.cli import main

    monkeypatch.setattr(tracking, "RETRY_BUDGET_S", 0.5)
    train(micro_params(max_steps=2), tokens, tmp_path / "ckpt.pt", None)
    result = CliRunner().invoke(main, ["replay", str(tmp_path / "ckpt.pt")],
                                env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"})
    assert result.exit_code != 0 and "did not answer: nothing was sent" in result.output


@pytest.mark.parametrize("raised, status", [(None, "FINISHED"), (KeyboardInterrupt, "KILLED"),
                                            ("Terminated", "KILLED"), ("TrainingInterrupted", "KILLED"),
                                            (ValueError, "FAILED"), ("UserError", "FAILED")])
def test_a_tracker_ends_its_run_with_the_way_its_block_ended(raised, status):
    from gpt2.core.errors import Terminated, UserError
    from gpt2.run.tracking import Tracker
    from gpt2.train.signals import TrainingInterrupted

    kinds = {"Terminated": Terminated, "TrainingInterrupted": TrainingInterrupted, "UserError": UserError}
    raised = kinds.get(raised, raised)
    ended: list[str] = []

    class Recording(Tracker):
        def end(self, status: str = "FINISHED") -> None:
            ended.append(status)

    try:
        with Recording():
            if raised is not None:
                raise raised("stop")
    except BaseException as exc:  # noqa: BLE001 - each kind is re-raised, as the block's own would be
        assert raised is not None and isinstance(exc, raised)
    assert ended == [status]


def test_a_description_past_mlflows_limit_is_cut_at_a_line_and_says_where_the_rest_is():
    """MLflow cuts a longer tag mid-word and prints a warning on the user's terminal (a ladder's report did)."""
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    assert tracking.DESCRIPTION_CHARS == MAX_TAG_VAL_LENGTH
    short = "# Ladder\n\n| a | b |"
    assert tracking.fitted(short, 8000, "ladder.md") == short
    long = "\n".join(f"| rung {i} | {'x' * 60} |" for i in range(200))
    cut = tracking.fitted(long, 8000, "ladder.md")
    kept, _, note = cut.rpartition("\n\n")
    assert len(cut) <= 8000 and long.startswith(kept) and kept.endswith(" |")  # whole lines only
    assert note == "… cut here at MLflow's 8,000-character limit: the whole text is the run's artifact ladder.md"


def test_the_compare_view_shows_the_params_that_differ_and_each_run_s_data_and_model():
    runs = [{"grid.train.lr": "0.001,0.002", "grid.repeats": "1"},  # a grid's parent run: not a training
            {"model.size": "tiny", "train.lr": "0.001", "train.cpu_gemm": "auto"},
            {"model.size": "tiny", "train.lr": "0.002", "train.cpu_gemm": "blas"},
            {"model.size": "tiny", "train.lr": "0.002", "train.loss_chunk": "512"}]
    assert mlflow_ui.differing(runs) == ["train.lr", "train.cpu_gemm", "train.loss_chunk"]  # FIRST_PARAMS lead
    columns = mlflow_ui.view(mlflow_ui.differing(runs))["selectedColumns"]
    assert [c for c in columns if c.startswith("params.")] == [
        "params.`train.lr`", "params.`train.cpu_gemm`", "params.`train.loss_chunk`"]
    assert {"attributes.`Dataset`", "attributes.`Models`"} <= set(columns)
    shown = [c.split("`")[1] for c in columns if c.startswith("metrics.")]
    assert len({name[:14] for name in shown}) == len(shown)  # told apart where MLflow cuts a header
    assert [c for c in mlflow_ui.view([])["selectedColumns"] if c.startswith("params.")][0] == "params.`model.size`"


def test_a_comparison_nests_each_runs_tries_and_gives_its_verdict_to_the_newest(tmp_path, tmp_path_factory,
                                                                                 monkeypatch):
    """A grid stopped in a run and gone on from made that run twice: the killed try and the run made again. Both
    go under the comparison's parent run (not left at the top of the runs list); the verdict is the newest's."""
    import mlflow

    from gpt2.measure.parent_run import adopt

    uri = mlflow_store(tmp_path_factory, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("gpt2")
    made = {}
    tries = (("killed", 1_000, "KILLED"), ("again", 2_000, "FINISHED"), ("other", 1_500, "FINISHED"))
    for label, start, status in tries:
        run = client.create_run(experiment, start_time=start,
                                tags={"comparison_run": "g-2-1" if label == "other" else "g-1-1"})
        client.set_terminated(run.info.run_id, status)
        made[label] = run.info.run_id
    parent = tracking.MlflowTracker("gpt2", run_name="g")
    assert adopt(parent, ["g-1-1", "g-2-1"], metrics={"g-1-1": {"speed vs ref": 1.0}, "g-2-1": {"speed vs ref": 1.2}},
                 since=0.5) == 2
    parent.end()
    runs = {label: client.get_run(run_id) for label, run_id in made.items()}
    assert all(run.data.tags["mlflow.parentRunId"] == parent.run_id for run in runs.values())
    assert "speed vs ref" not in runs["killed"].data.metrics
    assert runs["again"].data.metrics["speed vs ref"] == 1.0 and runs["other"].data.metrics["speed vs ref"] == 1.2
