"""From YAML to typed, checked dataclasses: the engine behind ``gpt2/core/config.py``.

A config field is declared once, with ``param``: its default, one line of documentation and its
allowed range. From that declaration come the type check, the range check, the ``error:`` line
that names the key and what it allows, and the tables of docs/params.md. Loading is strict on
purpose: a typo such as ``tokenize.val_fracton`` must stop the stage before it writes anything,
not silently fall back to a default and cost a user an afternoon.

Why not pydantic: the lent GPU machines and bare GPU boxes have torch, numpy, click and pyyaml but
not pydantic, and the library must run there without an install.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

from gpt2.core.errors import UserError


class ParamError(UserError):
    """A value in params.yaml is unknown, of the wrong type or out of range."""


def param(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
          lt: float | None = None, note: str = "") -> Any:
    """A config field: its default, what it means (one line, shown in docs/params.md) and its range.

    ``note`` explains a special value in errors and docs (``0 = off``)."""
    bounds = {"ge": ge, "gt": gt, "le": le, "lt": lt}
    return dataclasses.field(default=default, metadata={"doc": doc, "note": note,
                                                        **{k: v for k, v in bounds.items() if v is not None}})


def bare_off(value: Any) -> Any:
    """The choice a value means where ``off`` is one: YAML 1.1 (and so `dvc exp run -S`) reads a bare off as false."""
    return "off" if value is False else value


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Raise a :class:`ParamError` naming ``key`` unless ``ok``."""
    if not ok:
        raise ParamError(f"params: {key} = {value!r} is not allowed; expected {allowed}")


def doc(cls: type, name: str) -> str:
    return next(f.metadata.get("doc", "") for f in dataclasses.fields(cls) if f.name == name)


# --------------------------------------------------------------------------- loading

YAML_12_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")  # YAML 1.2's core schema


def read_yaml(path: str | os.PathLike, kind: str, option: str) -> Any:
    """A YAML file's content ({} when empty), or a :class:`UserError` naming the ``kind`` of file and ``option``."""
    import yaml

    path = Path(path)
    if not path.is_file():
        from gpt2.core.paths import not_found

        raise UserError(not_found(f"{kind} file {str(path)!r}", f"run from the project root or pass {option} PATH"))
    try:
        return yaml.load(path.read_text(), Loader=_unique_key_loader()) or {}  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        if "is written twice" in str(getattr(exc, "problem", "")):
            raise UserError(f"{kind} file {str(path)!r}: {exc.problem}") from None
        raise UserError(f"{kind} file {str(path)!r} is not valid YAML: {yaml_problem(exc, path.read_text())}") from None


def yaml_problem(exc: Any, text: str) -> str:
    """PyYAML's error in one line: where (line, column and the line's text), what, and what it was reading
    when that began on another line (an unclosed bracket or quote). PyYAML's own text spans six lines."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(exc).split())
    lines = text.splitlines()
    shown = lines[mark.line].strip() if mark.line < len(lines) else ""
    said = f"line {mark.line + 1}, column {mark.column + 1}" + (f" ({shown[:60]!r})" if shown else "") + f": {problem}"
    context, begun = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and begun is not None and begun.line != mark.line:
        said += f", {context} begun on line {begun.line + 1}"
    if "'\\t'" in problem:
        said += "; YAML indents with spaces, not tabs"
    return said


def override(data: dict[str, Any], sets: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``data`` with each ``-S section.key=value`` set, the value read as YAML (as ``dvc exp run -S`` reads it), so
    that the run checks it exactly as it checks the file."""
    import yaml

    data = copy.deepcopy(data)
    for item in sets:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise UserError(f"-S {item!r}: write section.key=value, e.g. -S train.lr=1.0e-3")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text  # a plain string; the key's check says what it allows
        section = data
        for depth, part in enumerate(parts[:-1]):
            inner = section.setdefault(part, {})
            if not isinstance(inner, dict):
                raise UserError(f"-S {item!r}: {'.'.join(parts[:depth + 1])} is a value, not a section")
            section = inner
        section[parts[-1]] = value
    return data


def _unique_keys(loader: Any, node: Any, deep: bool = False) -> dict[Any, Any]:
    """A mapping whose keys are each written once: PyYAML keeps the last of two silently, so one of two values
    the user wrote would be ignored without a word."""
    import yaml

    first: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in first:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark, f"the key {key!r} is written twice (lines "
                f"{first[key] + 1} and {key_node.start_mark.line + 1}): keep one", key_node.start_mark)
        first[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


def _unique_key_loader() -> type:
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_keys)
    return UniqueKeyLoader


def build(cls: type, data: Any, at: str, moved: dict[str, str] | None = None) -> Any:
    """Build dataclass ``cls`` from ``data`` (a dict), checking keys, types and ranges.

    ``moved`` maps keys that used to live here (``train.attention``) to what became of them."""
    where = at or "params"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ParamError(f"params: {where} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key in fields:
            continue
        if (moved or {}).get(_join(at, key)):
            raise ParamError(f"params: {_join(at, key)} {moved[_join(at, key)]}")
        close = difflib.get_close_matches(str(key), fields, n=1)
        known = f"{at}'s keys" if at else "the sections"
        raise ParamError(f"params: unknown key {_join(at, key)!r}; " + (
            f"did you mean {_join(at, close[0])!r}? (docs/params.md lists every key)" if close
            else f"{known}: {', '.join(sorted(fields))}"))
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        key = _join(at, name)
        nested = [k for k in value if k in fields] if isinstance(value, dict) else []
        if nested and not dataclasses.is_dataclass(hints[name]):  # `time_budget_s:` then an over-indented `lr:`
            raise ParamError(f"params: {', '.join(_join(at, k) for k in nested)} is indented under {key}, so YAML "
                             f"reads it as {key}'s value ({value!r}); indent it as {where}'s other keys")
        values[name] = coerce(value, hints[name], key, moved)
        check_range(values[name], fields[name], hints[name], key)
    obj = cls(**values)
    if hasattr(obj, "check"):
        obj.check(at)
    return obj


READ_AS_BOOL = " (YAML reads a bare yes, no, on, off, true or false as a boolean)"


def coerce(value: Any, hint: Any, key: str, moved: dict[str, str] | None = None) -> Any:
    """Return ``value`` as type ``hint`` or raise a :class:`ParamError` naming ``key``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key, moved)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return coerce(value, inner[0], key)
        for candidate in inner:
            try:
                return coerce(value, candidate, key)
            except ParamError:
                continue
        raise ParamError(f"params: {key} = {value!r} has the wrong type; expected "
                         + " or ".join(["null"] * (type(None) in args) + [_describe(a, {}) for a in inner])
                         + (READ_AS_BOOL if isinstance(value, bool) and bool not in inner else ""))
    if origin is Literal:
        if "off" in args:
            value = bare_off(value)
        read_as_bool = READ_AS_BOOL if isinstance(value, bool) and not any(isinstance(a, bool) for a in args) else ""
        require(value in args, key, value, "one of " + ", ".join(repr(a) for a in args) + read_as_bool)
        return value
    if origin in (list, tuple):
        require(isinstance(value, list | tuple), key, value, f"a list ({_type_name(hint)})")
        if origin is tuple and args and args[-1] is not Ellipsis:
            require(len(value) == len(args), key, value, f"a list of {len(args)} values")
            return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if hint is bool:
        require(isinstance(value, bool), key, value, "true or false")
        return value
    if hint is int:
        require(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
        return value
    if hint is float:
        if isinstance(value, str) and YAML_12_FLOAT.fullmatch(value.strip()):
            value = float(value)  # 6e-4: YAML 1.2's float (DVC's -S writes 3e-05 so), YAML 1.1's text (PyYAML's)
        require(isinstance(value, int | float) and not isinstance(value, bool), key, value, "a number")
        require(math.isfinite(value), key, value, "a finite number (.inf and .nan are YAML's, not a setting's)")
        return float(value)
    if hint is str:
        require(isinstance(value, str), key, value, "a string")
        return value
    raise TypeError(f"unsupported type {hint!r} for {key}")  # a bug in a config dataclass, not user input


def check_range(value: Any, spec: dataclasses.Field, hint: Any, key: str) -> None:
    """The field's declared bounds, on a number or on each number of a tuple (``betas``)."""
    numbers = value if isinstance(value, tuple) else (value,)
    for number in numbers:
        if isinstance(number, int | float) and not isinstance(number, bool) and not within(number, spec.metadata):
            require(False, key, list(value) if isinstance(value, tuple) else value, allowed(spec, hint))


def within(x: float, bounds: typing.Mapping[str, Any]) -> bool:
    return (("ge" not in bounds or x >= bounds["ge"]) and ("gt" not in bounds or x > bounds["gt"])
            and ("le" not in bounds or x <= bounds["le"]) and ("lt" not in bounds or x < bounds["lt"]))


def allowed(spec: dataclasses.Field, hint: Any) -> str:
    """What a field takes, in words: ``null or an integer >= 1``, ``a number in (0, 0.5]``, ``one of 'a', 'b'``."""
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
    inner = next((a for a in typing.get_args(hint) if a is not type(None)), hint) if optional else hint
    m = spec.metadata
    text = _describe(inner, m)
    text = f"null or {text}" if optional else text
    return f"{text} ({m['note']})" if m.get("note") else text


def _describe(inner: Any, m: typing.Mapping[str, Any]) -> str:
    """One type with its bounds, in words (each member of ``int | Literal["auto"]`` in turn)."""
    if typing.get_origin(inner) in (typing.Union, types.UnionType):
        return " or ".join(_describe(member, m) for member in typing.get_args(inner))
    if typing.get_origin(inner) is Literal:
        names = [str(a) for a in typing.get_args(inner)]
        text = names[0] if len(names) == 1 else "one of " + ", ".join(names)
    elif inner is bool:
        text = "true or false"
    elif inner is str:
        text = "a string"
    elif typing.get_origin(inner) is tuple and typing.get_args(inner)[:1] == (str,):
        text = "a list of strings"
    elif inner in (int, float) or typing.get_origin(inner) is tuple:
        noun = {int: "an integer", float: "a number"}.get(inner, f"a list of {len(typing.get_args(inner))} numbers")
        low = ("[", m["ge"]) if "ge" in m else ("(", m["gt"]) if "gt" in m else None
        high = (m["le"], "]") if "le" in m else (m["lt"], ")") if "lt" in m else None
        if low and high:
            text = f"{noun} in {low[0]}{low[1]:g}, {high[0]:g}{high[1]}"
        elif low:
            text = f"{noun} {'>=' if low[0] == '[' else '>'} {low[1]:g}"
        elif high:
            text = f"{noun} {'<=' if high[1] == ']' else '<'} {high[0]:g}"
        else:
            text = noun
        if typing.get_origin(inner) is tuple and (low or high):
            count = len(typing.get_args(inner))
            text = text.replace(f"a list of {count} numbers", f"{count} numbers")
    else:
        text = _type_name(inner)
    return text


def to_dict(obj: Any) -> dict:
    """Plain-dict view of a config, for logging and for metadata files."""
    return dataclasses.asdict(obj)


# --------------------------------------------------------------------------- documentation


def markdown_table(cls: type, section: str) -> str:
    """One section's keys as a markdown table (docs/params.md is made of these)."""
    hints = typing.get_type_hints(cls)
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        cells = [f"`{section}.{f.name}`", _yaml(f.default), allowed(f, hints[f.name]), f.metadata.get("doc", "")]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def _yaml(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    return f"`{value}`"


def _join(at: str, key: Any) -> str:
    return f"{at}.{key}" if at else str(key)


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
