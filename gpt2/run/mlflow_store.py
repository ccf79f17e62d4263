"""The MLflow store a run logs to: its address, where its artifacts go, one process at a time creating or
upgrading it, and a store an older MLflow made kept as it was before it is upgraded.

The default store is an absolute SQLite DB at the project root, found through ``DVC_ROOT`` so that
``dvc exp run --queue/--temp`` (which run in a temporary copy of the repo) write to the same DB as a plain
``dvc repro``, and from a subfolder as DVC finds the project (gpt2.core.paths).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from gpt2.core import log, paths

logger = log.get("mlflow")


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<project root>/mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{paths.tracking_root() / paths.MLFLOW_DB}"


def artifact_location() -> str | None:
    """Artifacts beside a SQLite DB (``<db folder>/mlartifacts``), not in whatever the working directory is."""
    uri = tracking_uri()
    if not uri.startswith("sqlite:///"):
        return None  # a server or another store: its own default
    return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """One process at a time creates or upgrades a SQLite store, and creates the experiment.

    Runs started together on a fresh project (``dvc queue start -j 3``) would otherwise each create
    the tables and run the migrations at once, and all but one fail. An OS lock on a file beside the DB;
    the OS drops it when a process dies, so it is never stale. Other stores (a server) need none."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri.removeprefix("sqlite:///"))
    try:
        import fcntl
    except ImportError:  # Windows: no flock
        upgrade_older_store(db)
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            upgrade_older_store(db)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def older_store(db: Path) -> str | None:
    """The schema revision of a SQLite store an older MLflow made, or None (no store yet, a current one, one from a
    newer MLflow, not MLflow's)."""
    import sqlite3

    if not db.is_file():
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as connection:
            found = connection.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.Error:
        return None
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config

    script = ScriptDirectory.from_config(_get_alembic_config(""))
    known = {revision.revision for revision in script.walk_revisions()}
    return found[0] if found and found[0] in known and found[0] != script.get_current_head() else None


def upgrade_older_store(db: Path) -> None:
    """A store an older MLflow made, upgraded to this MLflow's schema as ``mlflow db upgrade`` does, after a copy
    of it as it was is kept beside it, and a line saying so. Left to itself, this MLflow upgrades it in place
    without a word where a newer table is missing, and refuses it where none is."""
    if (revision := older_store(db)) is None:
        return
    import shutil

    import mlflow
    import sqlalchemy
    from mlflow.store.db.utils import _upgrade_db

    kept = db.with_name(f"{db.name}.schema-{revision}")
    if not kept.exists():
        shutil.copy2(db, kept)
    logger.warning(f"mlflow: {db} was made by an older MLflow (schema {revision}); upgrading it to MLflow "
                   f"{mlflow.__version__}'s, after which the older MLflow (its UI or server) cannot open it; the "
                   f"store as it was is kept in {kept}")
    engine = sqlalchemy.create_engine(f"sqlite:///{db}")
    try:
        _upgrade_db(engine)
    finally:
        engine.dispose()
