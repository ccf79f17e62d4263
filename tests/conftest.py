"""Shared fixtures: small corpora, params files and a CLI runner."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner


def pytest_configure(config: pytest.Config) -> None:
    """Every process of the suite keeps the bytecode it compiles. The suite starts hundreds of Python processes
    (stages, torchrun ranks, DVC, its xdist workers), and where PYTHONDONTWRITEBYTECODE is set (container images
    set it) each compiled the project from source again: 0.6 s a process on a 2-core AMD EPYC. This runs in the
    controller before the workers start, so they and every process they start inherit it; the user's own shell
    keeps its setting."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    if (capability := os.environ.get("ATEN_CPU_CAPABILITY")) and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # a suite run under docs/benchmarks.md's AVX2 emulation: Inductor's cache key leaves the cap out, so the
        # tests that compile in their own process would load the uncapped runs' kernels and crash
        # (gpt2.run.compiled.compile_caches keeps a training's apart the same way)
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default_cache_dir(), f"capped_{capability}")


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected: the shares are of what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each worker's share starts with its slow tests. xdist's worksteal hands each of N workers a contiguous
    1/N of this list and lets an idle worker take the short tests at the end of another's: the slow tests dealt
    in turn, each share filled up with short ones, so no worker is left finishing a 60-second test alone."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    slow = [item for item in items if item.get_closest_marker("slow")]
    short = iter([item for item in items if not item.get_closest_marker("slow")])
    ordered: list[pytest.Item] = []
    for worker in range(workers):
        share = slow[worker::workers]
        size = (worker + 1) * len(items) // workers - worker * len(items) // workers
        ordered += share + [item for _, item in zip(range(size - len(share)), short)]
    items[:] = ordered + list(short)


WORDS = ("the king queen lord thou art my good sweet love night day fair death life heaven "
         "O speak hath doth what why where come go well ill noble friend").split()


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
    return " ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";"])


def document(rng: random.Random, lines: int) -> str:
    """Play-like text with the whitespace shapes that matter to BPE: blank lines, indents, trailing spaces."""
    out = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.1:
            out.append("")
        elif kind < 0.2:
            out.append("  " + sentence(rng) + "  ")
        else:
            out.append(sentence(rng))
    return "\n".join(out) + "\n"


def make_corpus(folder: Path, n_docs: int = 12, lines: int = 40, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(n_docs):
        (folder / f"doc{i:02d}.txt").write_text(document(rng, lines))
    return folder


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return make_corpus(tmp_path / "corpus")


def write_params(path: Path, **sections: dict) -> Path:
    path.write_text(yaml.safe_dump(sections))
    return path


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def make_tokens(folder: Path, n_train: int = 20_000, n_val: int = 4_000, seed: int = 0) -> Path:
    """A token folder in the real format, with a learnable pattern (no tokenizer needed)."""
    import json

    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    splits = {}
    for name, n in (("train", n_train), ("val", n_val)):
        base = rng.integers(0, 500, size=n // 4).repeat(4)  # repeated runs: something to learn
        base[rng.random(len(base)) < 0.01] = 50256
        base[-1] = 50256
        base.astype(np.uint16).tofile(folder / f"{name}.bin")
        splits[name] = {"file": f"{name}.bin", "tokens": len(base), "documents": int((base == 50256).sum()),
                        "bytes": 3 * len(base)}
    meta = {"format": "gpt2-tokens/1", "dtype": "uint16", "vocab_size": 50257, "eot_id": 50256,
            "tokenizer": {"name": "gpt2"}, "manifest_sha256": "test", "split": {"mode": "documents"},
            "splits": splits, "decode": {"on_error": "replace", "replaced_chars": 0}}
    (folder / "meta.json").write_text(json.dumps(meta))
    np.save(folder / "token_bytes.npy", fake_token_bytes())
    return folder


def fake_token_bytes():
    """A stand-in for GPT-2's bytes per id (tokenize writes the real one): 1 to 7 bytes, none for the EOT."""
    import numpy as np

    lengths = (np.arange(50257) % 7 + 1).astype(np.uint16)
    lengths[50256] = 0
    return lengths


MICRO_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}
MICRO_TRAIN = {"micro_batch_size": 4, "block_size": 16, "max_steps": 12, "warmup_steps": 3, "eval_interval": 4,
               "eval_windows": 8, "log_interval": 1, "checkpoint_interval": 100, "mlflow": False,
               "timing_warmup_steps": 1, "lr": 1.0e-2, "min_lr": 2.0e-4}


def micro_params(model: dict | None = None, **train):
    """Params for a model small enough to train a dozen steps in about a second on a CPU."""
    from gpt2.core.config import Params, build

    return build(Params, {"model": {**MICRO_MODEL, **(model or {})}, "train": {**MICRO_TRAIN, **train}}, "")


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    return make_tokens(tmp_path / "tokens")


# --------------------------------------------------------------------------- DVC projects in a temp git repo

ROOT = Path(__file__).resolve().parents[1]
# what a test that forgets its tmp_path leaves in the project
LITTER = ("mlruns", "mlartifacts", "mlflow.db", ".dvc/tmp/gpt2-interrupted")


# The user's MLflow and DVC settings: a test run must neither read nor write them (a team's tracking server,
# a global DVC remote). Tests that need a store set their own; subprocesses inherit this cleaned environment.
USER_SETTINGS = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID",
                 "MLFLOW_RUN_ID", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                 "DVC_ROOT", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV", "DVC_STAGE", "DVC_CONFIG")


@pytest.fixture(autouse=True, scope="session")
def hermetic_environment(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as patch:
        for name in USER_SETTINGS:
            patch.delenv(name, raising=False)
        empty = tmp_path_factory.mktemp("no-user-config")
        patch.setenv("DVC_GLOBAL_CONFIG_DIR", str(empty))
        patch.setenv("DVC_SYSTEM_CONFIG_DIR", str(empty))
        patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        patch.setenv("DVC_NO_ANALYTICS", "1")
        # one math thread per process: the xdist workers and the processes they start already fill the cores, and
        # OpenMP threads that wait for a busy core spin (CPU time that does no work); every process of the suite
        # runs with the same count, so the runs it compares do too
        patch.setenv("OMP_NUM_THREADS", "1")
        # compile in the process itself: Inductor's pool of compile workers costs each compiling process a
        # torch import per worker (4 CPU-s on a 2-core AMD EPYC), more than a micro model's kernels take to build
        patch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        patch.setenv("GPT2_PEAK_CACHE", str(stand_in_peaks(tmp_path_factory.mktemp("peaks"))))
        yield
        torch.set_num_threads(threads)


def stand_in_peaks(folder: Path) -> Path:
    """A CPU peak for every thread count, so that CPU runs do not each spend seconds measuring it and
    nothing is written under the user's home (tests/test_peak.py measures it)."""
    import json

    from gpt2.run.peak import machine_key

    path = folder / "matmul_peaks.json"
    path.write_text(json.dumps({machine_key(n): {"fp32": 2.0e11, "bf16": None, "measured": "tests/conftest.py"}
                                for n in range(1, (os.cpu_count() or 1) + 1)}))
    return path


@pytest.fixture(autouse=True)
def no_tracking_settings_leak_between_tests():
    """MLflow exports what a run sets (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_ID``) into os.environ for its
    child processes: left there, they would send a later test's subprocesses to an earlier test's store."""
    yield
    for name in USER_SETTINGS:
        os.environ.pop(name, None)


@pytest.fixture(autouse=True, scope="session")
def leaves_no_litter_in_the_project(hermetic_environment):
    """The suite writes only under tmp_path: a stray MLflow store in the checkout fails the run."""
    before = {name for name in LITTER if (ROOT / name).exists()}
    yield
    after = {name for name in LITTER if (ROOT / name).exists()}
    assert after <= before, f"the tests left {sorted(after - before)} in {ROOT}"


def environment() -> dict[str, str]:
    return {**os.environ, "DVC_NO_ANALYTICS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"}


def run(cwd: Path, *cmd: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env={**environment(), **(env or {})}, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(f"{cmd} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def set_params(root: Path, **changes: dict) -> None:
    params = yaml.safe_load((root / "params.yaml").read_text())
    for section, values in changes.items():
        params.setdefault(section, {}).update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def new_project(base: Path) -> Path:
    root = base / "project"
    root.mkdir()
    for name in ("dvc.yaml", "params.yaml", "ladder.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(ROOT / name, root / name)
    for name in ("stages", "gpt2"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    run(root, "git", "init", "-q")
    run(root, sys.executable, "-m", "dvc", "init", "-q")
    shutil.copy(ROOT / ".dvc" / "config", root / ".dvc" / "config")  # the project's cache settings (links)
    set_params(root, download={"source": str(make_corpus(base / "corpus", n_docs=10))},
               model=MICRO_MODEL, train={**MICRO_TRAIN, "block_size": 8, "micro_batch_size": 2},
               eval={"mlflow": False, "max_new_tokens": 10, "num_samples": 1})
    return root


def _data_stages(base: Path) -> None:
    root = new_project(base)
    dvc(root, "repro", "stats")
    commit_all(root)


def _whole_pipeline(base: Path) -> None:
    shutil.copytree(built(base.parent, "data-stages", _data_stages), base / "project", symlinks=True,
                    ignore=_dvc_tmp)
    run(base / "project", sys.executable, "-m", "dvc", "repro")


def _dvc_tmp(folder: str, names: list[str]) -> list[str]:
    """DVC's locks and its cache of file hashes (by inode) stay with the project they describe."""
    return ["tmp"] if Path(folder).name == ".dvc" else []


def built(shared: Path, name: str, build) -> Path:
    """A project that ``build`` makes once per session, for every xdist worker (the first to ask builds it)."""
    import fcntl

    folder = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / "built").touch()
    return folder / "project"


def project_copy(tmp_path_factory: pytest.TempPathFactory, base: Path, stages: str = "data") -> Path:
    """A copy of a new project (tiny corpus, micro model) whose data stages (``data``) or whole pipeline
    (``all``, uncommitted past the data stages) already ran: each test gets its own, the stages run once."""
    shared = _shared(tmp_path_factory)
    template = built(shared, "data-stages", _data_stages) if stages == "data" else \
        built(shared, "whole-pipeline", _whole_pipeline)
    root = base / "project"
    shutil.copytree(template, root, symlinks=True, ignore=_dvc_tmp)
    return root


def mlflow_store(tmp_path_factory: pytest.TempPathFactory, folder: Path) -> str:
    """The URI of an MLflow store in ``folder``, its tables already made: a copy of one made once a session.
    Making them runs every MLflow migration (4 s on a 2-core AMD EPYC), which a user's first run pays once; a
    test that logs to MLflow starts where a user's second run does. The tests of a new store make their own."""
    template = built(_shared(tmp_path_factory), "mlflow-store", _empty_store) / "mlflow.db"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(template, folder / "mlflow.db")
    return f"sqlite:///{folder}/mlflow.db"


def _empty_store(base: Path) -> None:
    (base / "project").mkdir()
    run(base, sys.executable, "-c", "import mlflow; mlflow.MlflowClient("
        f"'sqlite:///{base / 'project' / 'mlflow.db'}').search_experiments()")


def _shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's temp folder every xdist worker shares."""
    shared = tmp_path_factory.getbasetemp()
    return shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared


def dvc(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(root, sys.executable, "-m", "dvc", *args, check=check)


def commit_all(root: Path) -> None:
    run(root, "git", "add", "-A")
    run(root, "git", "commit", "-qm", "baseline")


def exp_rows(root: Path) -> list[dict[str, str]]:
    import csv
    import io

    return list(csv.DictReader(io.StringIO(dvc(root, "exp", "show", "--csv").stdout)))
