"""Every documented command runs as written: each ``gpt2 …`` in a shell block of README.md and docs/*.md
uses options the CLI has, and each ``-S key=value`` (of ``dvc exp run`` and ``gpt2 grid``) is a value the
params schema accepts, together with the other settings of its command. A static check: nothing runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
import yaml

from gpt2.cli import main
from gpt2.core.config import Params, ParamError, build

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SEPARATORS = {"&&", "||", ";", "|", ">"}  # a redirect's file is no command


def shell_commands(path: Path) -> list[list[str]]:
    """The commands of the file's shell blocks, as argument lists (continuations joined, comments dropped)."""
    commands = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", path.read_text(), re.S):
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            words, current = shlex.split(line.removeprefix("$ "), comments=True), []
            for word in words + [";"]:
                if word in SEPARATORS:
                    if current:
                        commands.append(current)
                    current = []
                else:
                    current.append(word)
    return commands


def documented(program: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    return [(f"{path.name}: {shlex.join(cmd)}", cmd[len(program):]) for path in DOCS for cmd in shell_commands(path)
            if tuple(cmd[:len(program)]) == program]


def settings(args: list[str], flags: tuple[str, ...]) -> list[str]:
    return [args[i + 1] for i, word in enumerate(args[:-1]) if word in flags] + \
        [word.split("=", 1)[1] for word in args if word.split("=", 1)[0] in flags and "=" in word]


def check_settings(sets: list[str], grid: bool) -> None:
    """Apply the settings to params.yaml and build it; a grid's comma lists are tried value by value."""
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    choices = []
    for setting in sets:
        key, value = setting.split("=", 1)
        section, name = key.split(".", 1)
        assert name in base.get(section, {}), f"-S {key}: no such key in params.yaml"
        values = value.split(",") if grid and not value.startswith("[") else [value]
        choices.append((section, name, [yaml.safe_load(v) for v in values]))
    for index, (_, _, values) in enumerate(choices):
        for value in values:
            data = {section: dict(keys) for section, keys in base.items()}
            for section, name, others in choices:
                data[section][name] = others[0]
            data[choices[index][0]][choices[index][1]] = value
            build(Params, data, "")


def check_cli(args: list[str]) -> None:
    """The subcommand exists, every option is one of its options with a value of its type, and the positional
    arguments fit its arguments."""
    command = main.commands.get(args[0])
    assert command is not None, f"gpt2 has no command {args[0]!r}"
    options = {opt: p for p in command.params if isinstance(p, click.Option) for opt in p.opts + p.secondary_opts}
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    rest, positional = args[1:], 0
    while rest:
        word = rest.pop(0)
        if not word.startswith("-") or word == "-":
            positional += 1
            continue
        name, _, value = word.partition("=")
        assert name in options, f"gpt2 {command.name} has no option {name} (it has {', '.join(sorted(options))})"
        option = options[name]
        if option.is_flag or option.count:
            continue
        value = value or rest.pop(0)
        if isinstance(option.type, (click.types.IntParamType, click.types.FloatParamType, click.Choice)):
            option.type.convert(value, option, None)
    unlimited = any(a.nargs == -1 for a in arguments)
    required = sum(a.required for a in arguments)
    assert required <= positional <= len(arguments) or (unlimited and positional >= len(arguments) - 1), \
        f"gpt2 {command.name} takes {required} to {len(arguments)} argument(s), the docs give {positional}"


@pytest.mark.parametrize("where, args", documented(("gpt2",)), ids=lambda v: v if isinstance(v, str) else "")
def test_each_documented_gpt2_command_is_one_the_cli_takes(where, args):
    check_cli(args)
    if args[0] == "grid":
        check_settings(settings(args, ("-S", "--set")), grid=True)


@pytest.mark.parametrize("where, args", documented(("dvc", "exp", "run")),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_each_documented_experiment_sets_values_the_params_schema_accepts(where, args):
    check_settings(settings(args, ("-S", "--set-param")), grid="--queue" in args)


def test_the_checks_catch_what_they_are_for():
    with pytest.raises(ParamError, match="min_lr"):
        check_settings(["train.lr=3.0e-5"], grid=False)
    with pytest.raises(AssertionError, match="no option --fast"):
        check_cli(["train", "--fast"])
    check_cli(["sample", "ROMEO:"])  # an optional argument given, or not
    check_cli(["sample", "--prompt", "ROMEO:"])
    with pytest.raises(AssertionError, match=r"gpt2 sample takes 0 to 1 argument\(s\), the docs give 2"):
        check_cli(["sample", "ROMEO:", "JULIET:"])
    with pytest.raises(AssertionError, match="no such key"):
        check_settings(["train.eval_iters=10"], grid=False)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for path in [*DOCS, ROOT / "CHANGELOG.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"\w+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
                broken.append(f"{path.name}: {target}")
    assert not broken, broken


def test_the_readme_sections_the_code_cites_exist():
    cited = {name for source in (ROOT / "gpt2").rglob("*.py")
             for name in re.findall(r'README, \\?"([^"\\]+)\\?"', source.read_text())}
    headings = set(re.findall(r"^#+ (.+)$", (ROOT / "README.md").read_text(), re.M))
    assert cited and cited <= headings, sorted(cited - headings)


def test_docs_plan_lists_every_device_gpt2_plan_takes():
    devices = next(p for p in main.commands["plan"].params if p.name == "device").type.choices
    text = " ".join((ROOT / "docs/plan.md").read_text().split())
    assert f"device ({', '.join(devices)})" in text
