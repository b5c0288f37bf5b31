"""Limits on what a client may hold open on one of our HTTP listeners (uvicorn has none of its own).

A flood of connections that send nothing (or half a request, slowly) held file descriptors
until the process could not open one more: the daemon's API stopped answering and a healthy
worker was taken for dead. Each listener runs its protocol through `guarded_protocol`:

    max_connections   at most this many open: a new connection beyond it closes the oldest one
                      still waiting for its request's headers (a flood churns itself, a client that
                      sends its request at once still gets in), or, when every open one is busy
                      with a request, is closed itself; a log line per burst says how many. One
                      whose request is already in its socket, not yet read, is not closed: asyncio
                      accepts a whole backlog of connections before it reads any of them, and in a
                      burst from one address the request sent first was closed unread (its client
                      saw a reset)
    header_timeout_s  a connection must deliver each request's headers within this long of
                      opening (or of its previous response); otherwise it is closed (5 s)
    min_body_rate     a request's body must be in within header_timeout_s plus its length at this
                      many bytes a second (a chunked body: what has arrived so far at that rate); a
                      body later than that makes its connection evictable like one waiting for
                      headers (1,100 connections each sending a header, then a body byte every 2 s,
                      held every slot of a worker's serving port)
    max_per_address   at most this many open from one client address (TCP peers; a Unix socket's
                      peers are one user): a new one beyond it closes that address's oldest
                      evictable connection, or is closed itself, so one client cannot take the
                      listener from the others

On shutdown (a worker stopped for a relaunch, the daemon stopping) a keep-alive connection that
answered within the last `shutdown_grace_s` (1 s) stays open that long: its client reuses it at
once, and uvicorn's immediate close reset the request already on its way (a dropped request in a
managed relaunch). A request arriving then is answered with `Connection: close`.

Keep-alive between requests stays uvicorn's `timeout_keep_alive`. Request bodies are bounded
by each route (daemon.common.jsonbody, the push source's streaming writer).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import struct
import termios
import time
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger("hotswap.httpguard")


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    max_connections: int = 256
    header_timeout_s: float = 5.0
    min_body_rate: float = 32 * 1024  # bytes a second
    max_per_address: int = 64
    # how long after its last answer an idle keep-alive connection may still carry a request
    shutdown_grace_s: float = 1.0

    @property
    def backlog(self) -> int:
        """For `uvicorn.Config(backlog=...)`: asyncio accepts up to this many connections in one go
        before any of them is looked at; uvicorn's 2048 took every FD of a 1024-FD process at once."""
        return min(self.max_connections, 128)


@dataclass
class _Refusals:
    count: int = 0
    logged_at: float = 0.0
    waiting: dict[Any, None] = field(default_factory=dict)  # evictable connections, oldest first
    by_address: dict[str, dict[Any, None]] = field(default_factory=dict)  # open connections per TCP peer
    # closed by us, not yet lost: still in uvicorn's set until the loop runs their connection_lost,
    # which in a burst comes after later connections' connection_made; not counted as open
    gone: dict[Any, None] = field(default_factory=dict)

    def note(self, name: str, limits: ListenerLimits, what: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.logged_at >= 10.0:
            log.warning("%s: %s: closing idle or late ones (%d so far)", name, what, self.count)
            self.logged_at = now

    def evictable(self, address: str | None = None) -> Any:
        """The oldest connection to close for a newcomer (of `address` when given), or None."""
        return next((c for c in self.waiting if (address is None or c._address == address) and not c._unread()), None)


def _peer_address(transport: asyncio.BaseTransport) -> str | None:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


def guarded_protocol(limits: ListenerLimits, name: str) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with `limits` applied; pass it as `uvicorn.Config(http=...)`."""
    refusals = _Refusals()
    base: Any = AutoHTTPProtocol

    class Guarded(base):
        _deadline: asyncio.TimerHandle | None = None
        _body_deadline: asyncio.TimerHandle | None = None
        _body_due = 0.0  # loop time the request's body must be in by (Content-Length)
        _body_chunked = False
        _body_seen = 0  # bytes received since the request's headers
        _address: str | None = None
        _cycle_seen: Any = None
        _idle_since = 0.0  # loop time of the connection's opening or its last answer
        _stopping = False

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._address = _peer_address(transport)
            if self._address is not None:
                mine = refusals.by_address.setdefault(self._address, {})
                if len(mine) >= limits.max_per_address:
                    refusals.note(name, limits, f"over {limits.max_per_address} connections from {self._address}")
                    oldest = refusals.evictable(self._address)
                    if oldest is None:
                        self._refuse()  # this address holds its share, all busy: it waits outside
                        return
                    oldest._drop()
                mine[self] = None
            if len(self.connections) - len(refusals.gone) > limits.max_connections:
                refusals.note(name, limits, f"over {limits.max_connections} connections open")
                oldest = refusals.evictable()
                if oldest is None:
                    self._refuse()  # every open connection is serving a request: this one waits outside
                    return
                oldest._drop()
            self._idle_since = self.loop.time()
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._cycle_seen:
                self._cycle_seen = self.cycle  # this request's headers are in: the app has it
                self._disarm()
                if self._stopping:
                    _last_on_connection(self.cycle)
                if self.cycle.more_body:
                    self._arm_body()
            elif self._body_deadline is not None:
                self._body_seen += len(data)
            if self._body_deadline is not None and self.cycle is not None and not self.cycle.more_body:
                self._disarm_body()  # the whole body is in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm_body()  # answered before its body was read (a 413, say)
            self._idle_since = self.loop.time()
            self._arm()  # the next request's headers are due within the timeout too
            if self._stopping and self.cycle is not None and not self.cycle.response_complete:
                _last_on_connection(self.cycle)  # a pipelined request started by the answer above

        def shutdown(self) -> None:
            self._stopping = True
            if self.cycle is not None and not self.cycle.response_complete:
                _last_on_connection(self.cycle)
                return
            grace = self._idle_since + limits.shutdown_grace_s - self.loop.time()
            if grace > 0:  # recently active: its client's next request may be on its way
                self.loop.call_later(grace, self._close_if_idle)
                return
            super().shutdown()

        def _close_if_idle(self) -> None:
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                super().shutdown()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._disarm_body()
            self._forget_address()
            refusals.gone.pop(self, None)
            super().connection_lost(exc)

        def _forget_address(self) -> None:
            if self._address is not None:
                mine = refusals.by_address.get(self._address, {})
                mine.pop(self, None)
                if not mine:
                    refusals.by_address.pop(self._address, None)
                self._address = None

        def _refuse(self) -> None:
            self._forget_address()
            refusals.gone[self] = None
            self.transport.abort()

        def _arm_body(self) -> None:
            """The body is due within the header timeout plus its length at `min_body_rate`,
            counted from the request's start (the connection's opening or its last answer)."""
            length = _content_length(self.headers)
            self._body_chunked, self._body_seen = length is None, 0
            self._body_due = self._idle_since + limits.header_timeout_s + (length or 0) / limits.min_body_rate
            self._body_deadline = self.loop.call_at(max(self._body_due, self.loop.time()), self._body_late)

        def _disarm_body(self) -> None:
            if self._body_deadline is not None:
                self._body_deadline.cancel()
                self._body_deadline = None
                refusals.waiting.pop(self, None)

        def _body_late(self) -> None:
            cycle = self.cycle
            if cycle is None or cycle is not self._cycle_seen or not cycle.more_body:
                self._body_deadline = None
                return
            if self._body_chunked:  # no length said: what has arrived so far earns its time
                due = self._body_due + self._body_seen / limits.min_body_rate
                if due > self.loop.time():
                    self._body_deadline = self.loop.call_at(due, self._body_late)
                    return
            self._body_deadline = None
            refusals.waiting[self] = None  # late: the next connection over a cap closes it first

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(limits.header_timeout_s, self._too_slow)
            refusals.waiting[self] = None

        def _disarm(self) -> None:
            refusals.waiting.pop(self, None)
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.cycle is None or self.cycle is self._cycle_seen and self.cycle.response_complete:
                self._drop()

        def _unread(self) -> bool:
            """Bytes wait in this connection's socket that the loop has not read yet."""
            sock = self.transport.get_extra_info("socket") if self.transport is not None else None
            if sock is None:
                return False
            try:
                waiting: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
                return waiting > 0
            except (OSError, ValueError):
                return False

        def _drop(self) -> None:
            # close, never abort: an idle keep-alive connection gets a FIN its client sees before
            # reusing it (a reset there fails the client's next request); with nothing left to
            # send the socket, and its FD, are released at once either way
            self._disarm()
            self._forget_address()  # no longer one of its address's share, nor open (`gone`)
            refusals.gone[self] = None
            self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def _content_length(headers: list[tuple[bytes, bytes]] | None) -> int | None:
    """The request's Content-Length (None: chunked or not said)."""
    for key, value in headers or ():
        if key == b"content-length":
            try:
                return max(int(value), 0)
            except ValueError:
                return None
    return None


def _last_on_connection(cycle: Any) -> None:
    """The request `cycle` serves is its connection's last: answered with `Connection: close`
    (uvicorn's h11 protocol closes without saying so), then closed."""
    cycle.keep_alive = False
    if not cycle.response_started and _CLOSE not in cycle.default_headers:
        cycle.default_headers = [*cycle.default_headers, _CLOSE]


_CLOSE = (b"connection", b"close")
