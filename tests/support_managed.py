"""A daemon with one managed reference worker (`launch = "managed"`), as the quickstart runs it.

    d = managed_daemon(tmp_path, started, rollout={...}, sources=[...], **worker_keys)

`started` collects the daemons for the caller's fixture to close with `close_managed(d)`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

from conftest import DaemonProcess, make_config_file

FEW_CHECKS = {"enabled": ["manifest", "headers", "crc32c"]}


def managed_daemon(tmp_path: Path, started: list[DaemonProcess], rollout: dict[str, Any] | None = None,
                   sources: list[dict[str, Any]] | None = None, checks: dict[str, Any] | None = None,
                   **worker: Any) -> DaemonProcess:  # fmt: skip
    state, watch = tmp_path / "state", tmp_path / "checkpoints"
    watch.mkdir(exist_ok=True)
    cfg = make_config_file(
        tmp_path / "config.toml",
        daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "keep_workers_on_stop": False},
        sources=sources or [{"path": str(watch)}],
        checks=checks or FEW_CHECKS,
        rollout={"health_window_s": 0.3, "health_poll_s": 0.5, "relaunch_backoff_s": 1.0, **(rollout or {})},
        workers=[{"name": "local", "launch": "managed", "device": "cpu", **worker}],
    )
    d = DaemonProcess(tmp_path, cfg, f"sqlite:///{state / 'hotswap.db'}", watch, state, {})
    started.append(d)
    return d.start(timeout=90)


def close_managed(d: DaemonProcess) -> None:
    """SIGKILL the daemon and the managed workers it launched. A SIGKILLed daemon cannot stop its
    workers (they outlive it on purpose, for the next daemon to adopt), so each is killed from the
    pid in its `<state_dir>/worker-NAME.json`, if that pid is still a `hotswap worker`."""
    d.close()
    for runtime in d.state_dir.glob("worker-*.json"):
        if runtime.name.endswith(".expect.json"):
            continue
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            pid = int(json.loads(runtime.read_text())["pid"])
            if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                os.kill(pid, signal.SIGKILL)
