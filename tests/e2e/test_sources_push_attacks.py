"""Attacks on the push listener, replayed against the real daemon process (its push source on loopback)
with raw HTTP requests, and against the listener in-process where two client addresses are needed.

- Names that made the upload's cleanup raise (a NUL, a component over 255 bytes, a path 2,000 levels
  deep, a file where a folder must be) leaked the client's upload slots: after 8 of them every upload
  from that address was 429 until a restart. Now each is a 400 naming the problem, checked before the
  filesystem is touched, and slots are given back however a request ends.
- Every invalid name is a 400 naming the problem, never a 500 with a traceback or a reset connection.
- Wrong tokens were rate-limited before the token was checked: 150 of them from one address locked
  the real trainer at the same address out. Now the token is checked first; failures have their own
  limit per address, and requests with the valid token are limited per credential and per address.
"""

from __future__ import annotations

import http.client
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import publish_tiny

from daemon.client import push
from daemon.sources.push import PushSource, PushSourceConfig

TOKEN = "push-attack-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "hmac.key").write_bytes(os.urandom(32).hex().encode())
    return {"token": tmp_path / "token", "key": tmp_path / "hmac.key"}


def push_daemon(daemon_factory: Any, tmp_path: Path, keys: dict[str, Path], **push_keys: Any) -> tuple[Any, str]:
    """The real daemon with one push source; returns it and the push listener's URL."""
    d = daemon_factory(
        f"sqlite:///{tmp_path / 'registry.db'}",
        sources=[{"type": "push", "name": "push", "path": str(tmp_path / "pushed"), "token_file": str(keys["token"]),
                  "listen": "127.0.0.1:0", "hmac_keys": {"trainer": str(keys["key"])}, **push_keys}],
        checks={"enabled": ["manifest", "crc32c"], "hmac_keys": {"trainer": str(keys["key"])}},
    )  # fmt: skip
    [src] = [s for s in d.get("/status").json()["sources"] if s["name"] == "push"]
    return d, src["url"]


def raw(url: str, method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple[int, str]:
    """One request with the target sent byte for byte (no client-side normalisation of '..' or '//')."""
    host, _, port = url.removeprefix("http://").rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, target, body=body, headers={**AUTH, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def error_of(text: str) -> str:
    try:
        return str(json.loads(text).get("error"))
    except ValueError:
        return text[:300]


# (request target, words the 400's error must contain): each made the old code answer 500 (with a
# traceback in the log), accept the name, or keep an upload slot forever
BAD_NAMES = [
    ("/v1/push/v%00x/files/a.bin", "contains a NUL byte"),
    ("/v1/push/v1/files/a%00.bin", "backslash or NUL"),
    ("/v1/push/v1/files/" + "n" * 300 + "/a.bin", "a component is 300 bytes, over 255"),
    ("/v1/push/v1/files/" + "n" * 300, "a component is 300 bytes, over 255"),
    ("/v1/push/v1/files/" + "/".join(["d"] * 2000) + "/a.bin", "2001 levels deep, over 32"),
    ("/v1/push/v1/files/a.bin/inside.bin", "a.bin is an uploaded file, not a folder"),
    ("/v1/push/v%0A1/files/a.bin", "contains a newline"),
    ("/v1/push/v%0D%0AX-Forged:%201/files/a.bin", "contains a newline"),
    ("/v1/push/v%1B%5B2J/files/a.bin", "contains a control character"),
    ("/v1/push/../files/a.bin", "starts with '.'"),
    ("/v1/push/-rf/files/a.bin", "starts with '-'"),  # issue 37: an option to a restart command
    ("/v1/push/v%24%28id%29/files/a.bin", "a label is letters, digits and . _ @ + - only"),  # $(id)
    ("/v1/push/a%3Bb%20c/files/a.bin", "a label is letters, digits and . _ @ + - only"),  # "a;b c"
    ("/v1/push/v1/files/a/../../b.bin", "contains '..'"),
    ("/v1/push/v1/files//etc/passwd", "is absolute"),
]


def test_bad_names_are_400_naming_the_problem_and_never_keep_an_upload_slot(daemon_factory, tmp_path, keys):
    d, url = push_daemon(daemon_factory, tmp_path, keys)  # max_concurrent_uploads = 8 per address
    assert raw(url, "PUT", "/v1/push/v1/files/a.bin", b"a")[0] == 200  # a file for the folder-conflict case
    seen = []
    for _round in range(2):  # 24 requests: three times the 8 slots the old code leaked one by one
        for target, words in BAD_NAMES:
            status, text = raw(url, "PUT", target, b"x" * 100)
            seen.append((target[:60], status, error_of(text)[:120]))
            assert status == 400 and words in error_of(text), seen[-1]
    for target, words in [("/v1/push/v%00x/commit", "contains a NUL byte"), ("/v1/push/v%0Ax", "contains a newline")]:
        status, text = raw(url, "POST" if target.endswith("commit") else "DELETE", target, b"{}")
        assert status == 400 and words in error_of(text), (target, status, text)
    assert "Traceback" not in d.log(), d.log()[-3000:]
    # the trainer at the same address still uploads and commits
    ckpt = tmp_path / "out" / "step-1"
    publish_tiny(ckpt, seed=1, shards=2)
    answer = push(ckpt, url, TOKEN, keys["key"], key_id="trainer", retries=0)
    assert answer["status"] == "committed", answer
    d.wait_status("step-1", "verified", timeout=60)
    assert sorted(p.name for p in (tmp_path / "pushed" / ".incoming").iterdir()) == ["v1"]  # no bad name made a folder


def test_wrong_tokens_from_the_trainers_address_never_lock_the_trainer_out(daemon_factory, tmp_path, keys):
    # a slow refill, so the old code's shared bucket (burst 100) could not recover during the flood
    d, url = push_daemon(daemon_factory, tmp_path, keys, rate_per_s=0.5)
    codes = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for i in range(150):
            codes.append(c.put(f"/v1/push/x/files/f{i}.bin", content=b"x", headers={"Authorization": "Bearer wrong"})
                         .status_code)  # fmt: skip
    print("wrong-token answers:", {c: codes.count(c) for c in set(codes)})
    assert codes[:20] == [401] * 20 and set(codes) == {401, 429}  # their own limit (auth_failure_burst = 20)
    assert not (tmp_path / "pushed" / ".incoming" / "x").exists()
    ckpt = tmp_path / "out" / "step-2"
    publish_tiny(ckpt, seed=2)
    answer = push(ckpt, url, TOKEN, keys["key"], key_id="trainer", retries=0)
    assert answer["status"] == "committed", answer
    d.wait_status("step-2", "verified", timeout=60)


# ------------------------------------------------------------------ in-process: two client addresses


@pytest.fixture
def listener(tmp_path: Path, keys: dict[str, Path]) -> Iterator[Any]:
    started: list[PushSource] = []

    def start(**kw: Any) -> PushSource:
        cfg = PushSourceConfig(path=str(tmp_path / "registry"), token_file=str(keys["token"]),
                               listen="127.0.0.1:0", hmac_keys={"trainer": str(keys["key"])}, **kw)  # fmt: skip
        cfg.validate("sources[0]")
        src = PushSource(cfg, lambda item: 1)
        src.start()
        started.append(src)
        return src

    yield start
    for s in started:
        s.stop()


def client_from(src: PushSource, address: str) -> httpx.Client:
    assert src.server is not None
    return httpx.Client(base_url=src.server.url, transport=httpx.HTTPTransport(local_address=address), timeout=30)


def test_the_valid_token_is_limited_per_credential_and_per_address_failures_per_address(listener):
    src = listener(rate_per_s=0.001, burst=3, auth_failures_per_s=0.001, auth_failure_burst=2)
    with client_from(src, "127.0.0.1") as a, client_from(src, "127.0.0.2") as b:
        wrong = {"Authorization": "Bearer wrong"}
        assert [a.delete("/v1/push/x", headers=wrong).status_code for _ in range(4)] == [401, 401, 429, 429]
        assert b.delete("/v1/push/x", headers=wrong).status_code == 401  # another address: its own failures
        # the valid token from the flooded address goes through; three per credential across addresses
        assert [a.delete("/v1/push/x", headers=AUTH).status_code for _ in range(2)] == [200, 200]
        assert b.delete("/v1/push/x", headers=AUTH).status_code == 200
        r = b.delete("/v1/push/x", headers=AUTH)  # b's address bucket holds 2 more: the credential's is empty
        assert r.status_code == 429 and "credential" in r.json()["detail"], r.text
        assert int(r.headers["Retry-After"]) >= 1
