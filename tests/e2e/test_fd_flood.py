"""A flood on one port cannot take the control plane down (issue 22, finding 1), with real processes.

The daemon runs with 1024 file descriptors (systemd's default soft limit), a push source and one
managed worker. 2,000 idle TCP connections to the push listener (and then to the control API)
used to exhaust them: the API stopped answering, the healthy worker was taken for dead and the
log grew by 47 MB in seconds. Now each listener caps what it holds (daemon.common.httpguard).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
from conftest import DaemonProcess, make_config_file, wait_until
from support_rollout import worker_row

FLOOD = 2000


def _flood(port: int, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        out.append(s)
    return out


def test_idle_connections_to_the_push_listener_leave_the_api_and_the_worker_alone(tmp_path: Path) -> None:
    watch, state = tmp_path / "checkpoints", tmp_path / "state"
    (tmp_path / "token").write_text("x" * 43 + "\n")
    (tmp_path / "token").chmod(0o600)
    key = tmp_path / "hmac.key"
    key.write_bytes(os.urandom(32).hex().encode())
    cfg = make_config_file(
        tmp_path / "config.toml",
        daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "keep_workers_on_stop": False},
        sources=[{"path": str(watch)},
                 {"type": "push", "name": "push", "path": str(tmp_path / "pushed"), "token_file": str(tmp_path / "token"),
                  "listen": "127.0.0.1:0", "hmac_keys": {"trainer": str(key)}}],
        checks={"enabled": ["manifest", "headers", "crc32c"], "hmac_keys": {"trainer": str(key)}},
        rollout={"health_poll_s": 0.5},
        workers=[{"name": "local", "launch": "managed", "device": "cpu"}],
    )  # fmt: skip
    d = DaemonProcess(tmp_path, cfg, f"sqlite:///{state / 'hotswap.db'}", watch, state, {})
    sockets: list[socket.socket] = []
    try:
        d.start(timeout=90)
        wait_until(lambda: worker_row(d.registry, "local")["state"] == "RUNNING", 240, what="the managed worker RUNNING")
        subprocess.run(["prlimit", f"--pid={d.pid}", "--nofile=1024:1024"], check=True)
        [push] = [s for s in d.get("/status").json()["sources"] if s["name"] == "push"]
        push_port = int(push["url"].rsplit(":", 1)[1].split("/")[0])
        api_port = int(d.api_url.rsplit(":", 1)[1])
        log_before = d._log_path.stat().st_size if d._log_path.exists() else 0
        worst = 0.0
        for port in (push_port, api_port):
            sockets += _flood(port, FLOOD)
            deadline = time.monotonic() + 8  # longer than the header timeout: the flood churns meanwhile
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                r = httpx.get(d.api_url + "/health", timeout=10)
                worst = max(worst, time.monotonic() - t0)
                assert r.status_code == 200, r.text  # the worker is serving and nothing else is wrong
                time.sleep(0.1)
            for s in sockets:
                s.close()
            sockets = []
        assert worker_row(d.registry, "local")["state"] == "RUNNING"
        growth = (d._log_path.stat().st_size if d._log_path.exists() else 0) - log_before
        assert growth < 1 << 20, f"the log grew by {growth} bytes"
        assert "Too many open files" not in d.log()
        print(f"\nworst /health during the floods: {worst * 1000:.1f} ms")
    finally:
        for s in sockets:
            s.close()
        d.close()
        with contextlib.suppress(OSError, ValueError, IndexError):
            os.kill(int((state / "worker-local.json").read_text().split('"pid": ')[1].split(",")[0]), signal.SIGKILL)
