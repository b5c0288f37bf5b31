"""A slow-body flood on a real worker's serving port (issue 37, item 1), with real processes: a
daemon, its managed reference worker, 1,100 connections from five loopback addresses each sending
a complete `POST /v1/completions` header and then one body byte every 2 s.

They used to hold all 1,024 slots of the serving listener for as long as they liked: no request
was answered, and the daemon's `/health` said ok (it polled the admin socket only). Now the
daemon probes the serving port as a client does, so while the flood holds every slot its
`/health` is red; once the bodies are late (the header timeout plus their length at the minimum
rate) a well-behaved client takes a late one's slot, the worker's `/ready` answers on that port,
and `/health` is green again, all while the flood is still open and trickling.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from pathlib import Path

import httpx
import pytest
from conftest import DaemonProcess, wait_until
from support_managed import close_managed, managed_daemon
from support_rollout import wait_passes, worker_row

pytestmark = pytest.mark.timeout(600)

FLOOD = 1100
SOURCES = [f"127.0.0.{i}" for i in range(2, 7)]  # 220 each: under the per-address cap (256), over the listener's 1,024
BODY = 200_000  # due 5 s + 200,000 / 32 KiB/s = about 11 s after each connection opened
HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n{") % BODY  # fmt: skip


def _flood(port: int) -> list[socket.socket]:
    out = []
    for i in range(FLOOD):
        s = socket.socket()
        s.bind((SOURCES[i % len(SOURCES)], 0))
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(HEAD)
        except OSError:  # refused at once: over a cap
            s.close()
            continue
        out.append(s)
    return out


def _trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    while not stop.wait(2.0):
        for s in socks:
            with contextlib.suppress(OSError):
                s.send(b" ")


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=3).status_code
    except httpx.HTTPError:
        return 0


def test_a_slow_body_flood_turns_health_red_then_yields_to_a_real_client(tmp_path: Path) -> None:
    started: list[DaemonProcess] = []
    stop = threading.Event()
    flood: list[socket.socket] = []
    try:
        d = managed_daemon(tmp_path, started, rollout={"request_timeout_s": 2.0})
        d.wait_status("tiny-seed", "deployed", timeout=120)
        wait_until(lambda: worker_row(d.registry, "local")["state"] == "RUNNING", 240, what="the worker RUNNING")
        wait_until(lambda: d.get("/health").status_code == 200, 60, what="/health green")
        wait_passes(d, "health_poll", 2)
        port = json.loads((d.state_dir / "worker-local.json").read_text())["port"]
        serving = f"http://127.0.0.1:{port}"

        flood = _flood(port)
        assert len(flood) > 1024 - 10, f"only {len(flood)} flood connections opened"
        threading.Thread(target=_trickle, args=(flood, stop), daemon=True).start()

        # every slot held: the daemon sees the port as its clients do
        wait_until(lambda: d.get("/health").status_code == 503, 30, what="/health red during the flood", interval=0.1)
        row = worker_row(d.registry, "local")
        assert row["state"] == "UNREACHABLE" and "serving port" in str(row), row

        # the bodies are late: a client that sends its request at once gets in, the flood still open
        def completes() -> bool:
            try:
                r = httpx.post(serving + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and "weight_version" in r.text

        wait_until(completes, 60, what="a well-behaved completion answered during the flood", interval=0.2)
        wait_until(lambda: _get(serving + "/ready") == 200, 30, what="the worker's /ready on its serving port")
        wait_until(lambda: d.get("/health").status_code == 200, 30, what="/health green again", interval=0.1)
        still_open = 0
        for s in flood:
            s.settimeout(0.001)
            try:
                still_open += s.recv(1) != b""
            except TimeoutError:
                still_open += 1
            except OSError:
                pass
        assert still_open > 500, f"only {still_open} flood connections still open: the flood is over, not survived"
    finally:
        stop.set()
        for s in flood:
            s.close()
        for d in started:
            close_managed(d)
