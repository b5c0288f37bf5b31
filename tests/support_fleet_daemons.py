"""Helpers for tests with real fleet daemons: one host's daemon with its own worker, folder and
copy of v0, and a host's aliases read from the shared registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conftest import DaemonProcess
from support_rollout import WorkerProc, publish_into, reset_worker

from daemon.registry import Registry
from daemon.registry.journal import Journal

LEASE_S = 4.0


def host_daemon(factory: Callable[..., DaemonProcess], url: str, i: int, w: WorkerProc, env: dict[str, str],
                *, rollout: dict[str, Any] | None = None, sections: dict[str, Any] | None = None,
                **fleet: Any) -> DaemonProcess:  # fmt: skip
    """`fleet`: more [fleet] settings (e.g. stages); `rollout`: more [rollout] keys; `sections`: more
    sections (e.g. gates)."""
    d = factory(url, checks={"enabled": ["manifest", "headers", "crc32c"]}, hooked=True, env=env, wait=False,
                extra={**(sections or {}),
                       "rollout": {"mode": "pause", "health_window_s": 0.3, "health_poll_s": 0.5, **(rollout or {})},
                       "workers": [w.spec()],
                       "fleet": {"host": f"host-{i}", "enabled": True, "max_updating_hosts": 1,
                                 "lease_s": LEASE_S, "poll_s": 0.5, **fleet}})  # fmt: skip
    d.watch_dir.mkdir(parents=True)
    reset_worker(w, publish_into(d.watch_dir, "v0", seed=0), "v0")  # its own copy of v0
    w.wait_running(240, version="v0")
    return d


def aliases_of(url: str, host: str) -> dict[str, str | None]:
    reg = Registry(url, host)
    try:
        j = Journal(reg)
        return {n: (a.version if (a := j.alias(n)) else None) for n in ("serving", "last_good")}
    finally:
        reg.close()
