"""The broadcast transport's pure parts: table parsing, the bucket cut, group parameters, the
finite check on raw bits, and the daemon route's guard (the real-process tests are in
test_broadcast.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from daemon.api.broadcast import broadcast_router
from daemon.common.auth import ControlGuard, ensure_control_token
from daemon.transport.base import BadUpdateRequest
from daemon.transport.broadcast import buckets, parse_table, total_bytes
from daemon.transport.broadcast_worker import _finite
from daemon.transport.group_spec import GroupSpec

pytestmark = pytest.mark.quick


def test_the_bucket_cut_covers_every_byte_once_in_table_order() -> None:
    table = parse_table([{"name": "a", "dtype": "F32", "shape": [3, 5]}, {"name": "b", "dtype": "BF16", "shape": [7]},
                         {"name": "c", "dtype": "U8", "shape": [0]}, {"name": "d", "dtype": "F16", "shape": [40]}])  # fmt: skip
    for size in (1, 7, 16, 60, 1000):
        seen: dict[str, list[tuple[int, int]]] = {}
        for used, pieces in buckets(table, size):
            assert 0 < used <= size
            assert sum(p.size for p in pieces) == used
            assert [p.offset for p in pieces] == [sum(q.size for q in pieces[:i]) for i in range(len(pieces))]
            for p in pieces:
                seen.setdefault(p.name, []).append((p.start, p.size))
        assert list(seen) == ["a", "b", "d"]
        for name, parts in seen.items():
            assert parts[0][0] == 0 and all(s0 + n0 == s1 for (s0, n0), (s1, _) in zip(parts, parts[1:], strict=False))
            assert sum(n for _, n in parts) == table[name].nbytes
    assert total_bytes(table) == 60 + 14 + 0 + 80


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        (None, "non-empty list"),
        ([], "non-empty list"),
        (["x"], r"table\[0\] must be an object"),
        ([{"name": "", "dtype": "F32", "shape": [1]}], "name"),
        ([{"name": "a", "dtype": "F33", "shape": [1]}], "unknown dtype"),
        ([{"name": "a", "dtype": "F32", "shape": [-1]}], "non-negative"),
        ([{"name": "a", "dtype": "F32", "shape": [True]}], "non-negative"),
        ([{"name": "a", "dtype": "F32", "shape": [1]}, {"name": "a", "dtype": "F32", "shape": [1]}], "twice"),
    ],
)
def test_a_bad_table_is_one_clear_error(doc: Any, says: str) -> None:
    with pytest.raises(BadUpdateRequest, match=says):
        parse_table(doc)


def test_group_parameters_are_checked() -> None:
    good = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3,
            "backend": "gloo", "group_name": "g", "timeout_s": 5}  # fmt: skip
    assert GroupSpec.from_json(good).to_json() == {**good, "timeout_s": 5.0}
    for key, bad, says in [("master_port", 0, "master_port"), ("rank_offset", 0, "rank 0 is the trainer"),
                           ("rank_offset", 3, "rank_offset"), ("world_size", 1, "world_size"),
                           ("backend", "mpi", "backend"), ("timeout_s", 0, "timeout_s"),
                           ("group_name", "", "group_name"), ("master_address", 5, "master_address")]:  # fmt: skip
        with pytest.raises(BadUpdateRequest, match=says):
            GroupSpec.from_json({**good, key: bad})


@pytest.mark.parametrize(
    ("dtype", "st"),
    [(torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.float32, "F32"), (torch.float64, "F64"),
     (torch.float8_e5m2, "F8_E5M2"), (torch.float8_e4m3fn, "F8_E4M3")],
)  # fmt: skip
def test_the_finite_check_finds_every_nan_and_inf(dtype: torch.dtype, st: str) -> None:
    x = (torch.randn(257) * 3).to(dtype)
    assert _finite(x, st)
    specials = [float("nan")] + ([] if st == "F8_E4M3" else [float("inf"), float("-inf")])
    for v in specials:
        y = torch.randn(257)
        y[200] = v
        assert not _finite(y.to(dtype), st), (st, v)
    assert _finite(torch.tensor([5, -1], dtype=torch.int64), "I64")


def test_the_daemon_route_needs_the_control_token(tmp_path: Path) -> None:
    app = FastAPI()
    token = ensure_control_token(tmp_path)
    app.include_router(broadcast_router(object(), tmp_path, ControlGuard(token)))  # type: ignore[arg-type]
    c = TestClient(app, base_url="http://127.0.0.1")
    assert c.post("/v1/broadcast", json={}).status_code == 401
    assert c.post("/v1/broadcast", json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/v1/broadcast/x", headers={"Authorization": f"Bearer {token}", "Origin": "http://evil"}).status_code == 403
    assert c.get("/v1/broadcast/x", headers={"Authorization": f"Bearer {token}"}).status_code == 404
    r = c.post("/v1/broadcast", content=b"{not json", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code in (400, 422) and "JSON" in r.json()["error"]


def _answering(replies: list[tuple[int, dict[str, str]]]) -> tuple[Any, list[float]]:
    """A real HTTP server answering POSTs with `replies` in order (status, headers); the times asked."""
    import http.server
    import json as _json
    import threading
    import time as _time

    asked: list[float] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            asked.append(_time.monotonic())
            status, headers = replies[min(len(asked), len(replies)) - 1]
            body = _json.dumps({"session": "s1"} if status == 202 else {"error": f"busy {len(asked)}"}).encode()
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, asked


def test_the_trainer_asks_again_after_a_transient_refusal_and_not_after_a_final_one() -> None:
    from daemon.client.broadcast import BroadcastFailed, BroadcastPush

    server, asked = _answering([(409, {"Retry-After": "1"}), (503, {"Retry-After": "1"}), (202, {})])
    try:
        push = BroadcastPush(f"http://127.0.0.1:{server.server_port}", token="t", timeout_s=30)
        assert push._call("POST", "/v1/broadcast", {"version": "v1"}) == {"session": "s1"}
        assert len(asked) == 3 and asked[2] - asked[0] >= 1.5  # waited as told, twice
    finally:
        server.shutdown()
    server, asked = _answering([(409, {})])  # no Retry-After: final (e.g. the version is already recorded)
    try:
        push = BroadcastPush(f"http://127.0.0.1:{server.server_port}", token="t", timeout_s=30)
        with pytest.raises(BroadcastFailed, match="HTTP 409: busy 1"):
            push._call("POST", "/v1/broadcast", {"version": "v1"})
        assert len(asked) == 1
    finally:
        server.shutdown()
    server, asked = _answering([(409, {"Retry-After": "1"})])  # busy for longer than the trainer waits
    try:
        push = BroadcastPush(f"http://127.0.0.1:{server.server_port}", token="t", timeout_s=2.5)
        with pytest.raises(BroadcastFailed, match="HTTP 409"):
            push._call("POST", "/v1/broadcast", {"version": "v1"})
        assert 2 <= len(asked) <= 4
    finally:
        server.shutdown()


def test_only_transient_refusals_tell_the_trainer_when_to_ask_again() -> None:
    from daemon.api.broadcast import Refusal, refused

    assert refused(Refusal(409, "worker w0 is busy with a rollout; try again", retry_after_s=1)).headers["Retry-After"] == "1"
    assert "Retry-After" not in refused(Refusal(409, "version 'v1' is already recorded")).headers


def test_a_broadcast_waits_while_a_worker_is_not_running_as_the_daemon_knows_it(tmp_path: Path) -> None:
    """A worker the daemon holds UNCERTAIN (drift, waiting for the reconcile job) or has not heard
    from: the session is refused as transient, before anything is recorded or any lock kept."""
    from types import SimpleNamespace

    from daemon.api.broadcast import Broadcasts, Refusal
    from daemon.config import WorkerSpec
    from daemon.engines.builtin import BuiltinWorkerClient
    from daemon.rollout.states import WorkerHandle, WorkerState

    handles = [WorkerHandle(spec=WorkerSpec(name=n, url="http://127.0.0.1:9"), client=BuiltinWorkerClient(n, "http://127.0.0.1:9"),
                            url="http://127.0.0.1:9") for n in ("w0", "w1")]  # fmt: skip
    handles[0].observed(WorkerState.UNCERTAIN)
    recorded: list[str] = []
    journal = SimpleNamespace(checkpoint_by_version=lambda v: recorded.append(v) and None)
    service = SimpleNamespace(wait_ready=lambda t: True, fleet=handles, journal=journal,
                              settings=SimpleNamespace(broadcast_max_pause_s=60.0))
    sessions = Broadcasts(service, tmp_path)  # type: ignore[arg-type]
    body = {"version": "v9", "table": [{"name": "a", "dtype": "F32", "shape": [2]}], "master_address": "127.0.0.1",
            "master_port": 29500}  # fmt: skip
    with pytest.raises(Refusal, match="w0 is UNCERTAIN, w1 is not known yet") as refused:
        sessions.begin(body)
    assert refused.value.status_code == 409 and refused.value.retry_after_s is not None
    assert all(h.busy.acquire(blocking=False) for h in handles), "a refused session kept a worker's lock"
    assert not (tmp_path / "broadcast").exists()


def test_a_broadcast_takes_workers_by_their_declared_capability_never_by_class(tmp_path: Path) -> None:
    """Only clients with `capabilities.broadcast` join a session (a reference worker's client without
    it is refused like any other), and a client without it refuses `init_weight_group` itself."""
    import dataclasses
    from types import SimpleNamespace

    from daemon.api.broadcast import Broadcasts, Refusal
    from daemon.config import WorkerSpec
    from daemon.engines.base import WorkerError
    from daemon.engines.builtin import BuiltinWorkerClient
    from daemon.engines.sglang import SGLangWorkerClient
    from daemon.engines.vllm import VLLMWorkerClient
    from daemon.rollout.states import WorkerHandle, WorkerState

    class NoGroup(BuiltinWorkerClient):
        capabilities = dataclasses.replace(BuiltinWorkerClient.capabilities, broadcast=False)

    url = "http://127.0.0.1:9"
    clients = [BuiltinWorkerClient("w0", url), NoGroup("w1", url), VLLMWorkerClient("w2", url)]
    handles = [WorkerHandle(spec=WorkerSpec(name=c.name, url=url), client=c, url=url) for c in clients]  # type: ignore[arg-type]
    for h in handles:
        h.observed(WorkerState.RUNNING)
    service = SimpleNamespace(wait_ready=lambda t: True, fleet=handles, journal=SimpleNamespace(checkpoint_by_version=lambda v: None),
                              settings=SimpleNamespace(broadcast_max_pause_s=60.0))  # fmt: skip
    body = {"version": "v9", "table": [{"name": "a", "dtype": "F32", "shape": [2]}], "master_address": "127.0.0.1",
            "master_port": 29500}  # fmt: skip
    with pytest.raises(Refusal, match="w1, w2 are not") as refused:
        Broadcasts(service, tmp_path).begin(body)  # type: ignore[arg-type]
    assert refused.value.status_code == 409 and refused.value.retry_after_s is None
    assert all(h.busy.acquire(blocking=False) for h in handles) and not (tmp_path / "broadcast").exists()
    spec = GroupSpec("127.0.0.1", 29500, 1, 2, "gloo", "g", 5.0)
    for client in (VLLMWorkerClient("w2", url), SGLangWorkerClient("w3", url)):
        assert not client.capabilities.broadcast
        with pytest.raises(WorkerError, match=f"worker {client.name}: init_weight_group: .* cannot join a trainer's broadcast"):
            client.init_weight_group(spec, timeout_s=1.0)
    assert BuiltinWorkerClient.capabilities.broadcast and "broadcast" in BuiltinWorkerClient.capabilities.transports


def test_a_retry_after_that_lies_is_bounded_or_ignored() -> None:
    from daemon.client.broadcast import _retry_after_s

    assert _retry_after_s(None) is None and _retry_after_s("soon") is None and _retry_after_s("") is None
    assert _retry_after_s("nan") is None and _retry_after_s("inf") is None  # time.sleep(nan) would raise
    assert _retry_after_s("86400") == 10.0 and _retry_after_s("-5") == 0.1 and _retry_after_s("2") == 2.0
