"""The daemon's control API against a real daemon process: token, Origin, Host, bodies, pin --force.

The daemon runs with one external worker whose port nothing listens on: the rollout routes are
mounted and answer, and no request that gets past the guard can change a real fleet. Every
refused request is also checked not to have changed anything (nothing pinned, no rollout).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import DaemonProcess, hotswap_cli, make_config_file, wait_until
from support_wait import free_port

from daemon.registry import status as st
from daemon.registry.models import CheckpointStatus as C

pytestmark = pytest.mark.timeout(300)

ROUTES = ["/v1/rollout/rollback", "/v1/rollout/pin", "/v1/rollout/unpin", "/v1/checkpoints/reverify"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for the module (each start costs seconds of a shared CPU)."""
    root = tmp_path_factory.mktemp("control")
    token = root / "worker.token"
    token.write_text("worker-secret\n")
    token.chmod(0o600)
    worker = {"name": "w0", "url": f"http://127.0.0.1:{free_port()}", "token_file": str(token)}
    db_url = f"sqlite:///{root / 'registry.db'}"
    cfg = make_config_file(
        root / "config.toml",
        daemon={"state_dir": str(root / "state"), "listen": "127.0.0.1:0", "log_level": "debug"},
        database={"url": db_url},
        sources=[{"path": str(root / "checkpoints"), "rescan_interval_s": 5.0}],
        workers=[worker],
    )
    d = DaemonProcess(root, cfg, db_url, root / "checkpoints", root / "state", {})
    try:
        d.start()
        wait_until(lambda: d.get("/v1/rollout").json().get("ready"), 120, 0.2, "the rollout service to be ready")
        yield d
    finally:
        d.close()


def token_of(d: DaemonProcess) -> str:
    return (d.state_dir / "control.token").read_text().strip()


def write_private(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)


def post(d: DaemonProcess, path: str, **kw: Any) -> httpx.Response:
    assert d.api_url
    return httpx.post(d.api_url + path, timeout=30, **kw)


def add_rejected(d: DaemonProcess, version: str, directory: Path) -> None:
    """A version whose checks passed and whose rollout failed: what a failed deploy leaves."""
    directory.mkdir()
    with d.registry.session() as s, s.begin():
        ckpt = st.create(s, version=version, source="test", uri=f"file://{directory}",
                         local_path=str(directory), commit_signal="manifest")  # fmt: skip
        assert ckpt is not None
        st.move(s, ckpt, C.VERIFYING)
        st.move(s, ckpt, C.VERIFIED)
        st.move(s, ckpt, C.REJECTED, "rollout 7 failed: health window 3 of 3 requests failed")


@pytest.mark.parametrize("route", ROUTES)
def test_control_routes_refuse_without_the_token(daemon: DaemonProcess, route: str) -> None:
    good = {"Authorization": f"Bearer {token_of(daemon)}"}
    body = {"version": "v0"} if route.endswith(("/pin", "/reverify")) else {}
    none = post(daemon, route, json=body)
    assert none.status_code == 401 and none.headers["www-authenticate"] == "Bearer"
    assert "control token" in none.json()["error"]
    assert post(daemon, route, json=body, headers={"Authorization": "Bearer " + "x" * 43}).status_code == 401
    assert post(daemon, route, json=body, headers={"Authorization": token_of(daemon)}).status_code == 401
    # a web page's CORS "simple request" (text/plain, no preflight), with or without the token
    simple = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    assert post(daemon, route, content=b'{"to": null}', headers=simple).status_code == 403
    assert post(daemon, route, content=b"{}", headers={**simple, **good}).status_code == 403
    # DNS rebinding: the right token, a Host that is not loopback
    rebound = post(daemon, route, json=body, headers={**good, "Host": "evil.example:8780"})
    assert rebound.status_code == 403 and "loopback" in rebound.json()["error"]
    # nothing happened: no rollout, nothing pinned
    doc = daemon.get("/v1/rollout").json()
    assert doc["pinned"] is None and doc["current"] is None and doc["window"] is None
    from support_rollout import rollouts

    assert rollouts(daemon.registry) == []
    # read-only routes stay open; /health answers truthfully (its one worker was never started:
    # a host that does not serve is never green)
    assert daemon.get("/status").status_code == 200 and daemon.get("/status").json()["daemon"]["window"] is None
    health = daemon.get("/health")
    assert health.status_code == 503 and health.json()["problems"][0]["kind"] == "no_worker_serving", health.text


def test_an_unauthenticated_body_is_never_parsed(daemon: DaemonProcess) -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    assert post(daemon, "/v1/rollout/pin", content=deep).status_code == 401


def test_bad_bodies_are_4xx_never_500(daemon: DaemonProcess) -> None:
    good = {"Authorization": f"Bearer {token_of(daemon)}"}
    cases: list[tuple[bytes, int, str]] = [
        (b"[" * 30_000 + b"]" * 30_000, 400, "nested deeper"),  # RecursionError inside json
        (b'{"version": ' + b"[" * 500 + b"]" * 500 + b"}", 400, "nested deeper"),  # parses, too deep
        (b'{"version": "v0"', 400, "not valid JSON"),
        (b'{"version": NaN}', 400, "not valid JSON"),
        (b"\xff\xfe", 400, "not UTF-8"),
        (b'["v0"]', 400, "JSON object"),
        (b'{"version": "v0", "wait_s": "soon"}', 422, "wait_s"),
        (b'{"version": "v0", "force": "yes"}', 422, "force"),
        (b'{"version": 7}', 422, "version"),
        (b'{"version": "v0", "pad": "' + b"x" * 70_000 + b'"}', 413, "limit"),
    ]
    for raw, status, words in cases:
        r = post(daemon, "/v1/rollout/pin", content=raw, headers={**good, "Content-Type": "application/json"})
        assert r.status_code == status, (raw[:40], r.status_code, r.text[:200])
        assert words in r.json()["error"], r.text[:200]
    reverify = post(daemon, "/v1/checkpoints/reverify", content=b"[" * 30_000, headers=good)
    assert reverify.status_code == 400 and "nested deeper" in reverify.json()["error"]
    assert daemon.alive()


def test_the_cli_sends_the_token_and_says_why_when_it_cannot(daemon: DaemonProcess) -> None:
    cfg = str(daemon.config_path)
    out = hotswap_cli("unpin", "-c", cfg)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "unpinned (was not pinned) [as control-token]"

    path = daemon.state_dir / "control.token"
    token = path.read_text()
    path.unlink()
    missing = hotswap_cli("unpin", "-c", cfg)
    assert missing.returncode == 1
    (line,) = missing.stderr.strip().splitlines()
    assert "cannot send a token" in line and str(path) in line and "does not exist" in line

    write_private(path, "not-the-token\n")
    wrong = hotswap_cli("unpin", "-c", cfg)
    (line,) = wrong.stderr.strip().splitlines()
    assert wrong.returncode == 1 and "refused the request" in line and "control token" in line

    write_private(path, token)
    assert hotswap_cli("unpin", "-c", cfg).returncode == 0


def test_pin_refuses_a_rejected_version_unless_forced(daemon: DaemonProcess, tmp_path: Path) -> None:
    add_rejected(daemon, "bad", tmp_path / "bad")
    good = {"Authorization": f"Bearer {token_of(daemon)}"}
    r = post(daemon, "/v1/rollout/pin", json={"version": "bad"}, headers=good)
    assert r.status_code == 409 and "'bad' was rejected" in r.json()["error"] and "--force" in r.json()["error"]
    assert daemon.get("/v1/rollout").json()["pinned"] is None

    cfg = str(daemon.config_path)
    refused = hotswap_cli("pin", "bad", "-c", cfg)
    assert refused.returncode == 1 and "'bad' was rejected" in refused.stderr, refused.stderr
    # rejected by its checks (never verified): the answer names --force too, and why it cannot help
    checked = tmp_path / "corrupt"
    checked.mkdir()
    with daemon.registry.session() as s, s.begin():
        ckpt = st.create(s, version="corrupt", source="test", uri=f"file://{checked}", local_path=str(checked),
                         commit_signal="manifest")  # fmt: skip
        assert ckpt is not None
        st.move(s, ckpt, C.VERIFYING)
        st.move(s, ckpt, C.REJECTED, "crc32c: model.safetensors does not match its manifest")
    never = hotswap_cli("pin", "corrupt", "-c", cfg)
    assert never.returncode == 1 and "cannot be pinned, even with --force" in never.stderr, never.stderr
    forced = hotswap_cli("pin", "bad", "--force", "--timeout", "5", "-c", cfg)
    assert "was rejected" not in forced.stderr, forced.stderr
    from support_rollout import rollouts

    # forced past the refusal: a rollout of it was attempted (its unreachable worker fails it)
    wait_until(lambda: [r for r in rollouts(daemon.registry) if r["version"] == "bad"], 60, 0.2, "the forced rollout")


def test_the_token_is_made_once_0600_and_a_file_others_can_read_or_own_stops_the_start(
    daemon: DaemonProcess,
) -> None:
    path = daemon.state_dir / "control.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token_of(daemon)) >= 32
    first = token_of(daemon)
    daemon.kill()
    daemon.start()
    assert token_of(daemon) == first  # created once, kept across restarts
    daemon.kill()
    path.chmod(0o644)
    start = hotswap_cli("daemon", "-c", str(daemon.config_path), timeout=60)
    assert start.returncode == 2, start.stderr
    line = start.stderr.strip().splitlines()[-1]  # after the daemon's own log lines
    assert line.startswith("hotswap: error: daemon.state_dir: token file"), start.stderr
    assert "open to other users (mode 644)" in line and str(path) in line
    path.chmod(0o600)
    real = path.with_name("elsewhere.token")
    path.rename(real)
    path.symlink_to(real)  # a link another user could point anywhere: never followed
    start = hotswap_cli("daemon", "-c", str(daemon.config_path), timeout=60)
    assert start.returncode == 2 and "is not a regular file" in start.stderr.strip().splitlines()[-1]
    path.unlink()
    real.rename(path)
    if os.getuid() == 0:  # only root can hand the file to someone else
        os.chown(path, 65534, -1)
        start = hotswap_cli("daemon", "-c", str(daemon.config_path), timeout=60)
        assert start.returncode == 2 and "owned by uid 65534" in start.stderr
        os.chown(path, 0, -1)
