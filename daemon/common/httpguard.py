"""Limits on what a client may hold open on one of our HTTP listeners (uvicorn has none of its own).

A flood of connections that send nothing (or half a request, slowly) held file descriptors
until the process could not open one more: the daemon's API stopped answering and a healthy
worker was taken for dead. Each listener runs its protocol through `guarded_protocol`:

    max_connections   at most this many open: a new connection beyond it closes the oldest one
                      still waiting for its request's headers (a flood churns itself, a client that
                      sends its request at once still gets in), or, when every open one is busy
                      with a request, is closed itself; a log line per burst says how many
    header_timeout_s  a connection must deliver each request's headers within this long of
                      opening (or of its previous response); otherwise it is closed (5 s)

On shutdown (a worker stopped for a relaunch, the daemon stopping) a keep-alive connection that
answered within the last `shutdown_grace_s` (1 s) stays open that long: its client reuses it at
once, and uvicorn's immediate close reset the request already on its way (a dropped request in a
managed relaunch). A request arriving then is answered with `Connection: close`.

Keep-alive between requests stays uvicorn's `timeout_keep_alive`. Request bodies are bounded
by each route (daemon.common.jsonbody, the push source's streaming writer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger("hotswap.httpguard")


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    max_connections: int = 256
    header_timeout_s: float = 5.0
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
    waiting: dict[Any, None] = field(default_factory=dict)  # connections before headers, oldest first


def guarded_protocol(limits: ListenerLimits, name: str) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with `limits` applied; pass it as `uvicorn.Config(http=...)`."""
    refusals = _Refusals()
    base: Any = AutoHTTPProtocol

    class Guarded(base):
        _deadline: asyncio.TimerHandle | None = None
        _cycle_seen: Any = None
        _idle_since = 0.0  # loop time of the connection's opening or its last answer
        _stopping = False

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                refusals.count += 1
                now = time.monotonic()
                if now - refusals.logged_at >= 10.0:
                    log.warning("%s: over %d connections open: closing idle ones (%d so far)", name,
                                limits.max_connections, refusals.count)
                    refusals.logged_at = now
                oldest = next(iter(refusals.waiting), None)
                if oldest is None:
                    transport.abort()  # every open connection is serving a request: this one waits outside
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

        def on_response_complete(self) -> None:
            super().on_response_complete()
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
            super().connection_lost(exc)

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

        def _drop(self) -> None:
            # close, never abort: an idle keep-alive connection gets a FIN its client sees before
            # reusing it (a reset there fails the client's next request); with nothing left to
            # send the socket, and its FD, are released at once either way
            self._disarm()
            self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def _last_on_connection(cycle: Any) -> None:
    """The request `cycle` serves is its connection's last: answered with `Connection: close`
    (uvicorn's h11 protocol closes without saying so), then closed."""
    cycle.keep_alive = False
    if not cycle.response_started and _CLOSE not in cycle.default_headers:
        cycle.default_headers = [*cycle.default_headers, _CLOSE]


_CLOSE = (b"connection", b"close")
