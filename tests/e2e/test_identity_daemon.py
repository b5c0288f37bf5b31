"""Worker identity, daemon side (issue 10, finding 4), with a real daemon, real workers and a real
port squatter process: the token never reaches a peer that cannot prove the launch secret, a
squatted port never shows as a RUNNING worker, and a worker whose report (path, digest) differs
from the registry goes UNCERTAIN, is alerted on, and is brought back to the registry's version."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import DaemonProcess, make_config_file, wait_until
from support_rollout import REPO, WorkerPool, build_checkpoint, start_fleet, worker_events, worker_row
from support_wait import free_port

pytestmark = pytest.mark.timeout(600)


@contextlib.contextmanager
def squatter(port: int, log: Path, free_the_port: Callable[[], None] | None = None) -> Iterator[subprocess.Popen[str]]:
    """A squatter on `port`. With `free_the_port` (e.g. SIGKILL its worker), the squatter starts
    first and binds the moment the port is free: ahead of the daemon's relaunch, as a squatter
    lying in wait would be (a fresh interpreter started after the kill can lose that race)."""
    armed = ["--armed"] if free_the_port is not None else []
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "support_squatter.py"), str(port), str(log), *armed],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        if free_the_port is not None:
            line = proc.stdout.readline()
            assert line.startswith("armed"), line + proc.stdout.read()
            free_the_port()
            proc.stdin.write("go\n")
            proc.stdin.flush()
        line = proc.stdout.readline()
        assert line.startswith("squatting"), line + proc.stdout.read()
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def seen_by(log: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def assert_no_secret(requests: list[dict[str, Any]], secrets: list[str]) -> None:
    for r in requests:
        assert not any(k.lower() == "authorization" for k in r["headers"]), r
        text = json.dumps(r)
        assert not any(s in text for s in secrets), r


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path_factory.mktemp("pool"), n=1)
    yield p
    p.close()


def _admin(w: Any, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    r = httpx.post(f"{w.url}{path}", json=body or {}, headers={"Authorization": f"Bearer {w.token}"}, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _hijack(w: Any, model: Path, version: str) -> None:
    """What another holder of the token did in finding 4: its own weights under the real label."""
    _admin(w, "/admin/pause", {"mode": "keep"})
    _admin(w, "/admin/update", {"version": version, "transport": "disk", "path": str(model)})
    _admin(w, "/admin/resume")


def test_tcp_worker_drift_goes_uncertain_and_a_squatter_never_gets_the_token(
    tmp_path: Path, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    # no restart_command: the daemon cannot bring the crashed worker back onto its port itself,
    # so the squatter below surely gets it
    d = start_fleet(daemon_factory, f"sqlite:///{tmp_path / 'registry.db'}", pool,
                    rollout={"health_window_s": 0.3, "health_poll_s": 0.3}, worker_extra={"restart_command": ""})  # fmt: skip
    (w,) = pool.workers
    v0_path = str((d.watch_dir / "v0").resolve())
    assert w.info()["path"] == str(d.watch_dir / "v0")

    # 1. the same bytes from another directory, under the real label and digest: path drift
    copy = shutil.copytree(d.watch_dir / "v0", tmp_path / "elsewhere" / "v0")
    _hijack(w, copy, "v0")
    drift = wait_until(lambda: [e for e in worker_events(d.registry) if e["to"] == "UNCERTAIN"], 60, what="UNCERTAIN")
    assert drift[0]["from"] == "RUNNING" and drift[0]["detail"]["action"] == "drift"
    assert f"serves v0 from {copy}" in drift[0]["detail"]["drift"] and drift[0]["detail"]["alert"] is True
    # ... then the daemon re-installs the registry's v0 (from the registry's directory)
    wait_until(lambda: os.path.realpath(w.info()["path"]) == v0_path and w.info()["state"] == "RUNNING", 120,
               what="the registry's v0 re-installed")  # fmt: skip
    back = wait_until(lambda: [e for e in worker_events(d.registry) if e["from"] == "UNCERTAIN"], 30, what="restored")
    assert back[0]["to"] == "RUNNING" and back[0]["detail"]["action"] == "restored"
    wait_until(lambda: worker_row(d.registry, w.name)["state"] == "RUNNING", 30, what="row RUNNING")

    # 2. other weights under the real label: digest drift
    other = build_checkpoint(tmp_path / "other" / "v0", "v0", seed=9)
    n_before = len([e for e in worker_events(d.registry) if e["to"] == "UNCERTAIN"])
    _hijack(w, other, "v0")
    drift = wait_until(lambda: [e for e in worker_events(d.registry) if e["to"] == "UNCERTAIN"][n_before:], 60,
                       what="UNCERTAIN again")  # fmt: skip
    assert "reports digest" in drift[0]["detail"]["drift"], drift[0]
    wait_until(lambda: os.path.realpath(w.info()["path"]) == v0_path, 120, what="v0 re-installed again")
    wait_until(lambda: worker_row(d.registry, w.name)["state"] == "RUNNING", 30, what="row RUNNING again")

    # 3. the worker crashes and another process takes its port
    log = tmp_path / "squatter.jsonl"
    with squatter(w.port, log, w.kill):  # binds as soon as the killed worker's socket is gone
        wait_until(lambda: len(seen_by(log)) >= 6, 60, what="the daemon to poll the squatter")
        row = wait_until(lambda: (r := worker_row(d.registry, w.name))["state"] == "UNREACHABLE" and r, 30,
                         what="the row to say UNREACHABLE")  # fmt: skip
        assert "failed the identity check" in (row["last_error"] or ""), row
        for _ in range(3):  # it stays so, poll after poll
            n = len(seen_by(log))
            wait_until(lambda n=n: len(seen_by(log)) > n + 1, 30, what="more polls")
            assert worker_row(d.registry, w.name)["state"] != "RUNNING"
        requests = seen_by(log)
    assert {r["path"] for r in requests} <= {"/admin/identify", "/health", "/ready"}, requests
    assert_no_secret(requests, [w.token])


def _squatter_cmd(port: int, log: Path) -> list[str]:
    """Another local user's squatter: `nobody`, when this test runs as root (as CI does)."""
    script = [str(REPO / "tests" / "support_squatter.py"), str(port), str(log), "--armed"]
    if os.geteuid() == 0 and shutil.which("runuser"):
        return ["runuser", "-u", "nobody", "--", "/usr/bin/python3", *script]
    return [sys.executable, *script]


def test_the_serving_port_is_never_free_while_the_daemon_manages_its_worker(tmp_path: Path) -> None:
    """The daemon binds the managed worker's serving port once and hands the listening socket to
    every child it launches: a squatter of another user, lying in wait and binding the moment the
    worker dies, never gets the port; clients that connect meanwhile are answered by the relaunch."""
    watch, state = tmp_path / "checkpoints", tmp_path / "state"
    cfg = make_config_file(
        tmp_path / "config.toml",
        daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "log_level": "debug"},
        sources=[{"path": str(watch)}],
        rollout={"health_window_s": 0.3, "health_poll_s": 0.3, "relaunch_backoff_s": 0.2},
        workers=[{"name": "local", "launch": "managed", "device": "cpu"}],
    )
    d = DaemonProcess(tmp_path, cfg, f"sqlite:///{state / 'hotswap.db'}", watch, state, {})
    runtime_file = state / "worker-local.json"
    spool = tmp_path / "spool"
    spool.mkdir()
    spool.chmod(0o777)  # where the other user's squatter may write what it saw
    try:
        d.start(timeout=90)
        wait_until(lambda: worker_row(d.registry, "local")["state"] == "RUNNING", 240, what="the managed worker RUNNING")
        runtime = json.loads(runtime_file.read_text())
        port, first_pid = runtime["port"], runtime["pid"]
        log = spool / "squatter.jsonl"
        proc = subprocess.Popen(_squatter_cmd(port, log), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline()
            assert line.startswith("armed"), line + proc.stdout.read()
            os.kill(first_pid, signal.SIGKILL)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out = proc.stdout.read()  # it retries its bind for 5 s, then gives up
            assert proc.wait(30) != 0 and "squatting" not in out and "Address already in use" in out, out
        finally:
            proc.kill()
        # a client connecting while the worker is gone waits in the port's backlog for the relaunch
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=120)
        assert r.status_code == 200 and r.json()["data"], r.text
        wait_until(lambda: worker_row(d.registry, "local")["state"] == "RUNNING", 240, what="RUNNING again")
        again = json.loads(runtime_file.read_text())
        assert again["port"] == port and again["pid"] != first_pid
        assert seen_by(log) == []
        assert d.stop() == 0
    finally:
        d.close()
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            os.kill(json.loads(runtime_file.read_text())["pid"], signal.SIGKILL)


def test_a_managed_worker_whose_port_is_taken_before_launch_is_not_launched_and_says_so(tmp_path: Path) -> None:
    """A `port` already held by another process when the daemon starts: the worker is never
    launched there, is never shown RUNNING, and the daemon never speaks to the squatter."""
    watch, state = tmp_path / "checkpoints", tmp_path / "state"
    log = tmp_path / "squatter.jsonl"
    port = free_port()
    with squatter(port, log):
        cfg = make_config_file(
            tmp_path / "config.toml",
            daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "log_level": "debug"},
            sources=[{"path": str(watch)}],
            rollout={"health_window_s": 0.3, "health_poll_s": 0.3},
            workers=[{"name": "local", "launch": "managed", "device": "cpu", "port": port}],
        )
        d = DaemonProcess(tmp_path, cfg, f"sqlite:///{state / 'hotswap.db'}", watch, state, {})
        try:
            d.start(timeout=90)
            row = wait_until(lambda: "held by another process" in ((r := worker_row(d.registry, "local"))["last_error"]
                                                                   or "") and r, 60, what="the taken port reported")  # fmt: skip
            assert row["state"] != "RUNNING"
            health = d.get("/health")
            assert health.status_code == 503 and "held by another process" in health.json()["error"], health.text
            assert seen_by(log) == []  # the daemon never speaks to a managed worker's TCP port
        finally:
            d.close()
