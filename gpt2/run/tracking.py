"""MLflow tracking: a tracker that never costs the run its work, and its retries while the store is down.

MLflow is imported only here and only when tracking is on: the import takes
seconds, and the library must run on machines without it (GPU boxes, CI).
The store a run logs to is gpt2/run/mlflow_store.py's; what a run is called
is gpt2/run/names.py's; a comparison's parent run is gpt2/measure/parent_run.py's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpt2.core import log
from gpt2.core.errors import Stopped, UserError
from gpt2.core.net import reachable
from gpt2.run.figures import shown
from gpt2.run.mlflow_store import artifact_location, store_lock, tracking_uri
from gpt2.run.mlflow_ui import COMPARE_VIEW_KEY, differing, page_url, served, view, view_page, where_to_see
from gpt2.run.names import who

logger = log.get("mlflow")


# A model-training experiment, not a GenAI one (MLflow 3's UI has both kinds).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
VIEW_RUNS = 200  # the latest runs whose differing params are the compare view's param columns


class Tracker:
    """No-op tracker: used when ``train.mlflow`` is false.

    As a context manager every tracker ends its run on the way out, whatever the way: FINISHED when
    the block ran through, KILLED when it was stopped on purpose (Ctrl-C, SIGTERM), FAILED otherwise."""

    run_id: str | None = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        stopped = kind is not None and issubclass(kind, (KeyboardInterrupt, Stopped))
        self.end("FINISHED" if kind is None else "KILLED" if stopped else "FAILED")

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def set_tags(self, tags: dict[str, Any]) -> None: ...

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None: ...

    def log_dataset(self, dataset: dict[str, Any], context: str) -> None: ...

    def describe(self, markdown: str, whole: str = "") -> None: ...

    def log_model(self, name: str, tags: dict[str, str], params: dict[str, Any]) -> None: ...

    def find_model(self) -> None: ...

    def end(self, status: str = "FINISHED") -> None: ...


# How long a tracking call may keep retrying a locked, slow or missing store before the tracker keeps its calls
# for later (the run itself goes on). SQLite waits up to 5 s for a lock within each attempt.
RETRY_BUDGET_S = 15.0
# How often a store that stopped answering is tried again, at the run's next tracking call.
RETRY_EVERY_S = 30.0

# MLflow's HTTP client retries a request 7 times with a 120 s timeout: minutes of silence for a server that is
# down. A run's own limits, unless the user set them.
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


# MLflow's store, its HTTP client and its system-metrics thread log each failure of a call, with a traceback or
# the SQL, before raising it (or, the thread, instead): the tracker says what failed, once, in its own words.
STORE_LOGGERS = ("mlflow.store.db.utils", "mlflow.utils.rest_utils", "mlflow.system_metrics", "sqlalchemy",
                 "alembic", "urllib3.connectionpool")


def silence_store_loggers() -> None:
    for name in STORE_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{exc.__class__.__name__}: {text.splitlines()[0][:200]}" if text else exc.__class__.__name__


DESCRIPTION_CHARS = 8000  # MLflow's limit on a tag's value (mlflow.utils.validation.MAX_TAG_VAL_LENGTH)


def fitted(markdown: str, limit: int, whole: str) -> str:
    """``markdown`` whole where it fits in ``limit`` characters, else its first lines that do and a last line that
    says where the rest is (MLflow would cut it mid-word, with a warning on the user's terminal)."""
    if len(markdown) <= limit:
        return markdown
    tail = f"\n\n… cut here at MLflow's {limit:,}-character limit: the whole text is the run's artifact {whole}"
    return markdown[:markdown.rfind("\n", 0, limit - len(tail))] + tail


class MlflowTracker(Tracker):
    """One MLflow run; resuming a training resumes its run (same run id).

    The tracker is a guest of the run. A store that is locked, slow, unreachable or gone delays a call
    by at most ``RETRY_BUDGET_S``; after that one ``warning:`` line says so, and the tracker keeps every
    call it could not make, in order, with its time. It tries the store again every ``RETRY_EVERY_S`` at
    the run's next call and sends what it kept once the store answers. The run goes on meanwhile: a
    training never loses a step or a checkpoint to its tracker, an evaluation never its reports. What
    the store still lacks when the run ends is said in one line, with ``catch_up_hint`` (how to send it
    later: ``gpt2 replay``; a resumed run or the evaluate stage sends a training's figures too)."""

    def __init__(self, experiment: str, run_id: str | None = None, run_name: str | None = None,
                 kept_in: str = "the reports", started_at: float | None = None, catch_up_hint: str = "",
                 run_uid: str | None = None, keep_duration: bool = False, continues: str | None = None,
                 params: dict[str, Any] | None = None) -> None:
        """Open run ``run_id`` (a resumed training, or evaluate logging into the training's run) or start
        a new one called ``run_name``. An existing run keeps its name: MLflow renames a run it reopens
        with a name, which once made every training run in the UI "evaluate". ``started_at`` (a time.time())
        dates a new run back to when its work began: a grid's or a ladder's run, opened once its runs are
        done, then lasts as long as they did. ``run_uid``: the training's own id (its checkpoint's), a tag of
        the run, which finds the run again where ``run_id`` is not in the store (a replay into a new one).
        ``keep_duration``: ending the reopened run keeps the end time it had, so a finished training's Duration in
        the UI stays what the training took, not the hours until an evaluation added its figures. ``continues``:
        the run this one goes on from with other ``params`` (a resume that changed them); a try of the same
        change that died before its first checkpoint already opened a run for it, which is reopened."""
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        for name, value in HTTP_LIMITS.items():
            os.environ.setdefault(name, value)
        try:
            import mlflow
        except ImportError:
            raise UserError("train.mlflow is true but mlflow is not installed; install the project "
                            "(pip install -c constraints.txt -e .) or set train.mlflow: false") from None
        silence_store_loggers()
        self.mlflow, self.uri, self.kept_in, self.catch_up_hint = mlflow, tracking_uri(), kept_in, catch_up_hint
        self.model: list[str | None] = []  # [its id] once a model is logged or found: later metrics are its too
        self.dataset: list[str] = []  # [name, digest] of the training data once logged: the model's metrics name it
        self.experiment_id: str | None = None
        self.backlog: list[tuple[str, Callable[[], Any]]] = []  # calls the store has not taken yet, in order
        self.down_since: float | None = None  # when the store stopped answering (time.monotonic())
        self.retry_at = 0.0
        self.keep_duration = keep_duration
        self.ended_at: int | None = None  # the reopened run's end time (ms), where keep_duration keeps it
        opening = lambda: self._open(experiment, run_id, run_name, started_at, run_uid, continues,  # noqa: E731
                                     params)
        if served(self.uri) and not reachable(self.uri):
            self.backlog.append(("open the run", opening))
            self._go_down("reach the tracking server", ConnectionError("no answer within 3 s"))
            return
        self.call("open the run", opening)

    @property
    def failed(self) -> bool:
        """Whether the store has calls of this run it has not taken yet."""
        return self.down_since is not None

    def _open(self, experiment: str, run_id: str | None, run_name: str | None, started_at: float | None,
              run_uid: str | None, continues: str | None = None, params: dict[str, Any] | None = None) -> None:
        mlflow = self.mlflow
        mlflow.set_tracking_uri(self.uri)
        with store_lock(self.uri):  # the first call creates (or upgrades) the store's tables
            if mlflow.get_experiment_by_name(experiment) is None:
                mlflow.create_experiment(experiment, artifact_location=artifact_location(), tags=EXPERIMENT_TAGS)
            found = mlflow.set_experiment(experiment)
            self.experiment_id = found.experiment_id
            self._refresh_view(found.tags)
        if run_id is None and continues and (tried := self._continuation(continues, run_uid, params or {})):
            logger.info(f"mlflow: reopening run {tried}, which an earlier try of this resume opened")
            run_id = tried
        if run_id is None and run_name:
            run_name = self._unique(run_name)
        if run_id is None and started_at is not None:  # no system metrics: its work ran in other processes
            created = mlflow.MlflowClient().create_run(self.experiment_id, start_time=int(started_at * 1000),
                                                        run_name=run_name, tags=who())
            self.run = mlflow.start_run(run_id=created.info.run_id, log_system_metrics=False)
        else:
            try:
                self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name,
                                            log_system_metrics=self.down_since is None)
            except mlflow.exceptions.MlflowException:
                if run_id is None:
                    raise
                again = self._run_of(run_uid)
                logger.info(f"mlflow: run {run_id} from the checkpoint is not in {self.uri}; "
                            + (f"continuing run {again}, started for it before" if again else "starting a new run"))
                self.run = mlflow.start_run(run_id=again, run_name=None if again else run_name,
                                            log_system_metrics=self.down_since is None)
            if run_id is None or self.run.info.run_id != run_id:
                mlflow.MlflowClient().log_batch(self.run.info.run_id,
                                                tags=self.run_tags({**who(), "run_uid": run_uid}))
        self.run_id = self.run.info.run_id
        if self.keep_duration and self.run_id == run_id:  # reopening keeps end_time; ending it would move it
            self.ended_at = self.run.info.end_time
        logger.info(f"mlflow: run {self.run_id} ({self.run.info.run_name}) in {self.uri}; "
                    + where_to_see(self.uri, self.experiment_id, self.run_id))

    def _refresh_view(self, tags: dict[str, str] | None = None) -> None:
        """The compare view (``mlflow_ui.view``) with the params that differ among the experiment's latest runs."""
        client = self.mlflow.MlflowClient()
        runs = client.search_runs([self.experiment_id], max_results=VIEW_RUNS)
        shown = json.dumps(view(differing([r.data.params for r in runs])))
        key = f"mlflow.sharedViewState.{COMPARE_VIEW_KEY}"
        if (tags if tags is not None else client.get_experiment(self.experiment_id).tags).get(key) != shown:
            client.set_experiment_tag(self.experiment_id, key, shown)

    def _run_of(self, run_uid: str | None) -> str | None:
        """The run of this experiment tagged with the training's ``run_uid`` (one a replay started), if any."""
        if run_uid is None:
            return None
        runs = self.mlflow.MlflowClient().search_runs([self.experiment_id], f"tags.run_uid = '{run_uid}'",
                                                      max_results=1)
        return runs[0].info.run_id if runs else None

    def _continuation(self, earlier: str, run_uid: str | None, params: dict[str, Any]) -> str | None:
        """A run that went on from ``earlier`` with these ``params`` for this training (``run_uid``) and did not
        finish (it died before its first checkpoint, so the checkpoint still names ``earlier``), if any."""
        if run_uid is None:
            return None
        runs = self.mlflow.MlflowClient().search_runs(  # a finished one is another training: never reopened
            [self.experiment_id], f"tags.resumed_from_run = '{earlier}' and tags.run_uid = '{run_uid}' "
                                  "and attributes.status != 'FINISHED'", order_by=["attributes.start_time DESC"],
            max_results=50)
        wanted = {k: str(v) for k, v in params.items()}
        return next((r.info.run_id for r in runs if r.data.params == wanted), None)

    def _unique(self, name: str) -> str:
        """``name``, or ``name (2)``, ``(3)`` … where runs of this experiment already have it: a second run of
        the same change is another run, and the runs list must tell them apart."""
        client = self.mlflow.MlflowClient()
        quoted = name.replace("'", "\\'")
        taken = {r.info.run_name for r in client.search_runs([self.experiment_id],
                                                              f"attributes.run_name LIKE '{quoted}%'", max_results=500)}
        if name not in taken:
            return name
        n = 2
        while f"{name} ({n})" in taken:
            n += 1
        return f"{name} ({n})"

    def call(self, what: str, call: Callable[[], Any]) -> None:
        """Make one tracking call, retrying a failing store within the budget; past it, keep the call for later.
        While the store is down, calls are kept, and the store is tried again every ``RETRY_EVERY_S``."""
        if self.down_since is not None:
            self.backlog.append((what, call))
            if time.monotonic() >= self.retry_at:
                self._catch_up(0.0)
            return
        try:
            self._attempt(call, RETRY_BUDGET_S)
        except Exception as exc:  # whatever the store raises: SQLAlchemy, HTTP, OS errors
            self.backlog.append((what, call))
            self._go_down(what, exc)

    def _attempt(self, call: Callable[[], Any], budget_s: float) -> None:
        deadline, delay = time.monotonic() + budget_s, 0.5
        while True:
            try:
                call()
                return
            except Exception:
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay *= 2

    def _catch_up(self, budget_s: float) -> bool:
        """Send the kept calls in order; False (and the next try in ``RETRY_EVERY_S``) where the store still fails."""
        sent = 0
        if self.down_since is not None and served(self.uri) and not reachable(self.uri):
            self.retry_at = time.monotonic() + RETRY_EVERY_S  # no answer at all: not worth a request's retries
            return False
        while self.backlog:
            try:
                self._attempt(self.backlog[0][1], budget_s)
            except Exception:  # still down: the rest waits for the next try
                self.retry_at = time.monotonic() + RETRY_EVERY_S
                return False
            self.backlog.pop(0)
            sent += 1
        if self.down_since is not None:
            logger.info(f"mlflow: {self.uri} answers again after {time.monotonic() - self.down_since:.0f} s; "
                        f"sent the {sent} tracking call(s) it missed (system metrics stay off for this run)")
            self.down_since = None
        return True

    def _go_down(self, what: str, exc: BaseException) -> None:
        logger.warning(f"MLflow could not {what} in {self.uri} ({first_line(exc)}); the run goes on and keeps "
                       f"what it could not log (its figures are also in {self.kept_in}): sent when the store "
                       f"answers, tried again every {RETRY_EVERY_S:g} s")
        self.down_since, self.retry_at = time.monotonic(), time.monotonic() + RETRY_EVERY_S
        self._stop_system_metrics()

    def _stop_system_metrics(self) -> None:
        """MLflow's system-metrics thread would go on failing against the store at each sample: stop it."""
        from mlflow.tracking import fluent

        for monitor in list(fluent.run_id_to_system_metrics_monitor.values()):
            monitor._shutdown_event.set()
        fluent.run_id_to_system_metrics_monitor.clear()

    @staticmethod
    def run_tags(tags: dict[str, Any]) -> list[Any]:
        from mlflow.entities import RunTag

        return [RunTag(k, str(v)) for k, v in tags.items() if v is not None]

    def hand_over(self, earlier: str, how: str) -> None:
        """Mark run ``earlier`` as continued in this one: a tag with this run's id, and its name says so, so that no
        list reads its params as what the whole training ran. This run takes the earlier sessions' tags (their
        warm-ups, their resumes), as its history holds their figures."""
        def mark() -> None:
            client = self.mlflow.MlflowClient()
            try:
                run = client.get_run(earlier)
            except self.mlflow.exceptions.MlflowException:
                return  # not in this store (a replay started this run): nothing to mark
            name, mine = run.info.run_name, client.get_run(self.run_id).data.tags
            sessions = {k: v for k, v in run.data.tags.items()
                        if k.startswith(("perf.warmup_s", "resume.step_")) and k not in mine}
            client.log_batch(self.run_id, tags=self.run_tags(sessions))
            client.log_batch(earlier, tags=self.run_tags({"continued_in_run": self.run_id, "continued": how}))
            named = f"{name.split(' (continued in ')[0]} (continued in {self.run.info.run_name})"
            if named != name:  # a later continuation (the one before died before its checkpoint) is named
                client.update_run(earlier, name=named)

        self.call("mark the earlier run as continued in this one", mark)

    def log_params(self, params: dict[str, Any]) -> None:
        def log() -> None:
            existing = self.mlflow.MlflowClient().get_run(self.run_id).data.params
            fresh = {k: v for k, v in params.items() if k not in existing}  # a resumed run keeps its params
            if fresh:
                self.mlflow.log_params(fresh, run_id=self.run_id)
                self._refresh_view()  # this run's params may differ from the others' where none did

        self.call("log the params", log)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        kept = {k: shown(float(v)) for k, v in metrics.items() if v is not None}
        at, model = int(time.time() * 1000), self.model  # as logged now, whenever the store takes it

        def log() -> None:
            from mlflow.entities import Metric

            model_id = model[0] if model else None
            name, digest = self.dataset if model_id and self.dataset else (None, None)
            self.mlflow.MlflowClient().log_batch(self.run_id, metrics=[
                Metric(k, v, at, step, model_id=model_id, dataset_name=name, dataset_digest=digest)
                for k, v in kept.items()])

        self.call(f"log the metrics of step {step}", log)

    def set_tags(self, tags: dict[str, Any]) -> None:
        kept = self.run_tags(tags)
        self.call("set tags", lambda: self.mlflow.MlflowClient().log_batch(self.run_id, tags=kept))

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None:
        """``path`` among the run's artifacts, in ``folder`` (None: at the top)."""
        self.call(f"store {Path(path).name}",
                   lambda: self.mlflow.MlflowClient().log_artifact(self.run_id, str(path), artifact_path=folder))

    def log_dataset(self, dataset: dict[str, Any], context: str) -> None:
        """``dataset`` (gpt2.core.provenance.describe_tokens) as the run's input, so MLflow's dataset column
        tells runs on different corpora or splits apart. ``context``: training or evaluation."""
        def log() -> None:
            from mlflow.tracking.fluent import _create_dataset_input

            tokens = token_dataset(dataset)
            self.mlflow.MlflowClient().log_inputs(self.run_id, [_create_dataset_input(tokens, context)])
            if context == "training":  # the model's metrics name it: the model page's "Datasets used"
                self.dataset[:] = [tokens.name, tokens.digest]

        self.call("log the dataset", log)

    def describe(self, markdown: str, whole: str = "") -> None:
        """The run's description, the first thing its page shows (a grid's or a ladder's verdict and table). Past
        MLflow's limit on a tag it is cut at a line, and says that ``whole`` (an artifact) holds the rest."""
        self.set_tags({"mlflow.note.content": fitted(markdown, DESCRIPTION_CHARS, whole)})

    def share_view(self, key: str, view: dict[str, Any], what: str) -> None:
        """Keep ``view`` as the experiment's shared view ``key`` and say where to open it (``what`` it shows)."""
        def share() -> None:
            self.mlflow.MlflowClient().set_experiment_tag(self.experiment_id, f"mlflow.sharedViewState.{key}",
                                                          json.dumps(view))
            local = "" if served(self.uri) else " (with `mlflow ui` running)"
            logger.info(f"mlflow: {what}: {page_url(self.uri, view_page(self.experiment_id, key))}{local}")

        self.call("share a view of the runs", share)

    def log_model(self, name: str, tags: dict[str, str], params: dict[str, Any]) -> None:
        """This run's model as an MLflow logged model whose weights stay outside MLflow (in DVC's cache): its
        ``tags`` say how to get them back (gpt2/core/provenance.py's ``model_tags``), and the model page's
        description says it in words. The metrics logged after this call are the model's too."""
        where = (f"`{tags['get_weights']}` brings them back into the workspace" if tags.get("get_weights") else
                 f"DVC's cache holds them as `{tags.get('dvc_cache_file')}`")
        note = (f"The weights are not in MLflow: {where}; their MD5 (and DVC hash) is `{tags.get('checkpoint_md5')}`, "
                f"trained on data `{tags.get('data_dvc_hash')}` at commit `{tags.get('git_commit')}`.")

        def create() -> None:
            if slot:  # a retried call: the model is there
                return
            model = self.mlflow.create_external_model(
                name=name, source_run_id=self.run_id, model_type=MODEL_TYPE, experiment_id=self.experiment_id,
                tags={**who(), "mlflow.note.content": note, **{k: str(v) for k, v in tags.items() if v is not None}},
                params={k: str(v) for k, v in params.items()})
            slot.append(model.model_id)

        def link() -> None:  # the run's page lists it under "Logged models"
            from mlflow.entities import LoggedModelOutput

            if slot:
                self.mlflow.MlflowClient().log_outputs(self.run_id, [LoggedModelOutput(slot[0], step=0)])

        slot: list[str | None] = []
        self.model = slot  # the metrics logged from now on are the model's, whenever the store takes them
        self.call("log the model", create)
        self.call("link the model to its run", link)

    def find_model(self) -> None:
        """This run's newest logged model (a training's, which evaluate scores): the metrics logged after this
        call are the model's too. None found (a run from an older version): the run's alone."""
        def find() -> None:
            found = self.mlflow.MlflowClient().search_logged_models(
                [self.experiment_id], filter_string=f"source_run_id = '{self.run_id}'",
                order_by=[{"field_name": "creation_time", "ascending": False}], max_results=1)
            slot.append(found[0].model_id if found else None)

        slot: list[str | None] = []
        self.model = slot
        self.call("find the run's model", find)

    def end(self, status: str = "FINISHED") -> None:
        """End the run with ``status`` once the store has every kept call; where it still does not answer, say
        what it lacks and how to send it, and leave no active run for MLflow's exit hook to end."""
        self.backlog.append((f"end the run as {status}", lambda: self._end(status)))
        if self._catch_up(RETRY_BUDGET_S if self.backlog[:-1] or self.down_since is None else 0.0):
            return
        self._stop_system_metrics()
        from mlflow.tracking import fluent

        with contextlib.suppress(Exception):
            fluent._active_run_stack.get().clear()
        run = f"run {self.run_id}" if self.run_id else "this run (never opened)"
        lacked = len(self.backlog) - 1
        later = f"; {self.catch_up_hint}" if self.catch_up_hint else ""
        logger.warning(f"MLflow's {run} in {self.uri} lacks {lacked} tracking call(s) of this session and is not "
                       f"marked {status}: the store did not answer again; the figures are in {self.kept_in}{later}")

    def _end(self, status: str) -> None:
        active = self.mlflow.active_run()
        ours = active is not None and active.info.run_id == self.run_id
        if ours:
            self.mlflow.end_run(status=status)  # stops the system metrics too
        if not ours or self.ended_at is not None:
            self.mlflow.MlflowClient().set_terminated(self.run_id, status, end_time=self.ended_at)


MODEL_TYPE = "gpt2 checkpoint (weights in DVC's cache)"


def token_dataset(dataset: dict[str, Any]) -> Any:
    """An MLflow dataset that describes a token folder without uploading it: source, digest and profile."""
    import json

    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import HTTPDatasetSource, LocalArtifactDatasetSource

    uri, source = dataset["uri"], dataset["source"]
    if uri.startswith("hf:"):
        from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

        where: Any = HuggingFaceDatasetSource(source.get("hf_dataset") or uri[3:], config_name=source.get("hf_config"),
                                              split=source.get("hf_split"))
    elif uri.startswith(("http://", "https://")):
        where = HTTPDatasetSource(uri)
    else:
        where = LocalArtifactDatasetSource(uri)

    class TokenDataset(MetaDataset):
        @property
        def profile(self) -> dict[str, Any]:
            return dataset["profile"]

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(dataset["profile"])}

    return TokenDataset(where, name=dataset["name"], digest=dataset["digest"])
