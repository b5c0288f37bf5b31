"""Where the daemon's API listens and what it shows: loopback or TLS, and no secret in /status.

Real daemon processes: a non-loopback listen without TLS is refused at start (one line, exit 2)
unless `[api] allow_insecure_remote`; with `[api] tls_certfile/tls_keyfile` the API is HTTPS
only and the CLI trusts exactly that certificate; a PostgreSQL URL carrying `?password=` never
appears in `/status`, daemon.json, `hotswap status` or the daemon's log.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import (
    POSTGRES_ENV,
    DaemonProcess,
    _postgres_database,
    hotswap_cli,
    make_config_file,
    wait_until,
)
from support_wait import free_port

from daemon.common.redact import redact_doc, redact_url
from daemon.config import ConfigError, parse_config

pytestmark = pytest.mark.timeout(300)


def daemon_at(root: Path, listen: str, db_url: str | None = None, api: dict[str, Any] | None = None,
              workers: bool = False) -> DaemonProcess:  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    db_url = db_url or f"sqlite:///{root / 'registry.db'}"
    extra: dict[str, Any] = {}
    if workers:  # an external worker nothing listens for: the rollout routes are mounted
        token = root / "worker.token"
        token.write_text("worker-secret\n")
        token.chmod(0o600)
        extra["workers"] = [{"name": "w0", "url": f"http://127.0.0.1:{free_port()}", "token_file": str(token)}]
    cfg = make_config_file(
        root / "config.toml",
        daemon={"state_dir": str(root / "state"), "listen": listen, "log_level": "debug"},
        database={"url": db_url},
        api=api,
        sources=[{"path": str(root / "checkpoints"), "rescan_interval_s": 5.0}],
        **extra,
    )
    return DaemonProcess(root, cfg, db_url, root / "checkpoints", root / "state", {})


@pytest.fixture
def started() -> Iterator[list[DaemonProcess]]:
    daemons: list[DaemonProcess] = []
    yield daemons
    for d in daemons:
        d.close()


def test_listen_rules_in_the_config() -> None:
    for listen in ("127.0.0.1:8780", "127.0.0.2:0", "localhost:8780", "[::1]:8780"):
        parse_config({"daemon": {"listen": listen}}, "c.toml")
    for listen in ("0.0.0.0:8780", "10.1.2.3:8780", "[::]:8780", "hotswap.example:8780"):
        with pytest.raises(ConfigError) as err:
            parse_config({"daemon": {"listen": listen}}, "c.toml")
        assert str(err.value).startswith("c.toml: daemon.listen: ") and "allow_insecure_remote" in str(err.value)
        parse_config({"daemon": {"listen": listen}, "api": {"allow_insecure_remote": True}}, "c.toml")
    with pytest.raises(ConfigError, match="tls_certfile and tls_keyfile go together"):
        parse_config({"api": {"tls_certfile": "/etc/hostname"}}, "c.toml")
    with pytest.raises(ConfigError, match=r"api.tls_keyfile: /nonexistent/k.pem is not a readable file"):
        parse_config({"api": {"tls_certfile": "/etc/hostname", "tls_keyfile": "/nonexistent/k.pem"}}, "c.toml")
    with pytest.raises(ConfigError, match=r"allowed_hosts\[0\]"):
        parse_config({"api": {"allowed_hosts": ["http://x"]}}, "c.toml")


def test_a_remote_listen_without_tls_is_refused_unless_allowed(tmp_path: Path, started: list[DaemonProcess]) -> None:
    d = daemon_at(tmp_path / "a", "0.0.0.0:0")
    out = hotswap_cli("daemon", "-c", str(d.config_path), timeout=60)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "daemon.listen: 0.0.0.0:0 is not a loopback address and [api] has no TLS" in line
    assert not (tmp_path / "a" / "state" / "daemon.json").exists()

    d = daemon_at(tmp_path / "b", "0.0.0.0:0", api={"allow_insecure_remote": True}, workers=True)
    started.append(d)
    d.start()
    assert d.api_url and d.api_url.startswith("http://127.0.0.1:")  # the CLI dials loopback
    assert d.get("/livez").status_code == 200
    wait_until(lambda: d.get("/v1/rollout").json().get("ready"), 120, 0.2, "the rollout service")
    # its one worker was never started: the host does not serve, and /health says so
    health = d.get("/health")
    assert health.status_code == 503 and "no worker of group 'default' serves" in health.json()["error"], health.text
    out = hotswap_cli("unpin", "-c", str(d.config_path))
    assert out.returncode == 0, out.stderr


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    key_path.chmod(0o600)
    return cert_path, key_path


def test_tls_api_on_a_remote_listen_and_the_cli_trusts_exactly_its_certificate(
    tmp_path: Path, started: list[DaemonProcess]
) -> None:
    cert, key = self_signed(tmp_path, "hotswap.example")
    api = {"tls_certfile": str(cert), "tls_keyfile": str(key), "allowed_hosts": ["hotswap.example"]}
    d = daemon_at(tmp_path / "d", "0.0.0.0:0", api=api, workers=True)
    started.append(d)
    d.start()
    assert d.api_url and d.api_url.startswith("https://127.0.0.1:")
    plain = d.api_url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain + "/health", timeout=10)  # no clear-text fallback
    with pytest.raises(httpx.ConnectError):  # not signed by any CA this machine trusts
        httpx.get(d.api_url + "/health", timeout=10)
    pinned = ssl.create_default_context(cafile=str(cert))
    pinned.check_hostname = False
    assert httpx.get(d.api_url + "/livez", timeout=10, verify=pinned).status_code == 200
    wait_until(lambda: httpx.get(d.api_url + "/v1/rollout", timeout=10, verify=pinned).json().get("ready"), 120, 0.2,
               "the rollout service")  # fmt: skip

    out = hotswap_cli("unpin", "-c", str(d.config_path))
    assert out.returncode == 0, out.stderr
    status = hotswap_cli("status", "--json", "-c", str(d.config_path))
    assert status.returncode == 0, status.stderr
    # asked the HTTPS daemon itself: its own problem (the worker nothing listens for), not "no answer"
    health = json.loads(status.stdout)["health"]
    assert health["ok"] is False and "no worker of group 'default' serves" in health["error"], health
    token = (d.state_dir / "control.token").read_text().strip()
    auth = {"Authorization": f"Bearer {token}"}
    named = httpx.post(d.api_url + "/v1/rollout/unpin", json={}, timeout=30, verify=pinned,
                       headers={**auth, "Host": "hotswap.example"})  # fmt: skip
    assert named.status_code == 200  # [api] allowed_hosts
    other = httpx.post(d.api_url + "/v1/rollout/unpin", json={}, timeout=30, verify=pinned,
                       headers={**auth, "Host": "other.example"})  # fmt: skip
    assert other.status_code == 403

    # another certificate in the config than the daemon serves: the CLI refuses to talk
    other_cert, _ = self_signed(tmp_path, "impostor.example")
    text = d.config_path.read_text().replace(str(cert), str(other_cert))
    impostor_cfg = tmp_path / "impostor.toml"
    impostor_cfg.write_text(text)
    out = hotswap_cli("unpin", "-c", str(impostor_cfg))
    assert out.returncode == 1 and "does not answer" in out.stderr and "CERTIFICATE_VERIFY_FAILED" in out.stderr


def test_redaction_of_urls_and_documents() -> None:
    assert redact_url("postgresql+psycopg://bob:pw@db:5432/x?password=pw&sslmode=require") == (
        "postgresql+psycopg://bob:***@db:5432/x?password=***&sslmode=require"
    )
    assert redact_url("sqlite:///state/hotswap.db") == "sqlite:///state/hotswap.db"
    assert redact_url("postgresql://u:pa/ss@h/db") == "postgresql://u:***@h/db"  # unescaped "/" in it
    assert redact_url("https://h/o?X-Amz-Signature=abc&X-Amz-Credential=AK%2F1&part=2") == (
        "https://h/o?X-Amz-Signature=***&X-Amz-Credential=***&part=2"
    )
    doc = {"token": "abc", "key_id": "k1", "token_file": "/etc/t", "hmac_key": "raw", "n": 3,
           "endpoint": "http://ak:sk@s3.local:9000", "notes": ["failed at postgresql://u:p@h/d?sslpassword=z"]}  # fmt: skip
    assert redact_doc(doc) == {
        "token": "***", "key_id": "k1", "token_file": "/etc/t", "hmac_key": "***", "n": 3,
        "endpoint": "http://ak:***@s3.local:9000", "notes": ["failed at postgresql://u:***@h/d?sslpassword=***"],
    }  # fmt: skip


@pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV} (a PostgreSQL server)")
def test_a_postgres_password_in_the_query_never_shows(tmp_path: Path, started: list[DaemonProcess]) -> None:
    secret = "hunter2-" + os.urandom(6).hex()
    for db in _postgres_database(os.environ[POSTGRES_ENV]):
        url = f"{db}?password={secret}&application_name=hotswap-test"
        d = daemon_at(tmp_path / "p", "127.0.0.1:0", db_url=url)
        started.append(d)
        d.start()
        status = d.get("/status")
        assert status.status_code == 200
        assert status.json()["daemon"]["database"].endswith("?password=***&application_name=hotswap-test")
        cli = hotswap_cli("status", "--json", "-c", str(d.config_path))
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["daemon"]["database"].endswith("?password=***&application_name=hotswap-test")
        upgrade = hotswap_cli("db", "upgrade", "-c", str(d.config_path))
        assert upgrade.returncode == 0 and "password=***" in upgrade.stdout
        seen = {"/status": status.text, "daemon.json": (d.state_dir / "daemon.json").read_text(),
                "status --json": cli.stdout, "db upgrade": upgrade.stdout + upgrade.stderr}  # fmt: skip
        d.stop()
        seen["log"] = d.log()
        assert "starting" in seen["log"]  # the log is there, and says where the database is
        for where, text in seen.items():
            assert secret not in text, where


def test_the_api_accepts_connections_from_the_moment_its_url_is_known() -> None:
    """daemon.json is written right after the API server is made; uvicorn's thread listens later.
    The socket listens when the server is made, so a client that reads the URL at once is queued
    by the kernel, not refused (CI: ConnectError on /livez right after daemon.json appeared)."""
    from fastapi import FastAPI

    from daemon.api.app import ApiServer

    server = ApiServer(FastAPI(), "127.0.0.1", 0)  # made, not started: uvicorn has not run
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5):
            pass  # refused before the fix: bound, not listening
    finally:
        server.sock.close()
