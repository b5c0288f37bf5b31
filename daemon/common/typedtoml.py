"""TOML tables -> typed dataclasses: the conversion under daemon.config, checked against annotations.

`convert(value, annotation, key)` checks a TOML value against a type annotation (unions,
Literal, lists, dicts, nested dataclasses, finite floats, paths) and `build_dataclass(table,
cls, key)` builds one section, refusing unknown keys and calling the section's `validate(key)`.
Every failure is a `ConfigError` whose message starts with the key it is about.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    """A configuration problem; str() is one line naming the file and key. `problems`: each
    problem found, one line each (a table with several bad keys names them all)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


def _fmt_key(key: str) -> str:
    return f"[{key}]" if "." not in key and "[" not in key else key


def convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` from TOML against annotation `tp`; build dataclasses; name `key` on error."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        errors = []
        for a in args:
            try:
                return convert(value, a, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} has the wrong type")
    if origin is Literal:
        if value not in get_args(tp):
            choices = ", ".join(repr(a) for a in get_args(tp))
            raise ConfigError(f"{key}: {value!r} is not one of {choices}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{_fmt_key(key)}: expected a table, got {type_name(value)}")
        return build_dataclass(value, tp, key)
    if origin in (list, tuple, frozenset, set):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected an array, got {type_name(value)}")
        item_args = get_args(tp)
        item_tp = item_args[0] if item_args else Any
        items = [convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else origin(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type_name(value)}")
        _, vt = get_args(tp) or (str, Any)
        return {str(k): convert(v, vt, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {type_name(value)} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type_name(value)} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {type_name(value)} {value!r}")
        if not math.isfinite(value):  # TOML has nan and inf: a timeout of nan never compares, inf never ends
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type_name(value)} {value!r}")
        return value
    if tp is Path or (isinstance(tp, type) and issubclass(tp, os.PathLike)):
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a path string, got {type_name(value)} {value!r}")
        return Path(value)
    raise ConfigError(f"{key}: unsupported setting type {tp!r}")


def build_dataclass(table: dict[str, Any], cls: Any, key: str) -> Any:
    """`table` as a `cls`; every bad key of the table at once (ConfigError.problems), not one per attempt."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    required = {n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    known = ", ".join(sorted(fields))
    problems = [f"{key}.{name}: unknown key (known: {known})" for name in sorted(set(table) - set(fields))]
    kwargs: dict[str, Any] = {}
    for name in fields:
        if name in table:
            try:
                kwargs[name] = convert(table[name], hints[name], f"{key}.{name}")
            except ConfigError as exc:
                problems += exc.problems
        elif name in required:
            problems.append(f"{key}.{name}: missing required value")
    obj = None
    if required <= kwargs.keys():  # the good keys (a bad one left at its default) still go through the table's own checks
        try:
            obj = cls(**kwargs)
            validate = getattr(obj, "validate", None)
            if callable(validate):
                validate(key)
        except ConfigError as exc:
            problems += [p for p in exc.problems if p not in problems]
        except (TypeError, ValueError) as exc:  # a section's own validate() may raise plain ValueError
            msg = str(exc)
            problems.append(msg if msg.startswith(key) else f"{key}: {msg}")
    if problems:
        raise ConfigError("; ".join(problems), problems)
    return obj


def type_name(value: Any) -> str:
    return {
        str: "string",
        int: "integer",
        float: "number",
        bool: "boolean",
        list: "array",
        dict: "table",
    }.get(type(value), type(value).__name__)
