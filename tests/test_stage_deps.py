"""dvc.yaml's code deps cover every module of the package a stage runs, and nothing it does not.

A stage whose deps miss a module it imports is reported up to date after that module changes,
with stale results. The import graph is read statically from the source: ``import`` and
``from ... import`` anywhere in a module (function-level, lazy imports included, since they run
when the command does), plus string constants naming a module of the package (what a stage
re-launches under torchrun, ``-m gpt2.train.cli``). Importing ``a.b.c`` also runs ``a`` and
``a.b`` (their ``__init__``), so those count too.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "gpt2"


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package: dotted name → file, relative to ``root``."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = rel
    return modules


def with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def imported_names(path: Path, module: str, is_package: bool) -> set[str]:
    """Dotted names this file imports or names as a string; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(f"{PACKAGE}."):
            names.add(node.value)
    return names


def reached_modules(entry: Path, root: Path = ROOT) -> dict[str, Path]:
    """The package's modules that running ``entry`` imports, directly or through each other."""
    modules = package_modules(root)
    reached: dict[str, Path] = {}
    todo = [(entry, "__main__", False)]
    while todo:
        path, module, is_package = todo.pop()
        for name in imported_names(root / path, module, is_package):
            for candidate in with_parents(name):
                if candidate in modules and candidate not in reached:
                    reached[candidate] = modules[candidate]
                    todo.append((modules[candidate], candidate, modules[candidate].name == "__init__.py"))
    return reached


def covered(path: Path, deps: list[str]) -> bool:
    return any(path == Path(dep) or Path(dep) in path.parents for dep in deps)


def code_deps(stage: dict) -> list[str]:
    return [dep for dep in stage.get("deps", []) if dep.split("/")[0] in (PACKAGE, "stages")]


def uncovered(dvc_yaml: Path, root: Path = ROOT) -> dict[str, list[str]]:
    """For each stage, the modules it reaches that its deps miss (stage file included)."""
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    missing = {}
    for name, stage in stages.items():
        entry = Path("stages") / f"{name}.py"
        deps = code_deps(stage)
        gaps = [f"{module} ({path})" for module, path in sorted(reached_modules(entry, root).items())
                if not covered(path, deps)]
        if not covered(entry, deps):
            gaps.insert(0, f"the stage's own entry point ({entry})")
        if gaps:
            missing[name] = gaps
    return missing


STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


@functools.cache
def project_gaps() -> dict[str, list[str]]:
    """The project's own :func:`uncovered`, walked once for all its stages' tests."""
    return uncovered(ROOT / "dvc.yaml")


@pytest.mark.parametrize("name", sorted(STAGES))
def test_stage_deps_cover_every_module_it_runs(name):
    gaps = project_gaps().get(name, [])
    assert not gaps, (f"stage `{name}` runs these modules but dvc.yaml's deps for `{name}` do not cover them "
                      f"(add their folder): {', '.join(gaps)}")


@pytest.mark.parametrize("name", sorted(STAGES))
def test_stage_deps_name_only_code_it_runs(name):
    """A folder a stage never imports from would re-run it for nothing (a new download, a retrain)."""
    reached = [path for path in reached_modules(Path("stages") / f"{name}.py").values()]
    for dep in code_deps(STAGES[name]):
        assert (ROOT / dep).exists(), f"stage `{name}`: dep {dep} does not exist"
        if dep.startswith("stages/"):
            continue
        assert any(covered(path, [dep]) for path in reached), f"stage `{name}` depends on {dep} but runs none of it"


def test_a_gap_is_named(tmp_path):
    """The check itself: a dvc.yaml that forgets a folder is caught, naming the stage and the module."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    train = stages["stages"]["train"]
    dropped = next(dep for dep in code_deps(train) if dep.startswith(f"{PACKAGE}/") and (ROOT / dep).is_dir())
    train["deps"].remove(dropped)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(stages))
    gaps = uncovered(tmp_path / "dvc.yaml")
    assert list(gaps) == ["train"]
    assert all(dropped in gap for gap in gaps["train"])


def test_lazy_and_relative_imports_are_followed(tmp_path):
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (tmp_path / "stages").mkdir()
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("def f():\n    from . import b\n")
    (package / "sub" / "b.py").write_text("from ..c import x\n")
    (package / "c.py").write_text("x = 1\nLAUNCH = ['-m', 'gpt2.d']\n")
    (package / "d.py").write_text("")
    (package / "unused.py").write_text("")
    (tmp_path / "stages" / "s.py").write_text("from gpt2.sub.a import f\n")
    reached = reached_modules(Path("stages/s.py"), tmp_path)
    assert sorted(reached) == ["gpt2", "gpt2.c", "gpt2.d", "gpt2.sub", "gpt2.sub.a", "gpt2.sub.b"]


def test_the_stages_write_where_the_commands_read_by_default():
    """dvc.yaml's outputs and gpt2/core/paths.py (the commands' defaults) name the same places: a stage's output
    moved in one and not the other would leave `gpt2 evaluate` reading a checkpoint no stage writes."""
    import yaml

    from gpt2.core import paths

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]

    def written(stage: str) -> set[str]:
        entries = stages[stage].get("outs", []) + stages[stage].get("metrics", [])
        return {next(iter(e)) if isinstance(e, dict) else e for e in entries}

    assert paths.VALID_MARK in written("validate") and paths.RAW in written("download")
    assert paths.TOKENS in written("tokenize") and all(p.startswith(paths.STATS + "/") for p in written("stats"))
    checkpoints = paths.CHECKPOINT.rsplit("/", 1)[0]
    assert checkpoints in written("train")
    assert all(p.startswith(paths.TRAIN_REPORTS + "/") for p in written("train") - {checkpoints})
    assert all(p.startswith(paths.EVAL_REPORTS + "/") for p in written("evaluate"))
    assert {paths.TRAIN_METRICS, paths.TRAIN_SUMMARY} <= written("train") and paths.EVAL_METRICS in written("evaluate")
    assert paths.VAL_CURVE.rsplit("/", 1)[0] in written("train")  # the plots folder the grid reads val.tsv from


def test_a_checkpoint_records_the_digest_of_the_code_the_train_stage_depends_on():
    """A finished checkpoint is reused only by the code that trained it (gpt2/core/provenance.py): that code is
    what DVC reruns the train stage for, no more and no less."""
    from gpt2.core.provenance import TRAINING_CODE

    assert sorted(f"{PACKAGE}/{part}" for part in TRAINING_CODE) == sorted(
        dep for dep in code_deps(STAGES["train"]) if dep.startswith(f"{PACKAGE}/"))
