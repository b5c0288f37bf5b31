"""Slow bodies and one client's share of a listener (daemon.common.httpguard, issue 37 item 1), on
a real uvicorn server and real sockets from several loopback addresses (127.0.0.x are all local).

- connections that send a complete header and then a body byte now and then hold their slots only
  until the body is late (the header timeout plus its length at `min_body_rate`); after that a
  new client takes the slot of the oldest late one;
- one address holds at most `max_per_address` connections: a flood from one address leaves the
  listener to everyone else at once.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import httpx
from conftest import wait_until
from support_listener import serving

from daemon.common.httpguard import ListenerLimits

HEAD = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n"


def _slow_bodies(port: int, n: int, source: str, length: int) -> list[socket.socket]:
    """`n` connections from `source`, each with its header sent and one byte of a `length`-byte body."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.bind((source, 0))
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(HEAD % length + b"x")
        except OSError:
            s.close()
            continue
        out.append(s)
    return out


def _closed(s: socket.socket) -> bool:
    s.settimeout(0.01)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


@contextlib.contextmanager
def _closing(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


def _answered(port: int) -> bool:
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/echo", content=b"abc", timeout=2)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and r.json() == {"bytes": 3}


def test_late_bodies_give_up_their_slots_to_a_client_that_sends_at_once() -> None:
    limits = ListenerLimits(max_connections=20, header_timeout_s=1.0, min_body_rate=1000.0, max_per_address=10)
    with serving(limits) as (_, _, port):
        flood: list[socket.socket] = []
        for source in ("127.0.0.2", "127.0.0.3"):  # 2 x 10: every slot, each body due 1 s + 2 s after it opened
            flood += _slow_bodies(port, 10, source, 2000)
        with _closing(flood):
            assert not any(_closed(s) for s in flood), "a slow body was cut off before it was late"
            # while every body is still on time, a new client finds no slot
            assert not _answered(port)
            # once they are late, it takes the oldest one's slot
            wait_until(lambda: _answered(port), 30, what="a well-behaved client answered", interval=0.2)
            assert sum(_closed(s) for s in flood) >= 1, "no late connection gave up its slot"


def test_one_address_holds_its_share_and_everyone_else_gets_in() -> None:
    limits = ListenerLimits(max_connections=200, header_timeout_s=30.0, max_per_address=8)
    with serving(limits) as (_, _, port), _closing(_slow_bodies(port, 50, "127.0.0.4", 10_000_000)) as flood:
        wait_until(lambda: sum(not _closed(s) for s in flood) <= 8, 10, what="the address's share enforced")
        assert _answered(port), "a client from another address was not answered"
        held = [s for s in flood if not _closed(s)]
        assert len(held) == 8, f"{len(held)} held from one address"
