"""TOML configuration -> typed, validated dataclasses.

Every error names the file and the key (`config.toml: [sources][0].path: ...`).
Unknown keys are errors, so a typo never silently falls back to a default.
With no file the daemon runs on the embedded default: SQLite under ./state,
watching ./checkpoints. Relative paths are taken relative to the working directory.

Adding a section is one dataclass plus one field on `Config`: the loader walks
the fields of `Config` and builds each section from its type annotation
(a dataclass is a `[table]`, `list[dataclass]` is an `[[array]]`).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from daemon.rollout.settings import LoaderSettings, RolloutSettings, WorkerSpec, check_fleet, default_workers

CONFIG_ENV = "HOTSWAP_CONFIG"
EMBEDDED = "<embedded default>"
LOG_LEVELS = ("debug", "info", "warning", "error")
COMMIT_SIGNALS = ("manifest", "index", "marker")


class ConfigError(ValueError):
    """A configuration problem; str() is one line naming the file and key."""


@dataclass
class DaemonConfig:
    state_dir: str = "./state"  # SQLite file, staged data and runtime files live here
    log_level: str = "info"  # debug | info | warning | error
    listen: str = "127.0.0.1:8780"  # daemon HTTP API (status, metrics, health); "" turns it off
    watchdog_interval_s: float = 0.0  # 0 = use systemd's WATCHDOG_USEC when set

    def validate(self, key: str) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"{key}.log_level: {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if self.listen:
            parse_listen(self.listen, f"{key}.listen")
        if not self.state_dir:
            raise ConfigError(f"{key}.state_dir: must not be empty")

    @property
    def listen_host_port(self) -> tuple[str, int] | None:
        return parse_listen(self.listen, "daemon.listen") if self.listen else None


@dataclass
class DatabaseConfig:
    url: str = ""  # SQLAlchemy URL; "" = sqlite:///<state_dir>/hotswap.db

    def validate(self, key: str) -> None:
        if self.url and "://" not in self.url:
            raise ConfigError(
                f"{key}.url: {self.url!r} is not a SQLAlchemy URL (e.g. sqlite:///state/hotswap.db)"
            )


@dataclass
class SourceConfig:
    path: str  # required: folder whose subdirectories are checkpoints
    type: Literal["local"] = "local"
    name: str = ""  # label stored in checkpoints.source; "" = "local:<path>"
    commit_signals: list[str] = field(default_factory=lambda: list(COMMIT_SIGNALS))  # checked in this order
    quiet_period_s: float = 2.0  # index signal: shard sizes unchanged this long
    marker_names: list[str] = field(default_factory=lambda: ["_SUCCESS", "commit_success.txt", "COMMITTED"])
    rescan_interval_s: float = 10.0  # safety net for missed filesystem events
    create: bool = True  # create the folder if it does not exist

    def validate(self, key: str) -> None:
        if not self.path:
            raise ConfigError(f"{key}.path: must not be empty")
        for s in self.commit_signals:
            if s not in COMMIT_SIGNALS:
                raise ConfigError(f"{key}.commit_signals: {s!r} is not one of {', '.join(COMMIT_SIGNALS)}")
        if not self.commit_signals:
            raise ConfigError(f"{key}.commit_signals: at least one signal is needed")
        if self.quiet_period_s < 0:
            raise ConfigError(f"{key}.quiet_period_s: must be >= 0")
        if self.rescan_interval_s <= 0:
            raise ConfigError(f"{key}.rescan_interval_s: must be > 0")
        if "marker" in self.commit_signals and not self.marker_names:
            raise ConfigError(f"{key}.marker_names: the marker signal needs at least one name")

    @property
    def label(self) -> str:
        return self.name or f"{self.type}:{self.path}"


def _default_sources() -> list[SourceConfig]:
    return [SourceConfig(path="./checkpoints")]


def _check_settings_type() -> type:
    from daemon.checks import CheckSettings  # owned by the checks package

    return CheckSettings


@dataclass
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    sources: list[SourceConfig] = field(default_factory=_default_sources)
    # [checks] is mapped onto daemon.checks.CheckSettings (its fields are the keys).
    checks: Any = None
    # [rollout], [[workers]], [loader]: daemon.rollout.settings. A file without [[workers]]
    # has none (the daemon only verifies); with no file at all the daemon runs one
    # reference worker itself (launch = "managed"), for the quickstart.
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    workers: list[WorkerSpec] = field(default_factory=list)
    loader: LoaderSettings | None = None
    source_file: str = EMBEDDED

    def __post_init__(self) -> None:
        if self.checks is None:
            self.checks = _check_settings_type()()

    @property
    def state_dir(self) -> Path:
        return Path(self.daemon.state_dir).expanduser()

    @property
    def database_url(self) -> str:
        if self.database.url:
            return self.database.url
        return f"sqlite:///{self.state_dir / 'hotswap.db'}"


# Top-level keys of Config that are sections, and the one computed lazily.
_LAZY_SECTIONS: dict[str, typing.Callable[[], type]] = {"checks": _check_settings_type}
_NOT_SECTIONS = {"source_file"}


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Load and validate a config file; None means $HOTSWAP_CONFIG or else the embedded default."""
    if path is None and os.environ.get(CONFIG_ENV):
        path = os.environ[CONFIG_ENV]
    if path is None:
        return parse_config({}, EMBEDDED)
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config file ({exc.strerror})") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    return parse_config(doc, str(p))


def parse_config(doc: dict[str, Any], source: str) -> Config:
    try:
        config = _parse(doc)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    config.source_file = source
    if source == EMBEDDED and "workers" not in doc:
        config.workers = default_workers()
        # One worker: draining it would turn requests away; pausing holds them instead.
        config.rollout.mode = "pause"
    return config


def _parse(doc: dict[str, Any]) -> Config:
    hints = typing.get_type_hints(Config)
    section_names = [f.name for f in dataclasses.fields(Config) if f.name not in _NOT_SECTIONS]
    unknown = sorted(set(doc) - set(section_names))
    if unknown:
        raise ConfigError(f"unknown section or key {unknown[0]!r} (known: {', '.join(section_names)})")
    values: dict[str, Any] = {}
    for name in section_names:
        if name in _LAZY_SECTIONS:
            try:
                tp = _LAZY_SECTIONS[name]()
            except ImportError as exc:
                if name in doc:
                    raise ConfigError(
                        f"[{name}]: this section needs {exc.name}, which is not installed"
                    ) from None
                continue
        else:
            tp = hints[name]
        if name in doc:
            values[name] = _convert(doc[name], tp, name)
        elif name in _LAZY_SECTIONS:
            values[name] = tp()
    config = Config(**values)
    check_fleet(config.rollout, config.workers)
    if config.rollout.transport == "ipc":
        # staging through the loader needs GPU (or /dev/shm) room too, so headroom checks it
        config.checks.ipc_enabled = True
    return config


def _fmt_key(key: str) -> str:
    return f"[{key}]" if "." not in key and "[" not in key else key


def _convert(value: Any, tp: Any, key: str) -> Any:
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
                return _convert(value, a, key)
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
            raise ConfigError(f"{_fmt_key(key)}: expected a table, got {_tname(value)}")
        return _build_dataclass(value, tp, key)
    if origin in (list, tuple, frozenset, set):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected an array, got {_tname(value)}")
        args = get_args(tp)
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return origin(items) if origin is not list else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {_tname(value)}")
        _, vt = get_args(tp) or (str, Any)
        return {str(k): _convert(v, vt, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {_tname(value)} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {_tname(value)} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {_tname(value)} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {_tname(value)} {value!r}")
        return value
    if tp is Path or (isinstance(tp, type) and issubclass(tp, os.PathLike)):
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a path string, got {_tname(value)} {value!r}")
        return Path(value)
    raise ConfigError(f"{key}: unsupported setting type {tp!r}")


def _build_dataclass(table: dict[str, Any], cls: Any, key: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: unknown key (known: {', '.join(sorted(fields))})")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name in table:
            kwargs[name] = _convert(table[name], hints[name], f"{key}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key}.{name}: missing required value")
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}: {exc}") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate(key)
        except ConfigError:
            raise
        except ValueError as exc:  # a section's own validate() may raise plain ValueError
            raise ConfigError(f"{key}: {exc}") from None
    return obj


def _tname(value: Any) -> str:
    return {
        str: "string",
        int: "integer",
        float: "number",
        bool: "boolean",
        list: "array",
        dict: "table",
    }.get(type(value), type(value).__name__)


def parse_listen(value: str, key: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{key}: {value!r} is not host:port (e.g. 127.0.0.1:8780)")
    return host.strip("[]"), int(port)
