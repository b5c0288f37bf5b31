"""The config reference: every key of every section, from the config dataclasses themselves.

The sections are found by walking `daemon.config.Config` (a dataclass field is a `[table]`, a
`list[dataclass]` an `[[array]]`, `[[sources]]` one table per type in daemon.sources.SOURCE_TYPES,
`[rollout.groups.NAME]` the value type of `RolloutSettings.groups`). A key's description is the
comment on its line in the dataclass's source, with the comment lines right above it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

_NOT_KEYS = {"source_file"}  # Config fields that are not sections
_INTERNAL = {("checks", "ipc_enabled")}  # set by the daemon itself (transport = "ipc"), still a key


@dataclass(frozen=True)
class Key:
    name: str
    type: str
    default: Any  # the TOML value, or REQUIRED / UNSET
    description: str


@dataclass(frozen=True)
class Section:
    header: str  # "[daemon]", "[[sources]] type = \"s3\"", "[rollout.groups.NAME]"
    path: str  # "daemon", "sources.s3", "rollout.groups"
    cls: type
    keys: tuple[Key, ...]


class _Marker:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


REQUIRED = _Marker("required")
UNSET = _Marker("unset")


def sections() -> list[Section]:
    from daemon.common.apiconfig import ApiSettings
    from daemon.config import Config, RolloutSettings
    from daemon.fleet.settings import FleetSettings
    from daemon.gates.settings import GateSettings
    from daemon.sources import SOURCE_TYPES, source_type

    out: list[Section] = []
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        if f.name in _NOT_KEYS:
            continue
        if f.name == "sources":
            for kind in SOURCE_TYPES:
                cls = source_type(kind).config_type
                out.append(_section(f'[[sources]] type = "{kind}"', f"sources.{kind}", cls))
            continue
        tp = _unoptional(hints[f.name])
        if get_origin(tp) is list:
            out.append(_section(f"[[{f.name}]]", f.name, get_args(tp)[0]))
        else:
            out.append(_section(f"[{f.name}]", f.name, tp))
        if tp is RolloutSettings:
            group = get_args(typing.get_type_hints(RolloutSettings)["groups"])[1]
            out.append(_section("[rollout.groups.NAME]", "rollout.groups", group))
        if tp is FleetSettings:
            stage = get_args(typing.get_type_hints(FleetSettings)["stages"])[0]
            out.append(_section("[[fleet.stages]]", "fleet.stages", stage))
        if tp is ApiSettings:
            token = get_args(typing.get_type_hints(ApiSettings)["tokens"])[0]
            out.append(_section("[[api.tokens]]", "api.tokens", token))
        if tp is GateSettings:
            gate = get_args(typing.get_type_hints(GateSettings)["gate"])[0]
            out.append(_section("[[gates.gate]]", "gates.gate", gate))
    return out


def _unoptional(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _section(header: str, path: str, cls: type) -> Section:
    hints = typing.get_type_hints(cls)
    notes = field_comments(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        keys.append(Key(f.name, type_text(hints[f.name]), default_of(f), notes.get(f.name, "")))
    return Section(header, path, cls, tuple(keys))


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return REQUIRED
    return UNSET if value is None else toml_value(value)


def toml_value(value: Any) -> Any:
    """A default as TOML reads it back (tuples are arrays, paths are strings)."""
    if isinstance(value, tuple | list):
        return [toml_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): toml_value(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def type_text(tp: Any) -> str:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        text = " or ".join(type_text(a) for a in args)
        return f"{text} (optional)" if len(args) < len(get_args(tp)) else text
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in get_args(tp))
    if origin in (list, tuple, set, frozenset):
        args = [a for a in get_args(tp) if a is not Ellipsis]
        return f"array of {type_text(args[0])}" if args else "array"
    if origin is dict:
        return f"table of {type_text(get_args(tp)[1])}"
    if tp is Any:
        return "any"
    return {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path"}.get(tp, getattr(tp, "__name__", str(tp)))


def field_comments(cls: type) -> dict[str, str]:
    """field name -> its comment: the lines right above it, then the one on its own line."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    own_line = {i + 1 for i, line in enumerate(source.splitlines()) if line.strip().startswith("#")}
    tree = ast.parse(source)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line in own_line:
            above.insert(0, comments[line])
            line -= 1
        trailing = comments.get(node.end_lineno or node.lineno) if (node.end_lineno or node.lineno) not in own_line else None
        text = " ".join([*above, *([trailing] if trailing else [])])
        out[node.target.id] = " ".join(text.replace("fmt: skip", "").split())
    return out


def _default_text(value: Any) -> str:
    if value is REQUIRED:
        return "**required**"
    if value is UNSET:
        return "unset"
    return f"`{_toml(value)}`"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _prose(text: str) -> str:
    """A description as table text: `<state_dir>` is a placeholder, not an HTML tag."""
    return _cell(text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"))


def markdown() -> str:
    """The reference page's body: one table per section."""
    lines = []
    for sec in sections():
        lines += [f"## `{sec.header}`", ""]
        doc = inspect.getdoc(sec.cls) or ""
        first = doc.split("\n\n", 1)[0].replace("\n", " ")
        if first and not first.startswith(sec.cls.__name__ + "("):
            lines += [first.replace("<", "&lt;").replace(">", "&gt;"), ""]
        lines += [f"From `{sec.cls.__module__}.{sec.cls.__qualname__}`.", "",
                  "| key | type | default | description |", "|---|---|---|---|"]  # fmt: skip
        for k in sec.keys:
            lines.append(f"| `{k.name}` | {_cell(k.type)} | {_cell(_default_text(k.default))} | {_prose(k.description)} |")
        lines.append("")
    return "\n".join(lines)
