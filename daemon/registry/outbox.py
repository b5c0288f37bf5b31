"""Writes the database could not take, kept in order and written once it can.

A worker's transition must never wait on the database: a rollout that cannot record its next
step would leave the worker drained or paused, out of rotation, for as long as the database is
down (PostgreSQL restarting, an SQLite file made read-only, its disk full). So the journal's
writes that record what already happened (transitions, observations, a rollout's end, aliases,
statuses) go through `deferrable`: when the database refuses the write for being unreachable or
unwritable, the write is kept here, the caller goes on from its in-memory truth, and the kept
writes are replayed in their order (each with the time it happened) before any later write, and
on the health monitor's tick. `pending()` and `last_error` make it a problem in `/health`.

Only outages are deferred (`unreachable`): an integrity error is a bug and still raises.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from daemon.common import get_logger

log = get_logger(__name__)
P = ParamSpec("P")
R = TypeVar("R")
MAX_KEPT = 100_000  # a week of a busy host's polls; beyond it the oldest are dropped (logged)


def unreachable(exc: BaseException) -> bool:
    """The database is down, unreachable, read-only or out of space (not a bug in the write)."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


class Outbox:
    def __init__(self) -> None:
        self._items: deque[tuple[str, float, Callable[[], object]]] = deque()
        self._lock = threading.RLock()  # a replayed write is itself deferrable: same thread re-enters
        self._replaying = False
        self.last_error: str | None = None
        self.since: float | None = None  # Unix time of the oldest kept write
        self.dropped = 0

    def pending(self) -> int:
        return len(self._items)

    def keep(self, what: str, write: Callable[[], object], exc: BaseException) -> None:
        with self._lock:
            if len(self._items) >= MAX_KEPT:
                self._items.popleft()
                self.dropped += 1
            self._items.append((what, time.time(), write))
            self.since = self.since or time.time()
            first = self.last_error is None
            self.last_error = " ".join(str(getattr(exc, "orig", None) or exc).split())[:300]
        if first:
            log.warning("database_write_deferred", write=what, error=self.last_error)

    def flush(self) -> bool:
        """Replay the kept writes in order; True when none is left (stops at the first refusal)."""
        with self._lock:
            if self._replaying:
                return not self._items
            self._replaying = True
            try:
                n = 0
                while self._items:
                    what, _, write = self._items[0]
                    try:
                        write()
                    except Exception as exc:
                        if not unreachable(exc):
                            log.exception("deferred_write_failed", write=what)  # a bug: never blocks the rest
                            self._items.popleft()
                            continue
                        self.last_error = " ".join(str(getattr(exc, "orig", None) or exc).split())[:300]
                        return False
                    self._items.popleft()
                    n += 1
                if n or self.last_error:
                    log.info("deferred_writes_recorded", writes=n, dropped=self.dropped)
                self.last_error, self.since = None, None
                return True
            finally:
                self._replaying = False


def deferrable(fn: Callable[P, R]) -> Callable[P, R | None]:
    """A journal write that is kept for later (returning None) while the database is out; one
    that takes `at` is given the time it was called, so its row says when it happened."""
    takes_at = "at" in inspect.signature(fn).parameters

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
        box: Outbox | None = getattr(getattr(args[0], "registry", None), "outbox", None)
        if box is None:
            return fn(*args, **kwargs)
        if takes_at and kwargs.get("at") is None:
            from daemon.registry.models import utcnow

            kwargs["at"] = utcnow()
        call = functools.partial(fn, *args, **kwargs)
        if box.pending() and not box.flush():
            box.keep(fn.__name__, call, RuntimeError(box.last_error or "database unreachable"))
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not unreachable(exc):
                raise
            box.keep(fn.__name__, call, exc)
            return None

    return wrapper
