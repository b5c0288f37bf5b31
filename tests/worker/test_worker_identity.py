"""Worker identity (issue 10, finding 4), worker side, with real worker processes: the admin API
on a private Unix socket (--admin-uds), nothing admin on the TCP port then, and the identity
proof (POST /admin/identify) that lets the daemon check a TCP peer before it sends the token."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support_worker import DEVICE, REPO, TOKEN, WorkerProcess, start_worker, write_token

from daemon.common.identity import new_nonce, proof
from daemon.tinymodel import make_tiny_checkpoint


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("ident")
    make_tiny_checkpoint(r / "m", seed=3, tokenizer=True)
    write_token(r)
    return r


def _short_private_dir(root: Path, name: str) -> Path:
    # sun_path is 108 bytes: a pytest tmp path can be longer, so the sockets go in /tmp
    d = Path("/tmp") / f"hs-ident-{os.getpid()}-{name}"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture(scope="module")
def uw(root: Path) -> Iterator[tuple[WorkerProcess, Path]]:
    d = _short_private_dir(root, "a")
    sock = d / "w.sock"
    proc = start_worker(root / "m", root / "token", extra=["--admin-uds", str(sock)])
    yield proc, sock
    proc.stop()
    sock.unlink(missing_ok=True)
    d.rmdir()


def _uds(sock: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://w", timeout=30)


def test_admin_api_is_on_a_private_socket_and_not_on_tcp(uw: tuple[WorkerProcess, Path]) -> None:
    w, sock = uw
    assert f"admin=unix:{sock}" in w.lines[-1]
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    with _uds(sock) as c:
        info = c.get("/weight_info", headers=w.auth())
        assert info.status_code == 200, info.text
        assert info.json()["state"] == "RUNNING"
        assert c.get("/weight_info").status_code == 401
        assert c.get("/health").status_code == 200
        assert c.post("/admin/pause", json={"mode": "keep"}, headers=w.auth()).json()["state"] == "PAUSED"
        assert c.post("/admin/resume", headers=w.auth()).json()["state"] == "RUNNING"
    # the TCP port serves and answers /health, but has no admin route at all, token or not
    assert w.get("/health").status_code == 200
    assert w.get("/weight_info", headers=w.auth()).status_code == 404
    for route in ("update", "drain", "pause", "identify"):
        assert w.post(f"/admin/{route}", {}, admin=True).status_code == 404
    assert w.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}).status_code == 200


def test_identify_proves_the_secret_without_revealing_it(uw: tuple[WorkerProcess, Path]) -> None:
    w, sock = uw
    nonce = new_nonce()
    with _uds(sock) as c:
        r = c.post("/admin/identify", json={"nonce": nonce})
        assert r.status_code == 200
        assert r.json() == {"proof": proof(TOKEN.encode(), nonce)}
        assert TOKEN not in r.text
        assert r.json()["proof"] != proof(b"another secret", nonce)
        for bad in ("", "zz" * 20, "ab", "A" * 64, 12, None):
            assert c.post("/admin/identify", json={"nonce": bad}).status_code == 400, bad
        assert c.post("/admin/identify", content=b"[1, 2").status_code == 400


def test_tcp_worker_answers_identify_on_its_port(root: Path) -> None:
    w = start_worker(root / "m", root / "token")
    try:
        nonce = new_nonce()
        r = w.post("/admin/identify", {"nonce": nonce})
        assert r.status_code == 200 and r.json()["proof"] == proof(TOKEN.encode(), nonce)
        assert w.get("/weight_info", headers=w.auth()).status_code == 200  # admin stays on TCP without --admin-uds
    finally:
        w.stop()


@pytest.mark.parametrize("mode", [0o755, 0o770])
def test_admin_socket_in_a_directory_others_can_enter_is_refused(root: Path, mode: int) -> None:
    d = _short_private_dir(root, f"open{mode:o}")
    try:
        d.chmod(mode)
        cmd = [sys.executable, "-m", "daemon.worker.server", "--model", str(root / "m"), "--port", "0",
               "--device", DEVICE, "--token-file", str(root / "token"), "--admin-uds", str(d / "w.sock")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(REPO),
                              env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        assert done.returncode == 2, done.stderr[-2000:]
        assert f"mode {mode:o} lets other users in" in done.stderr
        assert not (d / "w.sock").exists()
    finally:
        d.rmdir()


def test_something_else_at_the_socket_path_is_not_replaced(root: Path) -> None:
    d = _short_private_dir(root, "file")
    target = d / "w.sock"
    target.write_text("not a socket")
    try:
        cmd = [sys.executable, "-m", "daemon.worker.server", "--model", str(root / "m"), "--port", "0",
               "--device", DEVICE, "--token-file", str(root / "token"), "--admin-uds", str(target)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(REPO),
                              env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        assert done.returncode == 2 and "exists and is not a socket" in done.stderr, done.stderr[-2000:]
        assert target.read_text() == "not a socket"
    finally:
        target.unlink()
        d.rmdir()


def test_private_admin_socket_answers_while_hostile_clients_hit_the_serving_port(root: Path) -> None:
    """The admin server has its own thread and event loop: while a 100 MB body, a 100 MB chunked
    body, a 10 MB prompt and 200 concurrent completions hit the TCP port, every /health and
    /weight_info on the socket is answered (200), and each hostile request is refused properly.
    Behaviour only; the latency figures are bench/admin_latency.py's (bench/RESULTS.md)."""
    import json
    import threading
    import time

    d = _short_private_dir(root, "load")
    sock = d / "w.sock"
    w = start_worker(root / "m", root / "token", extra=["--admin-uds", str(sock), "--max-body-bytes", str(16 << 20)])
    answers: list[int] = []
    stop = threading.Event()

    def poll() -> None:
        with _uds(sock) as c:
            while not stop.is_set():
                answers.append(c.get("/health").status_code)
                answers.append(c.get("/weight_info", headers=w.auth()).status_code)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    try:
        poller.start()
        load = subprocess.run([sys.executable, str(REPO / "tests" / "support_hostile.py"), w.url, "200"],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        stop.set()
        poller.join(60)
        assert load.returncode == 0, load.stderr[-2000:]
        result = json.loads(load.stdout.strip().splitlines()[-1])
        assert result["body_100mb"] == "413" or result["body_100mb"].startswith("closed:"), result
        assert result["chunked_100mb"] == "413" or result["chunked_100mb"].startswith("closed:"), result
        assert result["prompt_10mb"] == "400:context_length_exceeded", result
        assert set(result["concurrent"]) <= {"200", "429"} and result["concurrent"].get("200", 0) >= 8, result
        assert len(answers) >= 20 and set(answers) == {200}, answers[:50]
        assert w.post("/v1/completions", {"prompt": "still serving", "max_tokens": 2}).status_code == 200
    finally:
        stop.set()
        w.stop()
        sock.unlink(missing_ok=True)
        d.rmdir()
