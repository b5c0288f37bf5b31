"""`hotswap daemon` refuses to start with one stderr line and exit 2, before it touches anything,
for: a busy API port, a missing/empty/unreadable token file, a missing or bad check key file, a
required source folder that is missing. And a watched folder that goes away while the daemon
runs makes `/health` 503 with the reason and shows in `hotswap status`, until it is back.
Every case runs the real `hotswap daemon` process."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import hotswap_cli, make_config_file, publish_tiny


@pytest.fixture
def busy_port() -> Iterator[int]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def _start_fails(tmp_path: Path, config: Path) -> str:
    """Run `hotswap daemon -c config` from an empty folder; it must exit 2 with one stderr line."""
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    try:
        out = hotswap_cli("daemon", "-c", str(config), cwd=cwd, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the daemon started instead of refusing")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "state").exists(), "something was set up before the check"
    return lines[0]


def _config(tmp_path: Path, *, listen: str = "127.0.0.1:0", extra: str = "", **sections: object) -> Path:
    path = make_config_file(
        tmp_path / "c.toml",
        daemon={"state_dir": str(tmp_path / "state"), "listen": listen},
        sources=[{"path": str(tmp_path / "ckpts")}],
        **sections,  # type: ignore[arg-type]
    )
    path.write_text(path.read_text() + extra)
    return path


def test_busy_port_is_one_line_before_anything_is_launched(tmp_path: Path, busy_port: int) -> None:
    # the embedded-default fleet: a managed worker that would be seeded and launched first
    cfg = _config(tmp_path, listen=f"127.0.0.1:{busy_port}", workers=[{"name": "w0", "launch": "managed"}])
    line = _start_fails(tmp_path, cfg)
    assert f"127.0.0.1:{busy_port} is already in use" in line and "[daemon].listen" in line
    assert not (tmp_path / "ckpts").exists()


@pytest.mark.parametrize("problem", ["missing", "empty", "directory"])
def test_external_worker_token_file_problems(tmp_path: Path, problem: str) -> None:
    token = tmp_path / "worker.token"
    if problem == "empty":
        token.write_text("\n")
    elif problem == "directory":
        token.mkdir()
    worker = {"name": "ext", "url": "http://127.0.0.1:9", "token_file": str(token)}
    line = _start_fails(tmp_path, _config(tmp_path, workers=[worker]))
    assert "[[workers]] ext: token_file" in line and str(token) in line
    want = {"missing": "does not exist", "empty": "is empty", "directory": "cannot be read"}[problem]
    assert want in line


def test_missing_hmac_key_file_is_noticed_at_start(tmp_path: Path) -> None:
    key = tmp_path / "keys" / "trainer.key"
    cfg = _config(tmp_path, extra=f'\n[checks.hmac_keys]\ntrainer = "{key}"\n')
    line = _start_fails(tmp_path, cfg)
    assert "[checks].hmac_keys.trainer" in line and str(key) in line and "unreadable" in line


def test_bad_ed25519_key_file_is_noticed_at_start(tmp_path: Path) -> None:
    key = tmp_path / "pub.key"
    key.write_bytes(b"not a key at all")
    cfg = _config(tmp_path, extra=f'\n[checks.ed25519_keys]\nci = "{key}"\n')
    line = _start_fails(tmp_path, cfg)
    assert "[checks].ed25519_keys.ci" in line and str(key) in line and "Ed25519" in line


def test_required_source_folder_missing_at_start(tmp_path: Path) -> None:
    folder = tmp_path / "mnt" / "ckpts"
    cfg = make_config_file(
        tmp_path / "c.toml",
        daemon={"state_dir": str(tmp_path / "state"), "listen": "127.0.0.1:0"},
        sources=[{"path": str(folder), "create": False, "required": True}],
    )
    line = _start_fails(tmp_path, cfg)
    assert "[sources][0]" in line and str(folder) in line and "does not exist" in line


def test_source_folder_missing_at_runtime_is_unhealthy_until_back(db_url, daemon_factory, tmp_path) -> None:
    watch = tmp_path / "watched"
    watch.mkdir()
    d = daemon_factory(db_url, sources=[{"path": str(watch), "create": False, "rescan_interval_s": 0.5}])
    assert d.get("/health").status_code == 200
    shutil.rmtree(watch)
    r = d.get("/health")
    assert r.status_code == 503
    assert f"watched folder {watch} does not exist" in r.json()["error"]
    status = hotswap_cli("status", "-c", str(d.config_path), env={"COLUMNS": "200"})
    assert status.returncode == 0, status.stderr
    assert "unhealthy" in status.stdout and str(watch) in status.stdout
    watch.mkdir()
    assert d.get("/health").status_code == 200
    # the folder that came back is watched again: a checkpoint in it is found
    publish_tiny(watch / "back-1", seed=3, version="back-1")
    d.wait_status("back-1", "verified")
    assert httpx.get(d.api_url + "/status", timeout=10).json()["daemon"]["problems"] == []


def test_push_source_files_and_port_are_checked_at_start(tmp_path: Path, busy_port: int) -> None:
    token = tmp_path / "push.token"
    token.write_text("s3cret\n")
    key = tmp_path / "push.key"
    key.write_bytes(b"k" * 32)
    base = {"type": "push", "path": str(tmp_path / "pushed"), "token_file": str(token), "listen": "127.0.0.1:0",
            "hmac_keys": {"t": str(key)}}  # fmt: skip

    def fails_with(**changes: object) -> str:
        cfg = make_config_file(
            tmp_path / "c.toml",
            daemon={"state_dir": str(tmp_path / "state"), "listen": "127.0.0.1:0"},
            sources=[{**base, **changes}],
        )
        return _start_fails(tmp_path, cfg)

    line = fails_with(token_file=str(tmp_path / "gone.token"))
    assert "[sources][0].token_file" in line and "gone.token" in line and "does not exist" in line
    line = fails_with(listen=f"127.0.0.1:{busy_port}")
    assert "[sources][0].listen" in line and f"127.0.0.1:{busy_port} is already in use" in line
    line = fails_with(tls_cert_file=str(tmp_path / "no.crt"), tls_key_file=str(tmp_path / "no.key"))
    assert "[sources][0].tls_cert_file" in line and "no.crt" in line
    line = fails_with(hmac_keys={"t": str(tmp_path / "lost.key")})
    assert "[sources][0].hmac_keys.t" in line and "lost.key" in line


def test_engine_worker_admin_token_file_is_checked_at_start(tmp_path: Path) -> None:
    token = tmp_path / "admin.token"
    worker = {"name": "sg", "kind": "sglang", "url": "http://127.0.0.1:9", "admin_token_file": str(token)}
    line = _start_fails(tmp_path, _config(tmp_path, workers=[worker]))
    assert "[[workers]] sg: admin_token_file" in line and str(token) in line and "does not exist" in line


def test_a_transport_the_worker_kind_cannot_take_is_one_line_naming_both(tmp_path: Path) -> None:
    token = tmp_path / "vllm.token"
    token.write_text("t\n")
    worker = {"name": "v0", "kind": "vllm", "url": "http://127.0.0.1:9", "token_file": str(token)}
    config = _config(tmp_path, workers=[worker], rollout={"transport": "broadcast"})
    (tmp_path / "cwd").mkdir()
    out = hotswap_cli("daemon", "-c", str(config), cwd=tmp_path / "cwd", timeout=60)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    line = out.stderr.strip()
    assert str(config) in line and "[[workers]] v0" in line and "'vllm'" in line and "'broadcast'" in line, line


def test_a_named_token_or_webhook_secret_open_to_others_is_one_line(tmp_path: Path) -> None:
    loose = tmp_path / "alice.token"
    loose.write_text("alice-token-0123456789\n")
    loose.chmod(0o644)
    cfg = _config(tmp_path, **{"api.tokens": [{"name": "alice", "role": "operator", "token_file": str(loose)}]})
    line = _start_fails(tmp_path, cfg)
    assert "api.tokens[0].token_file (alice)" in line and "open to other users (mode 644)" in line, line
    loose.chmod(0o600)
    cfg = _config(tmp_path, webhooks=[{"name": "ops", "url": "http://127.0.0.1:9/", "secret_file": str(tmp_path / "nope")}])
    line = _start_fails(tmp_path, cfg)
    assert "webhooks[0].secret_file (ops)" in line and "does not exist" in line, line
