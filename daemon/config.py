"""TOML configuration -> typed, validated dataclasses: every section of the daemon's config.

Every error names the file and the key (`config.toml: [sources][0].path: ...`). Unknown keys
are errors, so a typo never silently falls back to a default. With no file the daemon runs on the
embedded default: SQLite under ./state, watching ./checkpoints, one reference worker it runs
itself. Relative paths are taken relative to the working directory.

Adding a section is one dataclass plus one field on `Config`: the loader walks the fields of
`Config` and builds each section from its type annotation (a dataclass is a `[table]`,
`list[dataclass]` is an `[[array]]`). A section's `validate(key)` raises `ConfigError` or a plain
`ValueError` whose message starts with the key; either way the user sees one line naming the
file and the key.

Names that plug in a component are checked against that component's registry: `[[sources]] type`
(daemon.sources), `[[workers]] kind` (daemon.engines) and `[rollout] transport` (daemon.transport).
`[[sources]]` is a union on `type`: the source's own module defines its table's dataclass.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from daemon.checks import CheckSettings

from daemon.common import (  # isort: skip (one statement in two lines: this module is near 450 lines)
    CONFIG_ENV, LOG_LEVELS, ApiSettings, ConfigError, build_dataclass, convert, listen_problem, parse_listen, shell_of,
    type_name)
from daemon.engines import ENGINE_KEYS, ENGINE_PAUSE_MODES, MANAGED_KIND, WORKER_KINDS
from daemon.fleet import FleetSettings, fleet_problem
from daemon.gates import GateSettings
from daemon.sources import SOURCE_TYPES, source_config_type
from daemon.transport import TRANSPORTS
from daemon.webhooks import WebhookSettings, check_webhook_names

EMBEDDED = "<embedded default>"


@dataclass
class DaemonConfig:
    state_dir: str = "./state"  # SQLite file, staged data and runtime files live here
    log_level: str = "info"  # debug | info | warning | error
    listen: str = "127.0.0.1:8780"  # daemon HTTP API (status, metrics, health); "" turns it off
    watchdog_interval_s: float = 0.0  # 0 = use systemd's WATCHDOG_USEC when set
    retention_interval_s: float = 300.0  # how often sources may prune directories they created
    keep_workers_on_stop: bool = True  # managed workers keep serving while the daemon restarts (adopted at start)
    recycle_rebuilt: bool = True  # a delta's rebuild overwrites a stale rebuilt version's same-size files in place

    def validate(self, key: str) -> None:
        if self.retention_interval_s <= 0:
            raise ConfigError(f"{key}.retention_interval_s: must be > 0")
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
    # events and checks rows older than this many days are deleted (never those of serving, last good, pinned or
    # in-flight versions; every version's own row stays): daemon.registry.retention. 0 = keep everything
    retention_days: float = 0.0
    retention_interval_s: float = 3600.0  # how often the daemon prunes them (with retention_days > 0)

    def validate(self, key: str) -> None:
        if self.url and "://" not in self.url:
            raise ConfigError(
                f"{key}.url: {self.url!r} is not a SQLAlchemy URL (e.g. sqlite:///state/hotswap.db)"
            )
        if self.retention_days < 0:
            raise ConfigError(f"{key}.retention_days: must be >= 0 (0 = keep everything), got {self.retention_days}")
        if self.retention_interval_s <= 0:
            raise ConfigError(f"{key}.retention_interval_s: must be > 0, got {self.retention_interval_s}")


# -- [rollout], [rollout.groups.NAME], [[workers]], [loader] (keys: docs/reference/config.md) ------

RolloutMode = Literal["drain", "pause"]
DEFAULT_GROUP = "default"
MANAGED_WORKER_NAME = "local"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$")

# Placeholders a restart command may use; each becomes one argv element.
RESTART_PLACEHOLDERS = ("name", "url", "port", "device", "version", "path", "token_file")


def _error(key: str, message: str) -> ConfigError:
    return ConfigError(f"{key}.{message}")


@dataclass
class GroupSettings:
    """`[rollout.groups.NAME]`: how one group of workers leaves RUNNING."""

    mode: RolloutMode = "drain"  # how this group leaves RUNNING: drain | pause
    max_unavailable: int = 0  # 0 = [rollout].max_unavailable

    def validate(self, key: str) -> None:
        if self.max_unavailable < 0:
            raise _error(key, f"max_unavailable: must be >= 0 (0 = the [rollout] value), got {self.max_unavailable}")


@dataclass
class RolloutSettings:
    """`[rollout]`: transports, pacing, step timeouts, health window and poll."""

    transport: str = "disk"  # a name in daemon.transport.TRANSPORTS
    update_mode: Literal["copy", "swap"] = "copy"  # how an ipc update lands in the worker
    mode: RolloutMode = "drain"  # mode of the "default" group and of groups without their own
    max_unavailable: int = 1  # workers out of RUNNING at the same time, per group
    groups: dict[str, GroupSettings] = field(default_factory=dict)  # named groups, [rollout.groups.NAME]: rolled one after another in [[workers]] order
    # Per-step timeouts (seconds). A step that runs past its timeout fails the worker.
    drain_timeout_s: float = 30.0  # in-flight requests finishing after readiness goes off
    # drain mode: after a batch is back RUNNING, wait this long before draining the next, so a
    # load balancer's health check has put it back in rotation (>= the balancer's check interval)
    rejoin_s: float = 1.0
    update_timeout_s: float = 300.0  # the transfer into the worker's parameters
    restart_timeout_s: float = 180.0  # restart command until the worker answers healthy
    # Managed workers (daemon/controller/supervise.py): a failed launch waits base, doubling up to max, before
    # the next; healthy for reset_s starts again from base.
    relaunch_backoff_s: float = 1.0
    relaunch_backoff_max_s: float = 60.0  # the longest wait between failed launches
    relaunch_reset_s: float = 60.0  # healthy this long: the next failure waits relaunch_backoff_s again
    stage_timeout_s: float = 600.0  # ipc: loader staging a version
    max_infra_retries: int = 3  # a version whose rollout failed for a crashed/unreachable worker: retries, then rejected
    # Post-deploy health window: roll back when a worker's failed share exceeds the bound.
    health_window_s: float = 5.0
    max_error_rate: float = 0.01  # roll back above this share of failed requests in the window (0.01 = 1 %)
    min_window_requests: int = 10  # fewer requests than this in the window: no verdict on that worker
    health_sample_s: float = 0.5  # how often the window reads the workers' request counters
    health_probe_s: float = 1.0  # a greedy probe this often in the window (0 = none); a failed one counts
    health_poll_s: float = 5.0  # background poll of every worker's /weight_info
    request_timeout_s: float = 10.0  # every other admin call (weight_info, pause, probe, resume, ...)
    broadcast_max_pause_s: float = 60.0  # a trainer broadcast holds the workers paused at most this long
    # A verified checkpoint that cannot be written in place (tensor shapes differ from serving, e.g.
    # a resized vocabulary) is rolled out by relaunching workers on it, batch by batch: managed ones
    # by the daemon (port kept), external ones by restart_command ({path}, {version}); false: rejected.
    restart_rollouts: bool = True
    # Workers that can (the reference worker) resume right after the write and run the post-update
    # probe while serving, so the pause is the write alone; a failed probe flips the worker back to
    # the version it served and fails the rollout. false: the probe runs inside the pause (requests
    # held), so a version that passed the checks but fails the probe never serves a request.
    probe_after_resume: bool = True
    workers_ahead: bool = True  # reference workers open (ipc) or read (disk) a version while it is verified
    # A restart rollout of a managed worker in a pause group (a lone worker's): "auto" starts the new
    # process beside the old one when the host has memory for both (then hands over and stops the old
    # one: no outage); "off" always stops first.
    restart_overlap: str = "auto"

    def validate(self, key: str) -> None:
        if self.transport not in TRANSPORTS:
            raise _error(key, f"transport: {self.transport!r} is not one of {', '.join(map(repr, TRANSPORTS))}")
        if self.max_unavailable < 1:
            raise _error(key, f"max_unavailable: must be >= 1, got {self.max_unavailable}")
        for name in (
            "drain_timeout_s",
            "update_timeout_s",
            "restart_timeout_s",
            "relaunch_backoff_s",
            "relaunch_reset_s",
            "stage_timeout_s",
            "health_sample_s",
            "health_poll_s",
            "request_timeout_s",
            "broadcast_max_pause_s",
        ):
            if getattr(self, name) <= 0:
                raise _error(key, f"{name}: must be > 0, got {getattr(self, name)}")
        if self.relaunch_backoff_max_s < self.relaunch_backoff_s:
            raise _error(key, f"relaunch_backoff_max_s: must be >= relaunch_backoff_s ({self.relaunch_backoff_s}), "
                              f"got {self.relaunch_backoff_max_s}")  # fmt: skip
        if self.rejoin_s < 0:
            raise _error(key, f"rejoin_s: must be >= 0 (0 = drain the next batch at once), got {self.rejoin_s}")
        if self.health_window_s < 0:
            raise _error(key, f"health_window_s: must be >= 0 (0 = no window), got {self.health_window_s}")
        if not 0 <= self.max_error_rate <= 1:
            raise _error(key, f"max_error_rate: must be between 0 and 1 (a share, 0.01 = 1 %), got {self.max_error_rate}")
        if self.restart_overlap not in ("auto", "off"):
            raise _error(key, f"restart_overlap: must be \"auto\" or \"off\", got {self.restart_overlap!r}")
        if self.max_infra_retries < 0:
            raise _error(key, f"max_infra_retries: must be >= 0, got {self.max_infra_retries}")
        if self.health_probe_s < 0:
            raise _error(key, f"health_probe_s: must be >= 0 (0 = no probes in the window), got {self.health_probe_s}")
        if self.min_window_requests < 1:
            raise _error(key, f"min_window_requests: must be >= 1, got {self.min_window_requests}")
        for name in self.groups:
            if not _NAME_RE.match(name):
                raise _error(key, f"groups.{name}: group names are letters, digits and _.@-")

    def group(self, name: str) -> GroupSettings:
        g = self.groups.get(name)
        if g is None:
            return GroupSettings(mode=self.mode, max_unavailable=self.max_unavailable)
        return GroupSettings(mode=g.mode, max_unavailable=g.max_unavailable or self.max_unavailable)


@dataclass
class WorkerSpec:
    """`[[workers]]`: one serving process the daemon keeps on the newest good version."""

    name: str  # unique worker name (letters, digits, _.@-)
    url: str = ""  # base URL of its serving + admin API; "" only with launch = "managed"
    kind: str = MANAGED_KIND  # a name in daemon.engines.WORKER_KINDS
    token_file: str = ""  # bearer token for the admin API; managed: "" = <state_dir>/worker-NAME.token
    device: str = "auto"  # informational for external workers; managed: passed to `hotswap worker`
    group: str = DEFAULT_GROUP  # the rollout group ([rollout.groups.NAME]) it belongs to
    # Run when the worker cannot be restored over its admin API (e.g. "systemctl restart
    # hotswap-worker@0"). A string is split like a shell would, but never run by a shell;
    # {name} {url} {port} {device} {version} {path} {token_file} are filled in per argument.
    restart_command: list[str] | str = ""
    # "managed": the daemon runs `hotswap worker` itself as a supervised child on a loopback
    # port and relaunches it on the last good version when it has to restart it.
    launch: Literal["external", "managed"] = "external"
    port: int = 0  # managed: loopback port; 0 = a free port chosen at launch
    model: str = ""  # managed: directory served before the registry has a version ("" = tiny seed)
    # managed: where its admin API is: "unix" = a 0600 socket in <state_dir>/run (0700), the TCP
    # port carrying only serving; "tcp" = on the port, the peer's identity proved before every token
    admin: Literal["unix", "tcp"] = "unix"
    # Engine kinds only (vllm, sglang; docs/how-to/vllm.md): the engine's own pause mode used by
    # rollout mode "pause" ("" = keep for vLLM, retract for SGLang) and SGLang's admin key file.
    pause_mode: str = ""
    admin_token_file: str = ""  # sglang: its --admin-api-key file (the weight routes take only that key)

    def validate(self, key: str) -> None:
        if not _NAME_RE.match(self.name):
            raise _error(key, f"name: {self.name!r} must be 1-128 letters, digits or _.@- (starting alphanumeric)")
        if not _NAME_RE.match(self.group):
            raise _error(key, f"group: {self.group!r} must be letters, digits or _.@-")
        if self.kind not in WORKER_KINDS:
            raise _error(key, f"kind: {self.kind!r} has no adapter in this version yet (supported: {', '.join(WORKER_KINDS)})")
        if self.launch == "external":
            if not self.url:
                raise _error(key, "url: required for an external worker (e.g. http://127.0.0.1:8001)")
            if not re.match(r"^https?://[^/\s]+", self.url):
                raise _error(key, f"url: {self.url!r} is not an http(s) URL")
        else:
            if self.url:
                raise _error(key, "url: a managed worker's URL is chosen by the daemon; leave it out")
            if self.kind != MANAGED_KIND:
                raise _error(key, f"kind: only {MANAGED_KIND} workers can be managed, got {self.kind!r}")
            if self.restart_command:
                raise _error(key, "restart_command: a managed worker is restarted by the daemon itself")
        if self.admin not in ("unix", "tcp"):
            raise _error(key, f"admin: {self.admin!r} must be \"unix\" or \"tcp\"")
        if not 0 <= self.port <= 65535:
            raise _error(key, f"port: {self.port} is not a TCP port")
        for opt, value in self.engine_options().items():
            if opt not in ENGINE_KEYS.get(self.kind, ()):
                raise _error(key, f"{opt}: not a setting of kind {self.kind!r}")
            if opt == "pause_mode" and value not in ENGINE_PAUSE_MODES[self.kind]:
                modes = ", ".join(ENGINE_PAUSE_MODES[self.kind])
                raise _error(key, f"pause_mode: {value!r} is not a {self.kind} pause mode ({modes})")
        try:
            argv = self.restart_argv()
        except ValueError as exc:
            raise _error(key, f"restart_command: {exc}") from None
        if (shell := shell_of(argv)) is not None:
            raise _error(key, f"restart_command: runs the shell {shell!r}: a {{version}} or {{path}} placeholder "
                              "would become shell code; give the command and its arguments directly")  # fmt: skip
        for arg in argv:
            for ph in re.findall(r"{([^{}]*)}", arg):
                if ph not in RESTART_PLACEHOLDERS:
                    raise _error(
                        key,
                        f"restart_command: unknown placeholder {{{ph}}} (known: {', '.join(RESTART_PLACEHOLDERS)})",
                    )

    def engine_options(self) -> dict[str, str]:
        """The engine keys this entry sets (passed to the kind's client factory)."""
        return {k: v for k, v in (("pause_mode", self.pause_mode), ("admin_token_file", self.admin_token_file)) if v}

    def restart_argv(self) -> list[str]:
        if isinstance(self.restart_command, list):
            return list(self.restart_command)
        return shlex.split(self.restart_command) if self.restart_command else []


def default_workers() -> list[WorkerSpec]:
    """The embedded default fleet: one reference worker the daemon runs itself."""
    return [WorkerSpec(name=MANAGED_WORKER_NAME, launch="managed")]


@dataclass
class LoaderSettings:
    """`[loader]`: the staging loader used by `transport = "ipc"`."""

    socket: str = ""  # Unix socket of `hotswap loader`; "" = <state_dir>/loader.sock
    token_file: str = ""  # the loader's bearer token file ("" = none)


def check_fleet(rollout: RolloutSettings, workers: list[WorkerSpec]) -> None:
    """Cross-section checks: unique names and URLs, groups that exist in name only."""
    seen: dict[str, int] = {}
    urls: dict[str, str] = {}
    for i, w in enumerate(workers):
        if w.name in seen:
            raise _error(f"workers[{i}]", f"name: {w.name!r} is already used by workers[{seen[w.name]}]")
        seen[w.name] = i
        if w.url:
            if w.url.rstrip("/") in urls:
                raise _error(f"workers[{i}]", f"url: {w.url!r} is already used by worker {urls[w.url.rstrip('/')]!r}")
            urls[w.url.rstrip("/")] = w.name
    ports = [w.port for w in workers if w.launch == "managed" and w.port]
    if len(ports) != len(set(ports)):
        raise _error("workers", "port: two managed workers ask for the same port")


# -- the whole file ----------------------------------------------------------------------------


def _default_sources() -> list[Any]:
    return [source_config_type("local")(path="./checkpoints")]


@dataclass
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    api: ApiSettings = field(default_factory=ApiSettings)  # [api]: TLS, remote access (daemon.common.apiconfig)
    sources: list[Any] = field(default_factory=_default_sources)  # [[sources]]: `type` picks daemon.sources.SOURCE_TYPES
    checks: CheckSettings = field(default_factory=CheckSettings)  # [checks]: daemon.checks.CheckSettings's fields
    # A file without [[workers]] has none (the daemon only verifies); with no file at all the
    # daemon runs one reference worker itself (launch = "managed"), for the quickstart.
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    workers: list[WorkerSpec] = field(default_factory=list)
    loader: LoaderSettings | None = None
    fleet: FleetSettings = field(default_factory=FleetSettings)  # [fleet]: host name, fleet mode (daemon.fleet.settings)
    gates: GateSettings = field(default_factory=GateSettings)  # [gates]: checks of a version on trial (daemon.gates)
    webhooks: list[WebhookSettings] = field(default_factory=list)  # [[webhooks]]: daemon.webhooks.settings
    source_file: str = EMBEDDED

    @property
    def state_dir(self) -> Path:
        return Path(self.daemon.state_dir).expanduser()

    @property
    def runtime_file(self) -> Path:
        return self.state_dir / "daemon.json"  # written by the running daemon (pid, API URL); read by the CLI

    @property
    def database_url(self) -> str:
        if self.database.url:
            return self.database.url
        return f"sqlite:///{self.state_dir / 'hotswap.db'}"


_NOT_SECTIONS = {"source_file"}


def load_config(path: str | os.PathLike[str] | None = None,
                overrides: dict[str, dict[str, Any]] | None = None) -> Config:  # fmt: skip
    """Load and validate a config file; None means $HOTSWAP_CONFIG or else the embedded default.

    `overrides` ({"daemon": {"listen": ...}}, from `hotswap daemon --listen`) replace keys of the
    file (or of the embedded default) before it is validated, so they are checked as the file is."""
    if path is None and os.environ.get(CONFIG_ENV):
        path = os.environ[CONFIG_ENV]
    if path is None:
        return parse_config(_overridden({}, overrides), EMBEDDED)
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
    return parse_config(_overridden(doc, overrides), str(p))


def _overridden(doc: dict[str, Any], overrides: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    for section, values in (overrides or {}).items():
        table = doc.setdefault(section, {})
        if isinstance(table, dict):
            table.update(values)
    return doc


def parse_config(doc: dict[str, Any], source: str) -> Config:
    try:
        config = _parse(doc)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}", [f"{source}: {p}" for p in exc.problems]) from None
    config.source_file = source
    if source == EMBEDDED and "workers" not in doc:
        config.workers = default_workers()  # one worker: the planner pauses it rather than drain it
    return config


def _parse(doc: dict[str, Any]) -> Config:
    hints = typing.get_type_hints(Config)
    section_names = [f.name for f in dataclasses.fields(Config) if f.name not in _NOT_SECTIONS]
    unknown = sorted(set(doc) - set(section_names))
    if unknown:
        raise ConfigError(f"unknown section or key {unknown[0]!r} (known: {', '.join(section_names)})")
    values: dict[str, Any] = {}
    for name in section_names:
        if name == "sources" and name in doc:
            values[name] = _sources(doc[name])
        elif name in doc:
            values[name] = convert(doc[name], hints[name], name)
    config = Config(**values)
    check_fleet(config.rollout, config.workers)
    check_webhook_names(config.webhooks)
    if problem := listen_problem(config.daemon.listen_host_port, config.api):
        raise ConfigError(problem)
    if problem := fleet_problem(config.fleet, config.database_url, config.gates):
        raise ConfigError(problem)
    if not config.rollout.restart_rollouts:  # compat then rejects what would need a restart rollout
        config.checks.restart_rollouts = False
    if TRANSPORTS[config.rollout.transport].stages:
        # a transport that stages a copy (the loader) needs that room too, so headroom checks it
        config.checks.ipc_enabled = True
    return config


def _sources(value: Any) -> list[Any]:
    """`[[sources]]`: a union on `type`; each type's dataclass comes from its source module."""
    if not isinstance(value, list):
        raise ConfigError(f"sources: expected an array, got {type_name(value)}")
    out = []
    for i, table in enumerate(value):
        key = f"sources[{i}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{key}: expected a table, got {type_name(table)}")
        kind = table.get("type", "local")
        if kind not in SOURCE_TYPES:
            raise ConfigError(f"{key}.type: {kind!r} is not one of {', '.join(map(repr, SOURCE_TYPES))}")
        out.append(build_dataclass(table, source_config_type(kind), key))
    return out
