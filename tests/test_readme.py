"""The README and docs say what the code does: CI's test command, the layout of modules, params.md, the memory
table, the quoted default run, the pins."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- test-command -->\s*```bash\n(.+?)\n\s*```", text)
    assert match, "README lost its <!-- test-command --> block"
    return match.group(1).strip()


def test_ci_runs_the_readme_test_command_exactly():
    lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert readme_test_command() in lines


def test_every_dvc_stage_has_its_thin_entry_point():
    import yaml

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        assert stage["cmd"] == f"python -m stages.{name}"
        assert (ROOT / "stages" / f"{name}.py").is_file()


def test_the_readme_layout_lists_every_module_of_the_library():
    """The map a newcomer reads first holds every module, and no module that is gone."""
    block = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```", 2)[1]
    listed, folders = set(), []
    for line in block.splitlines():
        entry = re.match(r"^( *)(\S.*?)(?:\s{2,}|$)", line)
        if not entry or len(entry.group(1)) >= 20:  # a description's second line
            continue
        folders = folders[:len(entry.group(1)) // 2]
        listed |= {"/".join([*folders, name.strip().rstrip("/")]) for name in entry.group(2).split(", ")}
        if entry.group(2).endswith("/"):
            folders.append(entry.group(2).rstrip("/"))
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "gpt2").rglob("*.py") if p.name != "__init__.py"}
    assert sorted(modules - listed) == [], "modules missing from the README's layout"
    assert sorted(p for p in listed if p.startswith("gpt2/") and p.endswith(".py") and p not in modules) == []


def test_docs_params_md_is_generated_from_the_config():
    """Each key is documented once, in its dataclass; docs/params.md is that documentation, rendered."""
    from gpt2.core.config import params_markdown

    assert (ROOT / "docs/params.md").read_text() == params_markdown(), \
        "docs/params.md is stale: run python -m gpt2.core.config > docs/params.md"


def test_params_yaml_says_of_each_key_what_its_dataclass_says():
    from gpt2.core.config import yaml_comments

    section, said = None, {}
    for line in (ROOT / "params.yaml").read_text().splitlines():
        if re.match(r"^\w+:\s*$", line):
            section = line.rstrip(":")
        elif match := re.match(r"^  (\w+):.*?  # (.*)$", line):
            said[(section, match.group(1))] = match.group(2)
    assert said == yaml_comments()


def test_the_readme_table_of_what_fits_is_the_memory_model_s():
    from gpt2.measure.plan import fits_table

    text = (ROOT / "README.md").read_text()
    assert fits_table() in text.split("<!-- fits-table: python -m gpt2.measure.plan -->", 1)[1], \
        "README's table of what fits is stale: paste the output of python -m gpt2.measure.plan"


def committed(path: str) -> str:
    """A file as the last commit holds it: the README's set-up command 1 (`dvc repro`) rewrites the workspace's
    reports with this machine's figures, and command 2 (the tests) must still pass after it."""
    import subprocess

    shown = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else (ROOT / path).read_text()  # not a git checkout


def test_the_readme_quotes_the_committed_default_run():
    """The figures of the README's default run are those of the reports dvc.lock records."""
    import json

    train = json.loads(committed("reports/train/summary.json"))
    evaluation = json.loads(committed("reports/eval/metrics.json"))["eval"]
    val = [line.split("\t") for line in committed("reports/train/plots/val.tsv").splitlines()[1:]]
    perf, (minutes, seconds) = train["perf"], divmod(round(train["wall_s"]), 60)
    text = " ".join((ROOT / "README.md").read_text().split())
    for quote in (f"median {perf['step_ms']:.0f} ms/step ({perf['tokens_per_s'] / 1000:.1f} K tokens/s; "
                  f"{perf['tokens_per_s_wall'] / 1000:.1f} K tokens/s over the whole run's wall clock), training "
                  f"{minutes} min {seconds} s",
                  f"± {float(val[-1][2]):.2f} standard error",
                  "| val loss | ≈10.8 (ln 50257) | " + " | ".join(f"{float(row[1]):.2f}" for row in val) + " |",
                  f"loss {evaluation['val_loss']:.2f} ± {evaluation['val_loss_se']:.2f} (perplexity "
                  f"{evaluation['val_ppl']:.0f}; {evaluation['val_bpb']:.2f} bits per byte of text)"):
        assert quote in text, f"README.md should say: {quote}"


def test_every_dependency_and_extra_is_pinned_in_constraints():
    """An unpinned package resolves to whatever the index has that day: the install would not repeat."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    pinned = {re.split(r"==", line)[0].strip().lower().replace("_", "-")
              for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line}
    names = {re.split(r"[<>=!~\[ ]", d)[0].lower().replace("_", "-") for d in wanted}
    assert names <= pinned, f"not pinned in constraints.txt: {sorted(names - pinned)}"
