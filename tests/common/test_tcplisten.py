"""Our HTTP servers answer without Nagle's delay: every accepted connection has TCP_NODELAY.

Without it each response's second write waited for the client's delayed ACK (~40 ms a call on
Linux loopback), inside every rollout's pause window (pause, update, weight_info, resume)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from fastapi import FastAPI

from daemon.api.app import ApiServer
from daemon.common.tcplisten import tcp_listener
from daemon.worker.server import bind_tcp

pytestmark = pytest.mark.quick


def _accepted_nodelay(listener: socket.socket) -> int:
    """Accept one connection through asyncio (as uvicorn does) and read TCP_NODELAY on it."""
    seen: list[int] = []

    async def run() -> None:
        def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_conn, sock=listener)
        host, port = listener.getsockname()[:2]
        _, w = await asyncio.open_connection(host, port)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        w.close()
        server.close()

    asyncio.run(run())
    assert seen, "no connection accepted"
    return seen[0]


def test_connections_accepted_from_our_listener_have_nodelay() -> None:
    assert _accepted_nodelay(tcp_listener("127.0.0.1", 0)) == 1


def test_a_plain_socket_would_not_have_it() -> None:
    """The case the listener exists for (if asyncio ever sets it itself, this test says so)."""
    plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    plain.bind(("127.0.0.1", 0))
    assert _accepted_nodelay(plain) == 0


def test_the_daemon_api_and_the_worker_listen_with_nodelay() -> None:
    api = ApiServer(FastAPI(), "127.0.0.1", 0)
    try:
        assert api.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        api.sock.close()
    worker = bind_tcp("127.0.0.1", 0)
    try:
        assert _accepted_nodelay(worker) == 1
    finally:
        worker.close()


def test_a_busy_port_is_still_an_oserror() -> None:
    held = tcp_listener("127.0.0.1", 0)
    held.listen(1)
    try:
        with pytest.raises(OSError):
            tcp_listener("127.0.0.1", held.getsockname()[1]).close()
    finally:
        held.close()
