"""The push source: its own uvicorn listener on loopback, real httpx clients and raw sockets."""

from __future__ import annotations

import json
import os
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import publish_tiny, wait_until
from support_tls import Pki

from daemon.checks.signatures import HmacSigner
from daemon.client import PushError, push
from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.manifest import publish
from daemon.sources.push import PushSource, PushSourceConfig

pytestmark = pytest.mark.quick

TOKEN = "push-token-0123456789"


class Recorder:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def __call__(self, item: Any) -> int:
        self.items.append(item)
        return len(self.items)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "hmac.key").write_bytes(os.urandom(32).hex().encode())
    (tmp_path / "other.key").write_bytes(os.urandom(32).hex().encode())
    return {"token": tmp_path / "token", "key": tmp_path / "hmac.key", "other": tmp_path / "other.key"}


@pytest.fixture
def start_push(tmp_path: Path, keys: dict[str, Path]) -> Iterator[Any]:
    started: list[PushSource] = []

    def start(**kw: Any) -> tuple[PushSource, Recorder]:
        cfg = PushSourceConfig(path=str(tmp_path / "registry"), token_file=str(keys["token"]),
                               listen="127.0.0.1:0", hmac_keys={"trainer": str(keys["key"])}, **kw)  # fmt: skip
        cfg.validate("sources[0]")
        rec = Recorder()
        src = PushSource(cfg, rec)
        src.start()
        started.append(src)
        return src, rec

    yield start
    for s in started:
        s.stop()


def url(src: PushSource) -> str:
    assert src.server is not None
    return src.server.url


def incoming_files(src: PushSource) -> list[Path]:
    return [p for p in (src.root / ".incoming").rglob("*") if p.is_file()]


def test_push_registers_the_checkpoint_with_its_directory(start_push, keys, tmp_path):
    src, rec = start_push()
    ckpt = tmp_path / "out" / "step-1"
    publish_tiny(ckpt, seed=1, shards=2)
    answer = push(ckpt, url(src), TOKEN, keys["key"], key_id="trainer")
    assert answer["status"] == "committed"
    [item] = rec.items
    assert (item.version, item.signal, item.directory) == ("step-1", "push", src.root / "step-1")
    for p in ckpt.iterdir():
        if p.name != MANIFEST_NAME:
            assert (src.root / "step-1" / p.name).read_bytes() == p.read_bytes()
    assert json.loads((src.root / "step-1" / MANIFEST_NAME).read_text())["signature"]["key_id"] == "trainer"
    assert incoming_files(src) == []
    # the same version and content again: one checkpoint
    assert push(ckpt, url(src), TOKEN, keys["key"], key_id="trainer")["status"] == "exists"
    assert {i.directory for i in rec.items} == {src.root / "step-1"}
    assert sorted(p.name for p in src.root.iterdir()) == [".incoming", "step-1"]
    # the same version with other content: 409, the first one stays
    other = tmp_path / "out2" / "step-1"
    publish_tiny(other, seed=2)
    with pytest.raises(PushError) as err:
        push(other, url(src), TOKEN, keys["key"], key_id="trainer", retries=0)
    assert err.value.status == 409
    assert (src.root / "step-1" / MANIFEST_NAME).read_bytes() != (other / MANIFEST_NAME).read_bytes()


def test_missing_or_wrong_token_is_401_and_writes_nothing(start_push, keys, tmp_path):
    src, rec = start_push()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = httpx.put(f"{url(src)}/v1/push/v1/files/a.bin", content=b"x" * 100, headers=headers)
        assert r.status_code == 401, headers
    r = httpx.post(f"{url(src)}/v1/push/v1/commit", content=b"{}")
    assert r.status_code == 401
    assert incoming_files(src) == [] and not (src.root / ".incoming" / "v1").exists() and rec.items == []
    ckpt = tmp_path / "v1"
    publish_tiny(ckpt, seed=1)
    with pytest.raises(PushError) as err:
        push(ckpt, url(src), "wrong", keys["key"], key_id="trainer", retries=0)
    assert err.value.status == 401


def test_bad_signature_is_403_and_registers_nothing(start_push, keys, tmp_path):
    src, rec = start_push()
    ckpt = tmp_path / "v2"
    publish_tiny(ckpt, seed=1)
    with pytest.raises(PushError) as err:  # signed with a key the daemon does not have under that id
        push(ckpt, url(src), TOKEN, keys["other"], key_id="trainer", retries=0)
    assert err.value.status == 403 and "bad hmac-sha256 signature" in str(err.value)
    with pytest.raises(PushError) as err:
        push(ckpt, url(src), TOKEN, keys["key"], key_id="nobody", retries=0)
    assert err.value.status == 403
    assert rec.items == [] and not (src.root / "v2").exists()


def test_bytes_not_matching_the_signed_manifest_are_refused(start_push, keys, tmp_path):
    """The daemon hashes what it received: a sender that lies about a file's content is caught."""
    src, rec = start_push()
    ckpt = tmp_path / "v3"
    publish_tiny(ckpt, seed=1)
    manifest = publish(ckpt, signer=HmacSigner("trainer", keys["key"].read_bytes()))
    shard = manifest.files[0].path
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for f in manifest.files:
        data = (ckpt / f.path).read_bytes()
        if f.path == shard:
            data = data[:-1] + bytes([data[-1] ^ 1])
        assert httpx.put(f"{url(src)}/v1/push/v3/files/{f.path}", content=data, headers=auth).status_code == 200
    r = httpx.post(f"{url(src)}/v1/push/v3/commit", content=(ckpt / MANIFEST_NAME).read_bytes(), headers=auth)
    assert r.status_code == 422 and shard in r.json()["error"]
    assert rec.items == [] and not (src.root / "v3").exists()


def test_over_the_size_limit_is_413(start_push, keys, tmp_path):
    src, rec = start_push(max_checkpoint_bytes=1024 * 1024)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.put(f"{url(src)}/v1/push/big/files/a.bin", content=b"\0" * (2 * 1024 * 1024), headers=auth)
    assert r.status_code == 413
    def stream() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b"\1" * 65536
    r = httpx.put(f"{url(src)}/v1/push/big/files/b.bin", content=stream(), headers=auth)
    assert r.status_code == 413
    assert incoming_files(src) == [] and rec.items == []


def test_over_the_request_rate_is_429(start_push):
    src, _ = start_push(rate_per_s=0.001, burst=3)
    codes = [httpx.delete(f"{url(src)}/v1/push/x", headers={"Authorization": f"Bearer {TOKEN}"}).status_code
             for _ in range(5)]  # fmt: skip
    assert codes == [200, 200, 200, 429, 429]


def test_too_many_concurrent_uploads_is_429(start_push):
    src, _ = start_push(max_concurrent_uploads=1)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    release = threading.Event()
    first: list[int] = []

    def slow() -> Iterator[bytes]:
        yield b"a" * 1000
        release.wait(30)
        yield b"b" * 1000

    t = threading.Thread(target=lambda: first.append(
        httpx.put(f"{url(src)}/v1/push/c/files/slow.bin", content=slow(), headers=auth, timeout=60).status_code))
    t.start()
    wait_until(lambda: src.state.uploads.get("127.0.0.1", 0) == 1, 10, what="the first upload to be in flight")
    r = httpx.put(f"{url(src)}/v1/push/c/files/second.bin", content=b"x", headers=auth)
    release.set()
    t.join(30)
    assert r.status_code == 429 and first == [200]


def test_disconnect_mid_upload_registers_nothing_and_temp_files_go(start_push, keys, tmp_path):
    src, rec = start_push(upload_timeout_s=0.5)
    host, port = src.server.host, src.server.port  # type: ignore[union-attr]
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(f"PUT /v1/push/gone/files/w.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                  f"Content-Length: {64 * 1024 * 1024}\r\n\r\n".encode())  # fmt: skip
        s.sendall(os.urandom(8 * 1024 * 1024))
        wait_until(lambda: (src.root / ".incoming" / "gone").exists(), 10, what="the upload to start")
    # the .part is removed as soon as the server sees the disconnect, the folder after the timeout
    wait_until(lambda: not (src.root / ".incoming" / "gone").exists(), 20, what="the upload folder to be removed")
    assert incoming_files(src) == [] and rec.items == [] and not (src.root / "gone").exists()
    r = httpx.post(f"{url(src)}/v1/push/gone/commit", content=b"{}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400


def test_mtls_refuses_a_client_without_a_valid_certificate_before_any_byte(start_push, keys, tmp_path):
    pki = Pki(tmp_path / "pki")
    src, rec = start_push(tls_cert_file=pki.server[0], tls_key_file=pki.server[1], tls_client_ca_file=pki.ca)
    assert url(src).startswith("https://")
    ckpt = tmp_path / "tls-1"
    publish_tiny(ckpt, seed=3)
    for cert in (None, pki.rogue):
        with pytest.raises((httpx.TransportError, PushError, ssl.SSLError)):
            push(ckpt, url(src), TOKEN, keys["key"], key_id="trainer", verify=pki.ca, cert=cert, retries=0)
        assert incoming_files(src) == [] and not (src.root / ".incoming" / "tls-1").exists()
    with pytest.raises(httpx.TransportError):  # not even the unauthenticated routes answer
        httpx.delete(f"{url(src)}/v1/push/tls-1", verify=ssl.create_default_context(cafile=pki.ca))
    assert rec.items == []
    answer = push(ckpt, url(src), TOKEN, keys["key"], key_id="trainer", verify=pki.ca, cert=pki.client)
    assert answer["status"] == "committed" and [i.version for i in rec.items] == ["tls-1"]


def test_a_pushed_delta_carries_its_compacted_delta_and_the_commit_checks_it(start_push, keys, tmp_path):
    """`push` uploads a delta's files and its compacted delta's (issue 38), each checked against the
    signed manifest (the daemon's digests of the bytes it got), so a compacted file that differs is
    refused like any other; the commit needs them all."""
    import shutil

    import httpx
    from support_delta import step

    from daemon.client import publish_delta
    from daemon.delta.anchors import AnchorRule
    from daemon.delta.section import COMPACT_DIR, DELTA_DIR

    src, rec = start_push()
    tr, hsd = tmp_path / "tr", "model.safetensors.hsd"
    publish_tiny(tr / "v1", seed=1)
    for v, base in (("v2", "v1"), ("v3", "v2")):
        step(tr / base, tr / v, 1e-3, 7)
        publish_delta(tr / v, tr / base, tmp_path / "out" / v, rule=AnchorRule(share=100.0))
    bad = tmp_path / "bad" / "v3"
    shutil.copytree(tmp_path / "out" / "v3", bad)
    (bad / COMPACT_DIR / hsd).write_bytes(os.urandom((bad / COMPACT_DIR / hsd).stat().st_size))
    with pytest.raises(PushError) as err:
        push(bad, url(src), TOKEN, keys["key"], key_id="trainer", retries=0)
    assert f"{COMPACT_DIR}/{hsd}" in str(err.value) and rec.items == [], err.value  # named; nothing committed
    httpx.delete(f"{url(src)}/v1/push/v3", headers={"Authorization": f"Bearer {TOKEN}"}).raise_for_status()
    assert push(tmp_path / "out" / "v3", url(src), TOKEN, keys["key"], key_id="trainer")["status"] == "committed"
    held = sorted(p.relative_to(src.root / "v3").as_posix() for p in (src.root / "v3").rglob("*") if p.is_file())
    assert held == [f"{COMPACT_DIR}/{hsd}", f"{DELTA_DIR}/{hsd}", MANIFEST_NAME]
    assert [i.version for i in rec.items] == ["v3"]
