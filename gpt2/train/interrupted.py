"""The interrupted runs kept under DVC, so that running the same ``dvc exp run`` again resumes them.

``dvc exp run`` restores its baseline's outputs before it runs: the checkpoint of an interrupted
experiment would be replaced by the baseline's, and the run would start over. So a run stopped by
Ctrl-C or SIGTERM keeps a copy in ``.dvc/tmp/gpt2-interrupted/`` (neither git nor DVC track it), and
under ``dvc exp run`` so does each save, as a hard link (a run killed outright, by SIGKILL or a lost
machine, has no chance to keep anything at its end); named by what must match to resume it (model,
data, optimizer) and by its exact train params. A finished run drops its copies; no run takes up one
whose run is still training; and each run's start says which are kept and removes those that can
never resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpt2.core import log
from gpt2.core.atomic import alive, atomic_file, sweep_stale
from gpt2.core.config import REUSABLE_TRAIN_FIELDS, to_dict
from gpt2.run.names import COMPARISON_RUN_ENV
from gpt2.train.build import Setup
from gpt2.train.signals import TrainingInterrupted

logger = log.get("train")


@contextlib.contextmanager
def kept_if_interrupted(path: Path, s: Setup, resumed_from: Path | None) -> Iterator[None]:
    """Around a session's training: keep the checkpoint of a run that is interrupted, drop the kept copies of one
    that finishes (``resumed_from``: the kept copy this session resumed, if any)."""
    try:
        yield
    except TrainingInterrupted:
        if s.dist.main and s.params.train.save_checkpoint:
            keep_interrupted(path, s, resumed_from)
        raise
    if s.dist.main:
        drop_interrupted(s, resumed_from)


def run_key(s: Setup) -> str:
    """What a kept interrupted run must share with a run to be resumed by it: the model, the data and the
    optimizer (the rules ``load_for_resume`` enforces). Other train settings may change, as in a plain resume."""
    return _digest({"model": to_dict(s.params.model), "optimizer": s.params.train.optimizer, "data": s.data_identity})


def params_key(s: Setup) -> str:
    """Every train param (tracking switches aside): which of several kept runs of one ``run_key`` is this run's."""
    return _digest({k: v for k, v in to_dict(s.params.train).items() if k not in REUSABLE_TRAIN_FIELDS})


def _digest(value: Any) -> str:
    return hashlib.sha256(_same(value).encode()).hexdigest()[:16]


def interrupted_dir() -> Path | None:
    """Where a stage run by DVC keeps its interrupted runs: the project's ``.dvc/tmp`` (neither git nor DVC
    track it). None outside DVC, where the checkpoint stays in place and nothing restores another over it."""
    root = os.environ.get("DVC_ROOT")
    return Path(root) / ".dvc" / "tmp" / "gpt2-interrupted" if root and (Path(root) / ".dvc").is_dir() else None


def keep_interrupted(path: Path, s: Setup, resumed_from: Path | None) -> Path | None:
    """Keep the interrupted run's checkpoint beside the project's DVC state (``keep_saved``: a copy, in place of
    the link its saves kept), and drop the kept copy it resumed under other settings: one copy a run."""
    kept = keep_saved(path, s)
    if kept is not None and resumed_from is not None and resumed_from != kept:
        _remove_kept(resumed_from)
    return kept


def keep_saved(path: Path, s: Setup, running: bool = False) -> Path | None:
    """Under DVC, keep the checkpoint just saved where the same command finds it again: ``dvc exp run`` restores
    its baseline's outputs before it runs, so it would otherwise find another run in ``checkpoints/`` and start
    over. A stopped run keeps a copy: a tool that rewrites the checkpoint in place (``cp``) would change a linked
    one too. A run that goes on (``running``: a periodic save) keeps a hard link, at no second write that would
    stall its steps: a save replaces the checkpoint by a rename, and DVC's checkout deletes it before it writes
    the baseline's, so the link keeps the run's bytes (none where the file system has no links). A JSON beside it
    says what it is (for the listing at a run's start) and, while the run goes on, its process, so that no other
    run takes it up meanwhile."""
    folder = interrupted_dir()
    if folder is None or not path.is_file():
        return None
    kept = _exact(folder, s)
    if running:
        folder.mkdir(parents=True, exist_ok=True)
        sweep_stale(kept)  # a link a killed process left between its link and its rename
        link = kept.with_name(f".{kept.name}.tmp-{os.getpid()}")  # sweep_stale's naming
        link.unlink(missing_ok=True)
        try:
            os.link(path, link)
        except OSError:
            return None
        os.replace(link, kept)
    else:
        with atomic_file(kept) as tmp:
            shutil.copyfile(path, tmp)
    _describe(kept, s, running)
    return kept


def _describe(kept: Path, s: Setup, running: bool) -> None:
    about = {"data": s.data_identity, "model": to_dict(s.params.model), "train": to_dict(s.params.train),
             "running": os.getpid() if running else None}
    kept.with_suffix(".json").write_text(json.dumps(about, default=str))


def _running(kept: Path) -> bool:
    """Whether another process is still training the run kept in ``kept`` (a queued or parallel experiment)."""
    try:
        pid = json.loads(kept.with_suffix(".json").read_text()).get("running")
    except (OSError, ValueError):
        return False
    return isinstance(pid, int) and pid != os.getpid() and alive(pid)


def kept_interrupted(s: Setup) -> Path | None:
    """This run's kept interrupted copy: the one of its exact params, else the newest of its model, data and
    optimizer (resumed with its changed settings, as a plain resume would be); never one another process is
    still training. A grid's or a ladder's run takes only its own: another run's weights under its settings would
    be compared as if it had trained them."""
    folder = interrupted_dir()
    if folder is None or not folder.is_dir():
        return None
    exact = _exact(folder, s)
    if exact.is_file() and not _running(exact):
        return exact
    others = sorted((p for p in folder.glob(f"{run_key(s)}.*.pt") if p != exact and not _running(p)),
                    key=lambda p: p.stat().st_mtime)
    if others and os.environ.get(COMPARISON_RUN_ENV):
        logger.info(f"train: a comparison's run starts from its own settings: the interrupted run kept in "
                    f"{others[-1]} (other train settings) is not resumed, and stays kept for the run it belongs to")
        return None
    return others[-1] if others else None


def is_own(kept: Path, s: Setup) -> bool:
    """Whether a kept copy is of this run's exact params (not another run's, continued under them)."""
    return kept.name == _exact(kept.parent, s).name


def drop_interrupted(s: Setup, resumed_from: Path | None) -> None:
    """The run finished: its interrupted copies are no longer needed."""
    folder = interrupted_dir()
    if folder is not None:
        _remove_kept(_exact(folder, s))
    if resumed_from is not None:
        _remove_kept(resumed_from)


def _exact(folder: Path, s: Setup) -> Path:
    """The kept copy of this run's exact params."""
    return folder / f"{run_key(s)}.{params_key(s)}.pt"


def _same(value: Any) -> str:
    """``value`` as JSON, the same text for the same content (a tuple and its list alike)."""
    return json.dumps(value, sort_keys=True, default=str)


def _remove_kept(path: Path) -> None:
    """A kept copy and what it is, and their folder once it holds nothing else."""
    path.unlink(missing_ok=True)
    path.with_suffix(".json").unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # others are kept in it, or it is gone
        path.parent.rmdir()


def tidy_interrupted(s: Setup) -> None:
    """At a run's start under DVC: say which interrupted runs are kept, and remove those that can never resume
    (trained on data that is no longer the project's: a resume would be refused)."""
    folder = interrupted_dir()
    if folder is None or not folder.is_dir():
        return
    kept = []
    for path in sorted(folder.glob("*.pt")):
        if _running(path):  # a queued or parallel experiment's, while it trains
            continue
        try:
            about = json.loads(path.with_suffix(".json").read_text())
        except (OSError, ValueError):
            about = {}
        if "data" in about and _same(about["data"]) != _same(s.data_identity):
            logger.info(f"train: removed the interrupted run kept in {path}: it trained on other data, which a "
                        "resume refuses")
            _remove_kept(path)
            continue
        kept.append((path, about))
    if kept:
        size = sum(p.stat().st_size for p, _ in kept) / 1e6
        now = json.loads(_same(to_dict(s.params.train)))

        def changed(about: dict[str, Any]) -> str:
            return ", ".join(f"{k}={v}" for k, v in about.get("train", {}).items() if now.get(k) != v) or "these params"

        shown = "; ".join(f"{p.name[:8]}… ({changed(a)})" for p, a in kept[:5])
        logger.info(f"train: {len(kept)} interrupted run(s) kept in {folder} ({size:,.0f} MB): {shown}; each resumes "
                    "when its model, data and optimizer run again (docs/training.md), or delete them")
