"""A listener that stops (a managed worker stopped for its relaunch, the daemon stopping) does not
reset the request its client is sending on a keep-alive connection that just answered
(daemon.common.httpguard `shutdown_grace_s`). uvicorn alone closed every idle connection at
once: a load generator reusing its connection lost one request in a relaunch (CI, 1 of 46)."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from contextlib import AbstractContextManager

import pytest
import uvicorn
from support_listener import serving as serving_with

from daemon.common.httpguard import ListenerLimits


def serving(grace_s: float) -> AbstractContextManager[tuple[uvicorn.Server, threading.Thread, int]]:
    return serving_with(ListenerLimits(max_connections=20, header_timeout_s=60.0, shutdown_grace_s=grace_s))


def _stop_accepting(srv: uvicorn.Server, port: int) -> None:
    """Ask the server to stop and wait until it has: its listening socket refuses connections
    (uvicorn closes it in the same step as it shuts the open connections down)."""
    srv.should_exit = True
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return
        time.sleep(0.01)
    pytest.fail("the server kept accepting connections 30 s after it was asked to stop")


def test_a_request_on_a_connection_that_just_answered_is_served_while_the_server_stops() -> None:
    with serving(grace_s=60.0) as (srv, t, port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/ping")
        first = conn.getresponse()
        assert first.status == 200 and first.read() == b'{"ok":true}'
        _stop_accepting(srv, port)
        conn.request("GET", "/ping")  # the client reuses its keep-alive connection, as pools do
        second = conn.getresponse()
        assert second.status == 200 and second.read() == b'{"ok":true}'
        assert second.getheader("connection") == "close", second.getheaders()
        conn.close()
        t.join(timeout=30)
        assert not t.is_alive(), "the server did not finish stopping after its last connection closed"


def test_a_connection_idle_past_the_grace_is_closed_at_once_when_the_server_stops() -> None:
    with serving(grace_s=0.2) as (srv, t, port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/ping")
        assert conn.getresponse().read() == b'{"ok":true}'
        time.sleep(0.5)  # idle longer than the grace: nothing is on its way
        srv.should_exit = True
        t.join(timeout=30)
        assert not t.is_alive(), "an idle connection held the stopping server"
        assert conn.sock is not None
        conn.sock.settimeout(5)
        assert conn.sock.recv(1) == b"", "the idle connection is still open after the server stopped"
        conn.close()
