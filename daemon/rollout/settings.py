"""Typed settings of the rollout engine: `[rollout]`, `[rollout.groups.NAME]`, `[[workers]]`, `[loader]`.

These dataclasses are sections of `daemon.config.Config`: its loader builds them
from TOML by their annotations and calls `validate(key)`, so every error names
the file and the key. Only the standard library is imported here (the config
loader imports this module at start-up).

```toml
[rollout]
transport = "disk"          # disk | ipc
mode = "drain"              # default group's mode: drain | pause
max_unavailable = 1
health_window_s = 5.0       # post-deploy watch; 0 turns it off
max_error_rate = 0.01       # rolled back above this share of failed requests

[rollout.groups.canary]     # optional: groups roll one after another, in [[workers]] order
mode = "pause"

[[workers]]
name = "gpu0"
url = "http://127.0.0.1:8001"
token_file = "/etc/hotswap/worker.token"
device = "cuda:0"
group = "canary"
restart_command = "systemctl restart hotswap-worker@0"
```
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Literal

RolloutMode = Literal["drain", "pause"]
DEFAULT_GROUP = "default"
MANAGED_WORKER_NAME = "local"
ADAPTED_KINDS = ("builtin",)  # kinds daemon.adapters.make_client can drive today
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$")

# Placeholders a restart command may use; each becomes one argv element.
RESTART_PLACEHOLDERS = ("name", "url", "port", "device", "version", "path", "token_file")


def _error(key: str, message: str) -> ValueError:
    # Imported lazily: daemon.config imports this module while it loads.
    from daemon.config import ConfigError

    return ConfigError(f"{key}.{message}")


@dataclass
class GroupSettings:
    """`[rollout.groups.NAME]`: how one group of workers leaves RUNNING."""

    mode: RolloutMode = "drain"
    max_unavailable: int = 0  # 0 = [rollout].max_unavailable

    def validate(self, key: str) -> None:
        if self.max_unavailable < 0:
            raise _error(key, f"max_unavailable: must be >= 0 (0 = the [rollout] value), got {self.max_unavailable}")


@dataclass
class RolloutSettings:
    """`[rollout]`: transports, pacing, step timeouts, health window and poll."""

    transport: Literal["disk", "ipc"] = "disk"
    update_mode: Literal["copy", "swap"] = "copy"  # how an ipc update lands in the worker
    mode: RolloutMode = "drain"  # mode of the "default" group and of groups without their own
    max_unavailable: int = 1  # workers out of RUNNING at the same time, per group
    groups: dict[str, GroupSettings] = field(default_factory=dict)
    # Per-step timeouts (seconds). A step that runs past its timeout fails the worker.
    drain_timeout_s: float = 30.0  # in-flight requests finishing after readiness goes off
    update_timeout_s: float = 300.0  # the transfer into the worker's parameters
    restart_timeout_s: float = 180.0  # restart command until the worker answers healthy
    stage_timeout_s: float = 600.0  # ipc: loader staging a version
    # Post-deploy health window: roll back when a worker's failed share exceeds the bound.
    health_window_s: float = 5.0
    max_error_rate: float = 0.01
    min_window_requests: int = 1  # fewer requests than this in the window: no verdict on that worker
    health_sample_s: float = 0.5
    health_poll_s: float = 5.0  # background poll of every worker's /weight_info
    request_timeout_s: float = 10.0  # every other admin call (weight_info, pause, probe, resume, ...)

    def validate(self, key: str) -> None:
        if self.max_unavailable < 1:
            raise _error(key, f"max_unavailable: must be >= 1, got {self.max_unavailable}")
        for name in (
            "drain_timeout_s",
            "update_timeout_s",
            "restart_timeout_s",
            "stage_timeout_s",
            "health_sample_s",
            "health_poll_s",
            "request_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise _error(key, f"{name}: must be > 0, got {getattr(self, name)}")
        if self.health_window_s < 0:
            raise _error(key, f"health_window_s: must be >= 0 (0 = no window), got {self.health_window_s}")
        if not 0 <= self.max_error_rate <= 1:
            raise _error(key, f"max_error_rate: must be between 0 and 1 (a share, 0.01 = 1 %), got {self.max_error_rate}")
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

    name: str
    url: str = ""  # base URL of its serving + admin API; "" only with launch = "managed"
    kind: Literal["builtin", "sglang", "vllm"] = "builtin"
    token_file: str = ""  # bearer token for the admin API; managed: "" = <state_dir>/worker-NAME.token
    device: str = "auto"  # informational for external workers; managed: passed to `hotswap worker`
    group: str = DEFAULT_GROUP
    # Run when the worker cannot be restored over its admin API (e.g. "systemctl restart
    # hotswap-worker@0"). A string is split like a shell would, but never run by a shell;
    # {name} {url} {port} {device} {version} {path} {token_file} are filled in per argument.
    restart_command: list[str] | str = ""
    # "managed": the daemon runs `hotswap worker` itself as a supervised child on a loopback
    # port and relaunches it on the last good version when it has to restart it.
    launch: Literal["external", "managed"] = "external"
    port: int = 0  # managed: loopback port; 0 = a free port chosen at launch
    model: str = ""  # managed: directory served before the registry has a version ("" = tiny seed)

    def validate(self, key: str) -> None:
        if not _NAME_RE.match(self.name):
            raise _error(key, f"name: {self.name!r} must be 1-128 letters, digits or _.@- (starting alphanumeric)")
        if not _NAME_RE.match(self.group):
            raise _error(key, f"group: {self.group!r} must be letters, digits or _.@-")
        if self.kind not in ADAPTED_KINDS:
            raise _error(key, f"kind: {self.kind!r} has no adapter in this version yet (supported: {', '.join(ADAPTED_KINDS)})")
        if self.launch == "external":
            if not self.url:
                raise _error(key, "url: required for an external worker (e.g. http://127.0.0.1:8001)")
            if not re.match(r"^https?://[^/\s]+", self.url):
                raise _error(key, f"url: {self.url!r} is not an http(s) URL")
        else:
            if self.url:
                raise _error(key, "url: a managed worker's URL is chosen by the daemon; leave it out")
            if self.kind != "builtin":
                raise _error(key, f"kind: only builtin workers can be managed, got {self.kind!r}")
            if self.restart_command:
                raise _error(key, "restart_command: a managed worker is restarted by the daemon itself")
        if not 0 <= self.port <= 65535:
            raise _error(key, f"port: {self.port} is not a TCP port")
        try:
            argv = self.restart_argv()
        except ValueError as exc:
            raise _error(key, f"restart_command: {exc}") from None
        for arg in argv:
            for ph in re.findall(r"{([^{}]*)}", arg):
                if ph not in RESTART_PLACEHOLDERS:
                    raise _error(
                        key,
                        f"restart_command: unknown placeholder {{{ph}}} (known: {', '.join(RESTART_PLACEHOLDERS)})",
                    )

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
    token_file: str = ""

    def validate(self, key: str) -> None:
        return None


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
