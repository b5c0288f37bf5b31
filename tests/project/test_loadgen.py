"""The load generator counts what a client would: a 200 whose body is not a completion (not JSON,
or JSON without `choices`) is a failed request, not a success. Real HTTP servers on loopback
(http.server), each answering every completion one way."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import wait_until

from bench.loadgen import LoadGen

pytestmark = pytest.mark.quick

BODIES = {
    "completion": b'{"choices": [{"text": "ok"}], "weight_version": "v1"}',
    "html": b"<html>502 Bad Gateway</html>",
    "no_choices": b'{"error": null}',
    "truncated": b'{"choices": [{"text": "o',
}


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[str]:
    body = BODIES[request.param]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # /ready
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:  # /v1/completions
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("server", ["html", "no_choices", "truncated"], indirect=True)
def test_a_200_that_is_not_a_completion_is_a_failed_request(server: str) -> None:
    load = LoadGen([server], concurrency=1, max_requests=5, max_seconds=30)
    load.start()
    wait_until(lambda: load.stats.ok + load.stats.failed == 5, 30, 0.02, "5 answers")
    load.stop()
    assert (load.stats.ok, load.stats.failed) == (0, 5), load.stats.errors
    assert "HTTP 200 without a completion" in load.stats.errors[0]


@pytest.mark.parametrize("server", ["completion"], indirect=True)
def test_a_completion_is_counted_with_its_version(server: str) -> None:
    load = LoadGen([server], concurrency=1, max_requests=5, max_seconds=30)
    load.start()
    load.wait_requests(5, timeout=30)
    load.stop()
    assert (load.stats.ok, load.stats.failed, dict(load.stats.versions)) == (5, 0, {"v1": 5})


@pytest.mark.parametrize("server", ["completion"], indirect=True)
def test_waiting_for_requests_a_stopped_load_cannot_send_names_why_at_once(server: str) -> None:
    """A test whose load ran out of requests (a fixed cap, a slow rollout) is told so, not timed out."""
    load = LoadGen([server], concurrency=1, max_requests=3, max_seconds=30)
    load.start()
    with pytest.raises(RuntimeError, match=r"stopped sending after 3 requests \(max_requests 3 reached\); 3 of 5"):
        load.wait_requests(5, timeout=300)
    load.stop()


def _serve(ready: int, drop: bool) -> tuple[ThreadingHTTPServer, str]:
    """/ready answers `ready`; a completion is answered, or (drop) the connection closed unanswered."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(ready)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if drop:
                self.close_connection = True
                return
            body = BODIES["completion"]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.mark.parametrize("dropper_ready", [False, True])
def test_a_connection_error_is_tried_on_the_next_worker_only_from_a_worker_that_was_not_ready(dropper_ready: bool) -> None:
    """No worker ready (a readiness probe timed out on a busy host): a request still goes out, and a
    worker that was not ready dropping it is no failure; a ready worker dropping it is one."""
    import httpx

    dropper, drop_url = _serve(200, drop=True)
    other, other_url = _serve(200, drop=False)
    try:
        load = LoadGen([drop_url, other_url], concurrency=1, max_seconds=30)
        load._ready = {drop_url: dropper_ready, other_url: False}  # as the readiness loop last saw them
        with httpx.Client(timeout=10) as client:
            for _ in range(4):  # round-robin: two of the four go to the dropper first
                load._one(client)
        if dropper_ready:  # the dropper is tried first every time (ready first), and fails each
            assert (load.stats.ok, load.stats.failed, load.stats.retried_unready) == (0, 4, 0), load.stats.errors
        else:
            assert (load.stats.ok, load.stats.failed, load.stats.retried_unready) == (4, 0, 2), load.stats.errors
    finally:
        for srv in (dropper, other):
            srv.shutdown()
            srv.server_close()
