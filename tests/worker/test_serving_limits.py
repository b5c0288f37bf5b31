"""Hostile and careless serving clients against real worker processes (issue 10, finding 10 and 6):
oversized bodies, garbage JSON, out-of-range values, more requests than the worker holds, clients
that hang up, and /health + admin latency while all of that happens at once.

`w`: --max-batch 2 --max-queue 2 and 20 ms between scheduler steps (requests last long enough
to watch). `h`: default batch and queue, 16 MiB body cap so a 10 MB prompt reaches the prompt
check, for the hostile-load test.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from conftest import ThreadErrors, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support_worker import REPO, WorkerProcess, start_worker, write_token

from daemon.tinymodel import make_tiny_checkpoint


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("limits")
    make_tiny_checkpoint(r / "m", seed=6, tokenizer=True)
    write_token(r)
    return r


@pytest.fixture(scope="module")
def w(root: Path) -> Iterator[WorkerProcess]:
    proc = start_worker(root / "m", root / "token",
                        extra=["--max-batch", "2", "--max-queue", "2", "--step-delay-ms", "20"])
    yield proc
    proc.stop()


def _is_error_object(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and bool(err["message"])


def _raw(w: WorkerProcess, path: str, content: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    with w.client as c:
        return c.post(path, content=content, headers={"content-type": "application/json", **(headers or {})})


def _in_flight(w: WorkerProcess) -> int:
    return int(w.info()["in_flight"])


def _answer_while_sending(
    w: WorkerProcess, path: str, headers: dict[str, str], chunks: Iterator[bytes]
) -> tuple[int, bytes]:
    """Send a request's head, then its body piece by piece, and return the status (and the bytes
    read) of the answer the worker gives while the body is still coming: a refusal before the
    body is read. Fails when the connection closes with no answer, or no answer came at all."""
    host, port = w.url.removeprefix("http://").rsplit(":", 1)
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host, "Content-Type": "application/json", **headers}.items())
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode())
        for piece in (b"", *chunks):
            with contextlib.suppress(OSError):  # it answered and closed meanwhile: the answer is still to be read
                sock.sendall(piece)
            readable, _, _ = select.select([sock], [], [], 0.5 if piece else 2.0)
            if readable:
                answer = _read_answer(sock)
                assert answer.startswith(b"HTTP/1.1 "), answer[:200]  # an answer, not a reset or a close
                return int(answer.split()[1]), answer
    raise AssertionError(f"{path}: the whole body was sent and no answer came while sending")


def _read_answer(sock: socket.socket) -> bytes:
    """The whole answer: its head, then as many body bytes as its Content-Length says. The head
    and the body may arrive in separate segments, so one recv() is not the answer."""
    answer = b""
    while True:
        head, sep, body = answer.partition(b"\r\n\r\n")
        if sep:
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                           if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
            if len(body) >= length:
                return answer
        try:
            piece = sock.recv(65536)
        except OSError:  # reset after its answer: what came is the answer
            return answer
        if not piece:
            return answer
        answer += piece


def test_oversized_bodies_get_413_before_they_are_read(w: WorkerProcess) -> None:
    r = _raw(w, "/v1/completions", b"x" * (2 << 20))
    assert r.status_code == 413 and _is_error_object(r) and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(4):
            yield b" " * (1 << 20)

    # refused while the body is still arriving, not after reading it: with Content-Length (from the
    # header alone) and chunked (once the count passes the cap), 64 MiB offered, 1 MiB at a time
    big = 64 << 20
    status, _ = _answer_while_sending(w, "/v1/completions", {"Content-Length": str(big)},
                                      (b" " * (1 << 20) for _ in range(64)))  # fmt: skip
    assert status == 413
    chunked = (b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20)) for _ in range(64))
    status, answer = _answer_while_sending(w, "/v1/chat/completions", {"Transfer-Encoding": "chunked"}, chunked)
    assert status == 413 and b"request_too_large" in answer, answer[:300]
    assert w.get("/health").status_code == 200
    ok = w.post("/v1/completions", {"prompt": "fine", "max_tokens": 2})
    assert ok.status_code == 200


def test_admin_routes_take_bodies_larger_than_the_serving_cap(w: WorkerProcess) -> None:
    # an IPC descriptor of a large MoE model lists tens of thousands of tensors (MBs of JSON)
    big = json.dumps({"version": "x", "transport": "disk", "path": "/nonexistent", "pad": "p" * (2 << 20)})
    r = _raw(w, "/admin/update", big.encode(), headers=w.auth())
    assert r.status_code not in (413, 500) and "error" in r.json(), r.text[:300]
    assert _raw(w, "/admin/update", big.encode()).status_code == 401  # the token is checked first
    over = 65 << 20  # past the admin cap: refused from its Content-Length, before the body is read
    status, _ = _answer_while_sending(w, "/admin/update", {"Content-Length": str(over), **w.auth()},
                                      (b"x" * (1 << 20) for _ in range(65)))  # fmt: skip
    assert status == 413


HOSTILE_BODIES = [
    b"[" * 100_000 + b"]" * 100_000,  # nesting past the recursion limit
    b'{"prompt": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}",
    b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}",  # an int Python refuses to convert
    b'{"prompt": [1], "temperature": NaN}',
    b'{"prompt": [1], "max_tokens": 1e309}',
    b'\xff\xfe{"prompt": 1}',
    b"",
    b"[]",
    b"null",
    b'"prompt"',
]
HOSTILE_FIELDS: list[dict[str, Any]] = [
    {"prompt": [1, 2], "seed": 2**64},
    {"prompt": [1, 2], "seed": -(2**64)},
    {"prompt": [1, 2], "seed": "7"},
    {"prompt": [1, 2], "seed": 1.5},
    {"prompt": {"text": "x"}},
    {"prompt": [1.5, 2]},
    {"prompt": [[1, 2], [3]]},
    {"prompt": [True]},
    {"prompt": [-1]},
    {"prompt": [1], "max_tokens": "5"},
    {"prompt": [1], "max_tokens": -3},
    {"prompt": [1], "temperature": -1},
    {"prompt": [1], "top_p": 0},
    {"prompt": [1], "stream": 1},
    {"prompt": [1], "stream_options": "usage"},
    {"prompt": [1], "ignore_eos": "yes"},
    {"prompt": [1], "model": 7},
    {"prompt": [1], "frequency_penalty": 1e9},
    {"prompt": [1] * 600},  # longer than the context
    {"prompt": "a" * 100_000},  # longer than the context can hold in characters
]
HOSTILE_CHATS: list[dict[str, Any]] = [
    {"messages": "hi"},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [["user", "hi"]]},
    {"messages": [{"role": "user", "content": "x" * 100_000}]},
    {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
]


@pytest.mark.parametrize("body", HOSTILE_BODIES, ids=lambda b: repr(b[:24]))
def test_malformed_json_is_a_400_error_object(w: WorkerProcess, body: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = _raw(w, path, body)
        assert r.status_code == 400 and _is_error_object(r), (path, r.status_code, r.text[:300])


@pytest.mark.parametrize("body", HOSTILE_FIELDS + HOSTILE_CHATS, ids=lambda b: json.dumps(b)[:40])
def test_invalid_values_are_a_400_naming_the_field(w: WorkerProcess, body: dict[str, Any]) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    failed0 = w.info()["requests_failed"]
    r = w.post(path, body)
    assert r.status_code == 400 and _is_error_object(r), (r.status_code, r.text[:300])
    assert r.json()["error"]["param"] is not None
    # a client's mistake is never counted as the weights' failure (the health window reads this)
    assert w.info()["requests_failed"] == failed0


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)
FIELDS = st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "stream", "n",
                          "presence_penalty", "frequency_penalty", "stream_options", "model", "max_completion_tokens"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.dictionaries(FIELDS, JSON, max_size=6), chat=st.booleans())
def test_random_requests_never_get_a_500(w: WorkerProcess, doc: dict[str, Any], chat: bool) -> None:
    doc = {**doc, "max_tokens": 2} if "max_tokens" not in doc else doc
    with w.client as c:
        r = c.post("/v1/chat/completions" if chat else "/v1/completions", json=doc, timeout=60)
    assert r.status_code in (200, 400, 404, 429), (r.status_code, r.text[:300])
    assert r.status_code == 200 or _is_error_object(r)


def _stream_some(w: WorkerProcess, body: dict[str, Any], chunks: int) -> None:
    """Start a streaming completion, read `chunks` events, hang up."""
    with w.client as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= chunks:
                    break


def test_a_client_that_hangs_up_frees_its_sequence(w: WorkerProcess) -> None:
    long = {"prompt": [1, 5, 9], "max_tokens": 400, "ignore_eos": True}  # 400 steps x 20 ms = 8 s
    wait_until(lambda: _in_flight(w) == 0, 30, what="idle worker")
    _stream_some(w, long, 3)
    t0 = time.monotonic()
    wait_until(lambda: _in_flight(w) == 0, 4, what="the streamed sequence to be cancelled")
    print(f"stream cancelled {time.monotonic() - t0:.2f} s after the client hung up")
    # a non-streaming client that times out
    with w.client as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=long, timeout=0.5)
    wait_until(lambda: _in_flight(w) == 0, 4, what="the non-streaming sequence to be cancelled")


def test_more_requests_than_the_worker_holds_get_429_at_once(w: WorkerProcess, thread_errors: ThreadErrors) -> None:
    wait_until(lambda: _in_flight(w) == 0, 30, what="idle worker")
    body = {"prompt": [1, 5, 9], "max_tokens": 60, "ignore_eos": True}  # ~1.2 s each
    results: list[tuple[int, float, httpx.Response]] = []
    lock = threading.Lock()

    def go() -> None:
        t0 = time.monotonic()
        with w.client as c:
            r = c.post("/v1/completions", json=body, timeout=60)
        with lock:
            results.append((r.status_code, time.monotonic() - t0, r))

    threads = [threading.Thread(target=go) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    codes = sorted(code for code, _, _ in results)
    assert codes.count(200) >= 4 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    busy = [r for code, _, r in results if code == 429]
    assert all(_is_error_object(r) and r.json()["error"]["code"] == "server_busy" for r in busy)
    assert all(r.headers.get("retry-after") == "1" for r in busy)
    # refused without waiting behind the others (functional, generous: a served one takes >= 1.2 s)
    assert max(s for code, s, _ in results if code == 429) < min(s for code, s, _ in results if code == 200)
    assert w.post("/v1/completions", {"prompt": [1], "max_tokens": 2}).status_code == 200


# -- the stated bound: /health and admin within 100 ms under any serving load ---------------------------
@pytest.fixture(scope="module")
def h(root: Path) -> Iterator[WorkerProcess]:
    proc = start_worker(root / "m", root / "token", extra=["--max-body-bytes", str(16 << 20)])
    yield proc
    proc.stop()


def _poll(w: WorkerProcess, stop: threading.Event, out: dict[str, list[float]]) -> None:
    with httpx.Client(base_url=w.url, timeout=10) as c:
        while not stop.is_set():
            for name, path, headers in (("health", "/health", None), ("admin", "/weight_info", w.auth())):
                t0 = time.perf_counter()
                r = c.get(path, headers=headers)
                out[name].append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
            time.sleep(0.02)


def _summary(xs: list[float]) -> str:
    s = sorted(xs)
    return (f"n={len(s)} p50={s[len(s) // 2] * 1000:.1f} ms p99={s[int(len(s) * 0.99)] * 1000:.1f} ms "
            f"max={s[-1] * 1000:.1f} ms")


def test_health_and_admin_answer_while_hostile_clients_hit_the_worker(
    h: WorkerProcess, thread_errors: ThreadErrors
) -> None:
    """The product bound is 100 ms (issue 10). Asserted here as p100 < 1 s on a shared 2-core CI
    machine: generous against scheduler noise, yet a blocked event loop (16 s before this work)
    fails it. The measured figures are printed. A /health or admin answer other than 200 (or an
    error) in the poller thread fails the test (`thread_errors`)."""
    idle: dict[str, list[float]] = {"health": [], "admin": []}
    stop = threading.Event()
    t = threading.Thread(target=_poll, args=(h, stop, idle))
    t.start()
    time.sleep(1.0)
    stop.set()
    t.join()

    under: dict[str, list[float]] = {"health": [], "admin": []}
    stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(h, stop, under))
    load = subprocess.Popen([sys.executable, str(REPO / "tests" / "support_hostile.py"), h.url, "200"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    poller.start()
    try:
        out, err = load.communicate(timeout=240)
    finally:
        stop.set()
        poller.join(30)
    thread_errors.check()  # a poller that died early would leave few samples: say why first
    assert load.returncode == 0, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    print(f"\nhostile load: {result}")
    for name in ("health", "admin"):
        print(f"{name:6s} idle:       {_summary(idle[name])}")
        print(f"{name:6s} under load: {_summary(under[name])}")
    assert result["body_100mb"] == "413" or result["body_100mb"].startswith("closed:"), result
    assert result["chunked_100mb"] == "413" or result["chunked_100mb"].startswith("closed:"), result
    assert result["prompt_10mb"] == "400:context_length_exceeded", result
    assert set(result["concurrent"]) <= {"200", "429"} and result["concurrent"].get("200", 0) >= 8, result
    assert len(under["health"]) >= 20, "the poller barely ran"
    assert max(under["health"]) < 1.0 and max(under["admin"]) < 1.0
    rss = psutil.Process(h.proc.pid).memory_info().rss
    print(f"worker RSS after the load: {rss / 1e6:.0f} MB")
    assert rss < 1.5e9  # a 10 MB prompt once left 2.4 GB
    assert h.post("/v1/completions", {"prompt": "still serving", "max_tokens": 2}).status_code == 200
