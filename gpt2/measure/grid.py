"""`gpt2 grid`: every combination of a few settings as DVC experiments (code revisions, ``--rev``, each in a
checkout of its own: revisions.py), judged against the first with its noise.

``-S key=a,b`` gives one setting per combination of the values, in the order DVC would expand
them; the first combination is the baseline every other is compared with. Each setting runs
``repeats`` times, one experiment at a time (``dvc exp run --temp``), in alternating order (all
settings forward, then backward), so each run has a neighbour in time of the baseline to be
paired with and drift of the machine cancels; repeat r trains the same seed for every setting.
gpt2/measure/compare.py judges it as it judges the ladder's rungs, and gpt2/measure/report.py
writes it: per setting, its tokens/s ratio to the baseline and its val loss difference over the
seeds with its p-value, each marked when inside noise, under a verdict on the noise itself. The
experiments stay ordinary DVC experiments (``dvc exp show``, ``dvc exp apply``); in MLflow the
grid is a parent run holding the comparison, each experiment's run a child carrying its verdict.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from pathlib import Path
from typing import Any

from gpt2.core import log, paths
from gpt2.core.atomic import write_files
from gpt2.core.config import load_params, read_yaml
from gpt2.core.errors import UserError
from gpt2.measure import experiments, procedure, revisions
from gpt2.measure.apply import Change, value_of, runs_the_same
from gpt2.measure.compare import ALPHA, Arm, Judged, judge
from gpt2.measure.parent_run import log_parent
from gpt2.measure.planned import Planned, train_with
from gpt2.measure.report import (METHOD, SEEDS_FOR_A_VERDICT, Column, Words, as_data, columns, decide_best,
                                 render_png, table, verdict)
from gpt2.run.names import json_value

logger = log.get("grid")


def _with_section(key: str, values: str) -> str:
    """``-S train.lr=VALUES`` for a bare ``lr`` that one params section has; '' otherwise."""
    from gpt2.core.config import sections_with

    sections = sections_with(key)
    return f"-S {sections[0]}.{key}={values or '...'}" if len(sections) == 1 else ""


def parse_sets(sets: tuple[str, ...]) -> dict[str, list[Any]]:
    """``-S train.lr=1.0e-3,2.0e-3`` → ``{"train.lr": [0.001, 0.002]}``, checked as DVC would expand them. A comma
    inside brackets or quotes is the value's own: ``-S 'train.betas=[0.9,0.95],[0.9,0.99]'`` is two lists."""
    grid: dict[str, list[Any]] = {}
    for item in sets:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or "." not in key or not values:
            meant = _with_section(key, values.strip())
            raise UserError(f"-S {item!r}: write section.key=value[,value...], "
                            + (f"did you mean {meant}?" if meant else "e.g. -S train.lr=1.0e-3,2.0e-3"))
        if key in grid:
            raise UserError(f"-S {key} is given twice; give all its values in one -S: "
                            f"-S {key}={','.join(map(str, grid[key]))},...")
        texts = split_values(item, values)
        if "" in (text.strip() for text in texts):
            raise UserError(f"-S {item!r}: value {[t.strip() for t in texts].index('') + 1} of {len(texts)} is empty; "
                            "remove the extra comma")
        grid[key] = [dvc_value(item, text) for text in texts]
        for value in grid[key]:
            if any("\\" in text or "${" in text for text in _texts(value)):
                raise UserError(f"-S {item!r}: DVC's -S would not pass a backslash or ${{...}} on as written (it "
                                "doubles the one and reads the other as a reference); set such a value in "
                                "params.yaml instead")
    return grid


def _texts(value: Any) -> list[str]:
    """The strings in a setting's value, a list's included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return [text for item in value for text in _texts(item)]
    if isinstance(value, dict):
        return [text for item in value.values() for text in _texts(item)]
    return []


def split_values(item: str, values: str) -> list[str]:
    """``values`` cut at its commas outside brackets, braces and quotes. As in YAML, a quote opens a quoted
    text only where a value starts (``'a,b'``, ``['x', 'y']``, ``!!str 'a,b'``); inside a word (``[it's]``) it
    is a letter, and in a single-quoted text ``''`` is one quote."""
    texts, depth, quote, start, value_at, escaped = [], 0, "", 0, 0, False
    for i, char in enumerate(values):
        if escaped:
            escaped = False
        elif quote:
            escaped = char == quote == "'" and values[i + 1:i + 2] == "'"
            quote = quote if escaped or char != quote else ""
        elif char in "'\"" and VALUE_START.fullmatch(values[value_at:i]):
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            texts.append(values[start:i])
            start = i + 1
        if not quote and char in ",[{:":
            value_at = i + 1
    if depth or quote:
        raise UserError(f"-S {item!r}: a bracket or a quote is not closed; quote the whole -S in the shell, e.g. "
                        "-S 'train.betas=[0.9,0.95],[0.9,0.99]'")
    return texts + [values[start:]]


VALUE_START = re.compile(r"\s*(?:[!&]\S*\s+)*")  # what may come before a value's opening quote: YAML's tag, anchor


def dvc_value(item: str, text: str) -> Any:
    """A ``-S`` value as DVC reads it (YAML 1.2): only true and false are booleans, so ``train.fp8=off`` stays
    the word it is in params.yaml's docs, in the grid's labels and in the experiment's params."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or exc.__class__.__name__
        raise UserError(f"-S {item!r}: {text.strip()!r} is not a value YAML can read ({problem}); write it as "
                        "params.yaml would, e.g. 1.0e-3, true, flash or [0.9,0.95]") from None
    if isinstance(value, bool) and text.strip().lower() not in ("true", "false"):
        return text.strip()
    return value


def settings(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination, the last key varying fastest (DVC's order); the first is the baseline."""
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


MAX_NAME = 100  # a grid's name, in bytes: its report files and experiment names add a suffix to it


def run_grid(sets: tuple[str, ...], name: str | None = None, target: str = "train",
             out: str | Path = paths.GRID_REPORTS,
             mlflow: bool | None = None, params_path: str | Path = paths.PARAMS, repeats: int = 1,
             time_budget_s: float | None = None, apply: bool = False, as_json: bool = False,
             alpha: float = ALPHA, revs: str | None = None) -> dict[str, Any]:
    """Run every setting ``repeats`` times as DVC experiments, write ``<out>/<name>.md``, ``.json`` and ``.png``,
    and group the experiments under one MLflow run that holds the comparison. ``time_budget_s``: every run
    trains for that long (train.time_budget_s), so the settings compare at equal time. ``apply``: write the
    winner into params.yaml. ``alpha``: the level of the quality tests. ``revs``: git revisions (``main,mine``),
    each run in its own checkout (revisions.py), the first the baseline. Returns the comparison as the report's
    JSON holds it; prints the report's markdown on stdout, or with ``as_json`` the JSON (also when a run failed,
    before the error)."""
    root, started = paths.root(), time.time()
    grid, fixed, held = _settings(sets, name, revs, time_budget_s, repeats)
    procedure.check_before("grid", root, params_path, apply, None if revs else target)
    if not revs:  # each revision checks its own params.yaml; here a setting that can only fail stops the grid now
        _every_setting_loads(params_path, grid, fixed)
    raw = read_yaml(params_path, "params", "--params") or {}
    if apply:  # text no verdict reads, where a quality win must hold before it is written
        fixed["train.holdout_windows"] = procedure.holdout_size([train_with(raw.get("train") or {}, {**combo, **fixed})
                                                                 for combo in settings(grid)])
    seeds = [None] * repeats if "train.seed" in grid else procedure.repeat_seeds(raw, repeats)
    out = Path(out)
    collected: dict[str, Any] = {}
    with revisions.checked_out(root, revs) as checkouts:
        if checkouts:
            grid = {"revision": list(checkouts), **grid}
        combos = settings(grid)
        order = procedure.alternating(len(combos), repeats)
        run_sets = {(i, r): {**{k: v for k, v in combos[i].items() if k != "revision"}, **fixed,
                             **({"train.seed": seeds[r]} if seeds[r] is not None else {})} for i, r in order}
        # revisions run in checkouts that end with the grid: a stopped one leaves nothing to go on from
        plan, stopped = procedure.stopped_plan(root, "grid", params_path, target, [
            {"name": name}, *(run_sets[run] for run in order)]) if not checkouts else (None, None)
        name = stopped["name"] if stopped else name or "grid " + time.strftime("%m-%d %H:%M:%S")
        slug = _slug(name) or "grid"
        dvc_log = out / f"{slug}.dvc.log"
        names, done = procedure.run_names(root, stopped, lambda taken: [
            [_free(f"{slug}-{i + 1}-{r + 1}", taken) for r in range(repeats)] for i in range(len(combos))], _free)
        started = (stopped or {}).get("started", started)  # a stopped grid's MLflow run spans the runs it keeps
        logger.info(f"grid {name!r}: {len(combos)} settings × {repeats} run(s) ({', '.join(grid)}"
                    + (f"; every run with {describe(held)}" if held else "") + "), one at a time; "
                    f"the first, {describe(combos[0])}, is the baseline"
                    + (f"; repeat r trains train.seed {', '.join(map(str, seeds))}" if seeds[0] is not None else ""))
        edited = _said_before(root, grid, checkouts, raw, repeats, target, None if stopped else out / f"{slug}.md",
                              name)
        planned = []
        for i, r in order:
            checkout = checkouts.get(combos[i].get("revision"))
            planned.append(Planned(
                names[i][r], run_sets[i, r], f"{describe(combos[i])}, run {r + 1}",
                f"{describe(combos[i])}" + (f" · run {r + 1}" if repeats > 1 else "") + f" · {name}", checkout,
                revisions.params_for(checkout, raw, run_sets[i, r]) if checkout else None))
        procedure.run_in_turn(root, planned, target, dvc_log, "grid", collected=collected,
                              plan={**plan, "name": name, "names": names, "started": started} if plan else None,
                              done=done)
    runs = procedure.read_back(root, "grid", names, seeds, collected if checkouts else None)
    arms = [Arm(describe(combo), group, reference=None if i == 0 else 0, setting=combo)
            for i, (combo, group) in enumerate(zip(combos, runs))]
    judged = judge(arms, alpha)
    words = Words("setting", "the baseline", time_budget_s, dvc_log.name)
    changes, note = decide(judged, words, out / f"{slug}.md", apply)
    if changes and (unheld := {k: v for k, v in held.items() if not runs_the_same(k, value_of(raw, k), v)}):
        note = (f"{note} The winner was measured with {describe(unheld)} on every run, which {params_path} does "
                "not hold and `--apply` does not write: set it too to train as it was measured.").strip()
    text, data = write_report(out, slug, name, grid, judged, repeats, target, words, changes, note,
                              {label: c.commit for label, c in checkouts.items()}, held, edited)
    if (raw.get("train") or {}).get("mlflow", True) if mlflow is None else mlflow:
        log_parent("grid", name, judged, [out / f"{slug}{s}" for s in (".md", ".json", ".png")], text,
                   (raw.get("train") or {}).get("experiment", "gpt2"), started,
                   {f"grid.{k}": ",".join(map(str, v)) for k, v in grid.items()} | {"grid.repeats": repeats}
                   | {f"grid.{k}": str(v) for k, v in held.items()},
                   {"grid.baseline": describe(combos[0])},
                   {run.name: {"grid.setting": arm.label, "grid.run": str(run.repeat + 1)}
                    for arm in arms for run in arm.runs}, "grid.setting",
                   {p.name: p.run_name for p in planned}, changes)
    procedure.conclude("grid", out / f"{slug}.md", text, data, changes, params_path, apply, as_json, dvc_log)
    return data


def _said_before(root: Path, grid: dict[str, list[Any]], checkouts: dict[str, Any], raw: dict[str, Any],
                 repeats: int, target: str, report: Path | None, name: str) -> list[str]:
    """What a grid says before its first run, where it would only show in the report after an hour of runs (a
    revision without the target stage stops it); an earlier report of its name is set aside, and said. Returns
    the uncommitted code every run of a grid of params trains, which the report names. ``report``: this grid's
    report file, None where it goes on from its own."""
    if repeats < SEEDS_FOR_A_VERDICT and "train.seed" not in grid:  # seeds as settings: --repeats 1 by force
        logger.warning(f"grid: {repeats} run(s) per setting (--repeats {repeats}): the report will give figures "
                       + ("and no verdict" if repeats == 1 else "and a quality verdict only for a large difference "
                          "(two seeds leave its test 1 degree of freedom)")
                       + f"; --repeats {SEEDS_FOR_A_VERDICT} or more for one")
    if report is not None and report.is_file():
        earlier, kept = _earlier_name(report, name), _set_aside(report)
        logger.warning(f"grid: {report} held an earlier grid named {earlier!r}: kept as {kept} (its .json, .png and "
                       ".dvc.log beside it); this one writes its own report there")
    for checkout in checkouts.values():  # each revision runs its own dvc.yaml's stage
        try:
            experiments.check_target(checkout.path, target)
        except UserError as exc:
            raise UserError(f"revision {checkout.label}: {exc}") from None
    for warning in revisions.same_code(root, list(checkouts.values())) if checkouts else []:
        logger.warning(f"grid: {warning}")
    for key, values in grid.items():
        if twice := [json_value(v) for i, v in enumerate(values) if v in values[:i]]:
            logger.warning(f"grid: -S {key} gives {', '.join(twice)} more than once: those settings train alike "
                           "(an A/A comparison, this machine's noise)")
    if edited := [] if checkouts else experiments.uncommitted_code(root):
        logger.warning(f"grid: every run trains the workspace's code with its uncommitted changes to "
                       f"{experiments.named(edited)} (alike in every setting; the runs' git_commit names the "
                       "commit without them, the report and its JSON name them)")
    for checkout in checkouts.values():
        if left := revisions.unknown_keys(checkout, raw):
            logger.warning(f"grid: revision {checkout.label} has no {', '.join(left)} in its params.yaml: its "
                           "runs train without them")
    return edited


def _slug(name: str) -> str:
    """The grid's name as its files are named: each run of other characters than letters, digits, ``.``, ``_`` and
    ``-`` written as one ``-`` ("" where nothing is left)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")


def _set_aside(report: Path) -> Path:
    """An earlier grid's report files (``lr.md``, ``.json``, ``.png``, ``.dvc.log``) renamed after their time
    (``lr.before-20261202-171900.md``), so that a grid run again under its name loses nothing of the last one;
    returns the markdown's new path."""
    t = time.localtime(report.stat().st_mtime)
    stamp = f"{t.tm_year:04d}{t.tm_mon:02d}{t.tm_mday:02d}-{t.tm_hour:02d}{t.tm_min:02d}{t.tm_sec:02d}"
    stem = report.name.removesuffix(".md")
    for suffix in (".md", ".json", ".png", ".dvc.log"):
        if (old := report.with_name(stem + suffix)).is_file():
            old.replace(report.with_name(f"{stem}.before-{stamp}{suffix}"))
    return report.with_name(f"{stem}.before-{stamp}.md")


def _earlier_name(report: Path, name: str) -> str:
    """The name an earlier grid's report records: "lr a" and "lr-a" share one file name."""
    try:
        return json.loads(report.with_name(report.name.removesuffix(".md") + ".json").read_text())["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return name


def _settings(sets: tuple[str, ...], name: str | None, revs: str | None, time_budget_s: float | None,
              repeats: int) -> tuple[dict[str, list[Any]], dict[str, Any], dict[str, Any]]:
    """The grid's compared settings, what every run sets alike (``fixed``, the single values ``held`` among them),
    checked before an hour of runs rather than at the report after them."""
    if name is not None and not _slug(name):
        raise UserError(f"gpt2 grid --name {name!r} has no letter or digit to name the report's files after: give one "
                        "(--name lr-sweep), or leave --name out for the default (grid MM-DD HH:MM:SS)")
    if name is not None and len(name.encode()) > MAX_NAME:
        raise UserError(f"gpt2 grid --name is {len(name.encode())} bytes long; the report's files and the experiments "
                        f"are named after it, and a file name holds at most 255: give one of at most {MAX_NAME}")
    grid = parse_sets(sets)
    if not grid and not revs:
        raise UserError("gpt2 grid needs at least one -S section.key=value[,value...] or --rev A,B")
    if "revision" in grid:
        raise UserError("-S revision=...: revisions are given with --rev A,B")
    fixed = ({"train.time_budget_s": time_budget_s, "train.max_steps": None, "train.max_tokens": None}
             if time_budget_s else {})
    if clash := [k for k in grid if k in fixed]:
        raise UserError(f"-S {clash[0]} and --time-budget both set the run's length; give one")
    if "train.seed" in grid and repeats > 1:
        raise UserError("-S train.seed makes the seeds the settings: with --repeats above 1 a repeat would train a "
                        "seed again and pass for another; give --repeats 1 (or leave the seed to the repeats)")
    if not revs and len(settings(grid)) < 2:
        raise UserError(f"gpt2 grid {' '.join('-S ' + item for item in sets)}: every -S gives one value, so the grid "
                        "is one setting with nothing to compare it with; give the key you compare two values or more, "
                        "the first the baseline (-S train.lr=1.0e-3,2.0e-3), or train one setting with dvc exp run")
    grid, held = swept(grid)
    return grid, {**fixed, **held}, held


def _every_setting_loads(params_path: str | Path, grid: dict[str, list[Any]], fixed: dict[str, Any]) -> None:
    """params.yaml, then each setting on it, as a run would load them: a setting that can only fail stops the
    grid before its first run."""
    load_params(params_path)  # the file itself first: its own error is not a setting's
    for combo in settings(grid):
        try:
            load_params(params_path, tuple(f"{k}={json.dumps(v)}" for k, v in {**combo, **fixed}.items()))
        except UserError as exc:
            raise UserError(f"grid: the setting {describe(combo)} cannot run: {exc}") from None


def decide(judged: Judged, words: Words, report: Path | str, held_out: bool) -> tuple[list[Change], str]:
    """The settings to apply: those of the setting that wins against the baseline by the most, outside noise,
    losing nowhere outside it (``compare.win``) and, ``held_out``, holding on the held-out windows; and what to
    say of it. ``--apply`` writes params, never code: where another revision wins, it is named, and the best
    winner of the baseline's revision, if any, is what ``--apply`` writes."""
    base = judged.arms[0].setting.get("revision")
    best, said = decide_best(judged, words, held_out)
    if best is None:
        return [], said
    if best[0].setting.get("revision") != base:
        said = (f"The winner is {best[0].label} ({best[1]}): `--apply` writes params.yaml, never code; merge that "
                f"revision to keep it. {said}").strip()
        best, _ = decide_best(judged, words, held_out, lambda a: a.setting.get("revision") == base)
        if best is None:
            return [], said
    arm, why = best
    when = f" (runs of {words.at_equal_time_s:g} s)" if words.at_equal_time_s else ""
    return [Change(key, value, f"{why}{when} ({report})") for key, value in arm.setting.items()
            if key != "revision"], said


def write_report(out: Path, slug: str, name: str, grid: dict[str, list[Any]], judged: Judged, repeats: int,
                 target: str, words: Words, changes: list[Change], note: str = "",
                 commits: dict[str, str] | None = None, held: dict[str, Any] | None = None,
                 edited: list[str] | None = None) -> tuple[str, dict[str, Any]]:
    """``<slug>.md`` (verdict and table), ``<slug>.json`` and ``<slug>.png``, written as one; returns the markdown
    and the JSON's content (what ``--json`` prints). ``held``: the settings every run has alike; ``edited``: the
    files of uncommitted code every run trained."""
    said = verdict(judged, words, repeats, changes, lambda a: a.label, note)
    rest = dict(held or {})  # what every run had, less the run's length, which its own sentence says
    budget = words.at_equal_time_s or rest.pop("train.time_budget_s", None)
    given = {k: rest.pop(k) for k in ("train.max_steps", "train.max_tokens") if k in rest}
    if budget:
        length = (f"each run trains for {budget:g} s of training steps (train.time_budget_s), so val losses "
                  "compare at equal time")
    else:
        length = f"each run trains {describe(given)}" if given else "each run trains the steps params.yaml sets"
    keys = [Column(k, lambda i, a, k=k: json_value(a.setting[k])) for k in grid]
    ran = [Column("run names" if commits else "experiments", lambda i, a: ", ".join(r.name for r in a.runs))]
    each = (f"the `{target}` stage of its revision in a checkout of its own (not a DVC experiment: the JSON's "
            "revisions name each commit)" if commits else f"the `{target}` stage as a DVC experiment"
            + (f" on the workspace's code with its uncommitted changes to {experiments.named(edited)}" if edited
               else ""))
    text = (f"# {name}\n\n{said}\n\n"
            f"{len(judged.arms)} settings × {repeats} run(s), one at a time, in alternating order, each {each}; "
            f"{length}" + (f"; every run with {describe(rest)}" if rest else "")
            + f"; the first setting is the baseline. {METHOD}\n\n"
            + table(judged, keys, columns(judged, words), ran))
    data = {"name": name, "report": str(out / f"{slug}.md"), "grid": grid, "held": held or {}, "repeats": repeats,
            "target": target, "time_budget_s": words.at_equal_time_s, "revisions": commits or {},
            "uncommitted_code": edited or [], "log": str(out / words.log),
            **as_data(judged, said, changes)}
    write_files(out, {f"{slug}.md": text, f"{slug}.json": json.dumps(data, indent=2) + "\n",
                      f"{slug}.png": render_png(judged, name, words, lambda a: a.label)})
    return text, data


def swept(grid: dict[str, list[Any]]) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """The keys a grid compares (two values or more), and those given one value, which every run has alike and
    no label repeats (``-S train.max_steps=100 -S model.attention=flash,manual``). A single seed stays a setting,
    as the repeats would otherwise set their own."""
    many = {k: v for k, v in grid.items() if len(v) > 1 or k == "train.seed"}
    return many, {k: v[0] for k, v in grid.items() if k not in many}


def describe(setting: dict[str, Any]) -> str:
    """``train.lr=0.002 · model.attention=manual``: a setting as people read it."""
    return " · ".join(f"{key}={json_value(value)}" for key, value in setting.items())


def _free(name: str, taken: set[str]) -> str:
    """``name``, or ``name-2``, ``name-3`` … where an earlier grid of the same name took it."""
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{name}-{n}"
    taken.add(candidate)
    return candidate


