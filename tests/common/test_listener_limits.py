"""Our HTTP listeners bound what clients hold open (daemon.common.httpguard): a flood of idle or
half-sent connections churns itself instead of exhausting file descriptors, a client that sends
its request at once still gets an answer, and a slow sender is cut off; identical log lines in a
tight loop stay a few lines (daemon.common.logging.RepeatFilter)."""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import support_listener
from conftest import wait_until
from support_listener import serving

from daemon.common.httpguard import ListenerLimits
from daemon.common.logging import configure_logging, get_logger

pytestmark = pytest.mark.quick


@pytest.fixture
def server() -> Iterator[tuple[str, int]]:
    with serving(ListenerLimits(max_connections=20, header_timeout_s=1.0)) as (_, _, port):
        yield "127.0.0.1", port


def _closed_by_peer(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_flood_of_idle_connections_is_churned_and_a_real_request_still_gets_in() -> None:
    # A header timeout far beyond the test: the idle flood stays held until a newcomer evicts it,
    # and a stall of this process (client and server share it) between a request's connect and
    # its send is not taken for a slow client (with 1 s it was, once, on a loaded CI host: reset).
    with serving(ListenerLimits(max_connections=20, header_timeout_s=60.0)) as (_, _, port):
        host = "127.0.0.1"
        idle = [socket.create_connection((host, port)) for _ in range(200)]
        try:
            # every one accepted: 20 held, 180 closed, each by a newcomer over the cap
            closed: set[int] = set()

            def count_closed() -> int:
                closed.update(i for i, s in enumerate(idle) if i not in closed and _closed_by_peer(s, 0.001))
                return len(closed)

            wait_until(lambda: count_closed() >= 180, 60, 0.05, "the server to take in the whole flood")
            assert count_closed() == 180, "more than the cap's excess closed"
            # with 20 idle connections held against a cap of 20, a request sent at once is answered:
            # it closes the oldest idle one to get in
            for _ in range(5):
                assert httpx.get(f"http://{host}:{port}/ping", timeout=10).json() == {"ok": True}
            wait_until(lambda: count_closed() >= 181, 30, 0.05, "an idle connection closed for the request")
            still_open = [s for i, s in enumerate(idle) if i not in closed]
            assert len(still_open) <= 19, f"{len(still_open)} idle connections still held by the server"
        finally:
            for s in idle:
                s.close()


def test_a_request_sent_at_once_survives_a_burst_from_its_own_address() -> None:
    """asyncio accepts a whole backlog before it reads any connection: a request queued first,
    followed by more idle connections from its address than its cap, was closed unread (reset)."""
    with serving(ListenerLimits(max_connections=64, max_per_address=4)) as (_, _, port):
        support_listener.stalled.clear()
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30)
        stall = threading.Thread(target=lambda: other.get(f"http://127.0.0.1:{port}/stall", params={"s": 1.0}))
        stall.start()
        idle: list[socket.socket] = []
        try:
            assert support_listener.stalled.wait(30)
            # the loop is blocked: these queue in the kernel, the request first, in one accept burst
            first = socket.create_connection(("127.0.0.1", port))
            first.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
            first.settimeout(30)
            answer = b""
            while chunk := first.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer
            first.close()
        finally:
            stall.join(timeout=30)
            other.close()
            for s in idle:
                s.close()


def test_a_client_that_never_finishes_its_headers_is_cut_off(server) -> None:
    host, port = server
    slow = socket.create_connection((host, port))
    try:
        slow.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        t0 = time.monotonic()
        assert _closed_by_peer(slow, 30), "a half-sent request was held open"
        waited = time.monotonic() - t0
        assert waited >= 0.5, f"closed after {waited:.2f} s: before its header timeout"
    finally:
        slow.close()
    # and a connection that answered stays usable for the next request (keep-alive)
    with httpx.Client(base_url=f"http://{host}:{port}") as c:
        assert c.get("/ping").status_code == 200 and c.get("/ping").status_code == 200


def test_identical_log_lines_in_a_tight_loop_stay_a_few_lines() -> None:
    out = io.StringIO()
    configure_logging("info", stream=out, json=True)
    try:
        log = get_logger("hotswap.test")
        for _ in range(5000):
            log.error("accept failed", error="[Errno 24] Too many open files")
            logging.getLogger("asyncio").error("socket.accept() out of system resource")
        for i in range(7):  # lines that differ in a field are all kept (one check's seven "check" lines)
            log.info("check", name=f"c{i}")
        lines = out.getvalue().splitlines()
        assert 2 <= len(lines) - 7 <= 20, len(lines)
        assert sum('"check"' in line for line in lines) == 7
    finally:
        configure_logging("info")

