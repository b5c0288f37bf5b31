"""A check that runs past `checks.check_time_limit_s` fails naming the limit, and the daemon does not
stop meanwhile (issue 37, "no checkpoint content runs unbounded in the daemon"), with real
processes: a daemon, its managed worker serving a tiny model, checkpoints dropped into the folder.

The checkpoint's one shard has a header of 400,000 tensors: parsing it takes seconds (held by the
checkpoint, not by its size on disk). The headers check runs in the daemon's check process
(daemon.checks.isolation), which is killed at the 1 s limit: the version is rejected with a reason
naming the limit, `/livez` answers within 1 s throughout, the worker keeps serving the version it
had, and the next checkpoint is verified (in a fresh check process) and deployed.
"""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import httpx
import pytest
from conftest import DaemonProcess, publish_tiny, wait_until
from support_engines import publish_ckpt
from support_managed import close_managed, managed_daemon

from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(600)
PADDING = 400_000  # tensors in the slow header: ~3 s to parse on a laptop core, far past the limit
LIMIT_S = 1.0


def _slow_header(directory: Path) -> Path:
    """A tiny checkpoint whose shard is replaced by one of PADDING one-float tensors."""
    make_tiny_checkpoint(directory, seed=5)
    header = {f"pad.{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(PADDING)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + bytes(4 * PADDING))
    return directory


def _worker_url(d: DaemonProcess) -> str:
    return f"http://127.0.0.1:{json.loads((d.state_dir / 'worker-local.json').read_text())['port']}"


def test_a_check_past_its_time_limit_fails_naming_it_while_livez_and_the_worker_answer(tmp_path: Path) -> None:
    started: list[DaemonProcess] = []
    stop = threading.Event()
    slow: list[str] = []
    probes: list[float] = []

    def probe(url: str) -> None:  # no assert in a thread: failures are collected and asserted below
        while not stop.wait(0.1):
            try:
                r = httpx.get(url + "/livez", timeout=1.0)
                r.raise_for_status()
                probes.append(r.elapsed.total_seconds())
            except httpx.HTTPError as exc:
                slow.append(f"{type(exc).__name__}: {exc}")

    try:
        publish_tiny(tmp_path / "checkpoints" / "v1", seed=1)
        d = managed_daemon(tmp_path, started, checks={"enabled": ["manifest", "headers", "crc32c", "compat"],
                                                      "check_time_limit_s": LIMIT_S})  # fmt: skip
        d.wait_status("v1", "deployed", timeout=300)
        wait_until(lambda: d.get("/health").status_code == 200, 120, 0.2, "v1 serving")
        assert d.api_url
        t = threading.Thread(target=probe, args=(d.api_url,), daemon=True)
        t.start()
        publish_ckpt(d.watch_dir, "slow-header", _slow_header)
        row = d.wait_status("slow-header", ("rejected", "verified", "deployed"), timeout=300)
        with httpx.Client(base_url=_worker_url(d), timeout=30) as c:  # the serving version keeps serving
            r = c.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["weight_version"] == "v1", r.text
        stop.set()
        t.join(10)
        assert row["status"] == "rejected", row
        assert "headers check ran past its time limit of 1 s (checks.check_time_limit_s)" in row["status_message"], row
        assert not slow, f"/livez did not answer within 1 s: {slow[:3]}"
        assert probes, "no /livez sample was taken while the check ran"
        assert d.get("/health").status_code == 200
        publish_tiny(d.watch_dir / "v2", seed=2)  # the next check process verifies it
        d.wait_status("v2", "deployed", timeout=300)
    finally:
        stop.set()
        for p in started:
            close_managed(p)
