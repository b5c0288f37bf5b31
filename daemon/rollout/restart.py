"""Restarting a worker that cannot be restored over its admin API.

External workers get their configured `restart_command` (e.g. `systemctl restart
hotswap-worker@0`), run without a shell, with placeholders filled in per argument.
Managed workers are relaunched by the daemon on the fallback checkpoint.
"""

from __future__ import annotations

import os
import subprocess
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from daemon.logging import get_logger

if TYPE_CHECKING:
    from daemon.rollout.fleet import WorkerHandle
    from daemon.rollout.journal import CheckpointRef

log = get_logger(__name__)

COMMAND_TIMEOUT_S = 120.0
OUTPUT_TAIL = 2000


class _Placeholders(dict[str, str]):
    def __missing__(self, key: str) -> str:
        raise KeyError(key)


def fill(argv: list[str], values: dict[str, str]) -> list[str]:
    ph = _Placeholders(values)
    return [arg.format_map(ph) for arg in argv]


class Restarter:
    def restart(self, h: WorkerHandle, fallback: CheckpointRef | None) -> dict[str, Any]:
        """Issue the restart; returns what was done for the event's detail (`issued`: bool)."""
        if h.managed is not None:
            path = fallback.local_path if fallback else None
            version = fallback.version if fallback else None
            try:
                pid = h.managed.relaunch(path, version)
            except Exception as exc:  # noqa: BLE001 - recorded in the event
                return {"issued": False, "how": "managed relaunch", "error": str(exc)}
            return {"issued": True, "how": "managed relaunch", "pid": pid, "version": version}
        argv = h.spec.restart_argv()
        if not argv:
            return {"issued": False, "how": "none", "error": "no restart_command configured"}
        parts = urlsplit(h.url)
        values = {
            "name": h.name,
            "url": h.url,
            "port": str(parts.port or ""),
            "device": h.spec.device,
            "version": fallback.version if fallback else "",
            "path": (fallback.local_path or "") if fallback else "",
            "token_file": h.spec.token_file,
        }
        try:
            cmd = fill(argv, values)
        except KeyError as exc:
            return {"issued": False, "how": "command", "error": f"unknown placeholder {exc}"}
        log.warning("restart_command", worker=h.name, argv=cmd)
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
                env=os.environ.copy(),
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"issued": False, "how": "command", "argv": cmd, "error": str(exc)}
        out = (done.stdout + done.stderr)[-OUTPUT_TAIL:]
        if done.returncode != 0:
            log.warning("restart_command_failed", worker=h.name, rc=done.returncode, output=out)
        # A non-zero exit is recorded, but the worker may still come back: we wait for it anyway.
        return {"issued": True, "how": "command", "argv": cmd, "rc": done.returncode, "output": out}
