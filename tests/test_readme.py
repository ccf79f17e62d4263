from __future__ import annotations

import re
from pathlib import Path

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


def test_every_param_key_is_documented_in_the_readme():
    import dataclasses
    import typing

    from gpt2.core.config import Params

    text = (ROOT / "README.md").read_text()
    for section, cls in typing.get_type_hints(Params).items():
        for field in dataclasses.fields(cls):
            assert f"`{field.name}`" in text or f"`{section}.{field.name}`" in text, (section, field.name)
