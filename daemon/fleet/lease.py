"""The fleet-wide bound on hosts updating at once: lease rows in PostgreSQL.

`fleet_leases` has one row per slot (`[fleet] max_updating_hosts` of them). A host that wants
to roll out takes a free slot with `SELECT ... FOR UPDATE SKIP LOCKED` (two hosts never take
the same row, and neither waits on the other's transaction), writes its name and an expiry
(the database's clock + `lease_s`), and renews it from a thread while it updates. Releasing
clears the row. A daemon that dies holding a slot stops renewing: the slot is free again once
its expiry passes, so a SIGKILL costs the fleet at most `lease_s`.

A host waiting for a slot asks again after `WAIT_POLL_S`, then twice as long each time (with
jitter) up to `WAIT_POLL_S` x the bound, and never less often than every `poll_s`: a thousand
waiting hosts would otherwise send 2,000 transactions a second. With W waiters a freed slot is
taken after about cap / W; at the end of a rollout, when about `bound` hosts still wait, that is
WAIT_POLL_S at worst, as before (a small bound keeps the short interval: few slots, few
waiters). The slot rows are written at the first attempt of each wait (and when the bound
grows), not on every attempt.

Every acquisition and release is also an event (`fleet_lease_acquired` / `_released`, detail
with the slot and host), so when each host updated is in `events`.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from daemon.common import get_logger
from daemon.fleet.settings import FleetSettings
from daemon.registry import FleetLease, Registry, record_event, utcnow

log = get_logger(__name__)

# A lease is written `lease_s` ahead and renewed well before it runs out; one further ahead than
# LEASE_AHEAD_FACTOR times that was not written by a daemon and is taken as free (a slot is never
# blocked by a forged or corrupt row); readers that know no lease_s bound what they load by a day.
LEASE_AHEAD_FACTOR = 3
LEASE_READ_MAX_S = 24 * 3600
WAIT_POLL_S = 0.5  # a waiting host's first ask again; then doubling (FleetLeases.wait_cap_s)
STOP_CHECK_S = 0.5  # a waiting host notices its daemon stopping within this


class LeaseLost(RuntimeError):
    """Another host took this host's slot (it expired before a renewal reached the database)."""


class FleetLeases:
    """This host's view of the lease slots; thread-safe (one rollout at a time holds a slot)."""

    def __init__(self, registry: Registry, settings: FleetSettings) -> None:
        self.registry = registry
        self.settings = settings
        self.host = registry.host
        self._lock = threading.Lock()
        self._slot: int | None = None
        self._depth = 0  # nested holds (crash recovery that runs a rollout) share one slot
        self._lost = False
        self._slots_made = 0  # slot rows known to exist (written once a wait, not on every attempt)
        self._jitter = random.Random()

    @property
    def slot(self) -> int | None:
        with self._lock:
            return self._slot

    @property
    def lost(self) -> bool:
        with self._lock:
            return self._lost

    def _lease(self) -> Any:
        return func.now() + timedelta(seconds=self.settings.lease_s)

    def try_acquire(self, version: str | None = None, checkpoint_id: int | None = None) -> int | None:
        """Take a free (or expired, or already this host's) slot; its number, else None."""
        with self._lock:
            if self._slot is not None:  # held already (a nested hold): the same slot
                self._depth += 1
                return self._slot
        n = self.settings.max_updating_hosts
        with self.registry.session() as s:
            if self._slots_made < n:  # first attempt of a wait, or the bound grew
                s.execute(pg_insert(FleetLease).values([{"slot": i} for i in range(n)]).on_conflict_do_nothing())
                s.flush()
            slot = s.scalar(
                select(FleetLease.slot)
                .where(
                    FleetLease.slot < n,
                    or_(FleetLease.host.is_(None), FleetLease.host == self.host, FleetLease.expires_at < func.now(),
                        # further ahead than any renewal writes ('infinity', a century): not a lease
                        FleetLease.expires_at > utcnow() + timedelta(seconds=LEASE_AHEAD_FACTOR * self.settings.lease_s)),
                )
                .order_by((FleetLease.host == self.host).desc(), FleetLease.slot)
                .limit(1)
                .with_for_update(skip_locked=True)
            )
            self._slots_made = max(self._slots_made, n)
            if slot is None:
                return None
            s.execute(update(FleetLease).where(FleetLease.slot == slot).values(
                host=self.host, version=version, acquired_at=func.now(), expires_at=self._lease()))  # fmt: skip
            record_event(s, to_state="fleet_lease_acquired", checkpoint_id=checkpoint_id,
                         detail={"slot": slot, "host": self.host, "version": version, "lease_s": self.settings.lease_s})  # fmt: skip
        with self._lock:
            self._slot, self._lost, self._depth = slot, False, 1
        return slot

    def renew(self) -> bool:
        """Push the held slot's expiry out again; False (and `lost`) when another host has it."""
        slot = self.slot
        if slot is None:
            return False
        with self.registry.session() as s:
            done = s.execute(update(FleetLease).where(FleetLease.slot == slot, FleetLease.host == self.host)
                             .values(expires_at=self._lease()))  # fmt: skip
            ok = bool(done.rowcount)  # type: ignore[attr-defined]
        if not ok:
            with self._lock:
                self._lost = True
            log.error("fleet_lease_lost", slot=slot, host=self.host)
        return ok

    def release(self, checkpoint_id: int | None = None) -> None:
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth:
                return  # an outer hold goes on
            slot, self._slot = self._slot, None
        if slot is None:
            return
        with self.registry.session() as s:
            done = s.execute(update(FleetLease).where(FleetLease.slot == slot, FleetLease.host == self.host)
                             .values(host=None, version=None, acquired_at=None, expires_at=None))  # fmt: skip
            if done.rowcount:  # type: ignore[attr-defined]
                record_event(s, to_state="fleet_lease_released", checkpoint_id=checkpoint_id,
                             detail={"slot": slot, "host": self.host})  # fmt: skip

    def release_stale(self) -> int:
        """At start: slots a previous run of this host's daemon left held are freed. How many."""
        with self.registry.session() as s:
            done = s.execute(update(FleetLease).where(FleetLease.host == self.host)
                             .values(host=None, version=None, acquired_at=None, expires_at=None))  # fmt: skip
            return int(done.rowcount or 0)  # type: ignore[attr-defined]

    def acquire(self, version: str | None, checkpoint_id: int | None, stop: Callable[[], bool]) -> int | None:
        """Wait for a slot (the workers keep serving meanwhile); None when `stop()` turns true."""
        logged = False
        delay = WAIT_POLL_S
        self._slots_made = 0  # once per wait: a table emptied under a running daemon gets its rows back
        while not stop():
            slot = self.try_acquire(version, checkpoint_id)
            if slot is not None:
                log.info("fleet_lease_acquired", slot=slot, version=version, host=self.host)
                return slot
            if not logged:
                log.info("fleet_lease_waiting", version=version, holders=holders(self.registry))
                logged = True
            if self._wait(self._jitter.uniform(0.5, 1.0) * delay, stop):
                break
            delay = min(self.wait_cap_s, delay * 2)
        return None

    @property
    def wait_cap_s(self) -> float:
        """The longest a waiting host goes without asking again (see the module docstring)."""
        return max(WAIT_POLL_S, min(self.settings.poll_s, WAIT_POLL_S * self.settings.max_updating_hosts))

    @staticmethod
    def _wait(seconds: float, stop: Callable[[], bool]) -> bool:
        """Sleep `seconds`, looking at `stop()` every STOP_CHECK_S; True when it turned true."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            if stop():
                return True
            time.sleep(min(STOP_CHECK_S, left))
        return False

    @contextmanager
    def held(self, version: str | None, checkpoint_id: int | None, stop: Callable[[], bool]) -> Iterator[int | None]:
        """Wait for a slot, renew it while the block runs and release it after; the slot, or
        None (nothing held) when `stop()` turned true before one was had."""
        slot = self.acquire(version, checkpoint_id, stop)
        if slot is None:
            yield None
            return
        try:
            with self.renewing():
                yield slot
        finally:
            self.release(checkpoint_id)

    @contextmanager
    def renewing(self) -> Iterator[None]:
        """Renew the held slot every `renew_s` until the block ends."""
        done = threading.Event()

        def loop() -> None:
            while not done.wait(self.settings.renew_s):
                try:
                    self.renew()
                except Exception:  # a database blip: the next renewal tries again
                    log.exception("fleet_lease_renew_failed")

        t = threading.Thread(target=loop, name="fleet-lease", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join(5)


def holders(registry: Registry) -> list[dict[str, Any]]:
    """Slots held now (not expired): slot, host, version, acquired_at, expires_at. A row expiring
    further ahead than LEASE_READ_MAX_S ('infinity' crashed `status --fleet`; a century ahead
    blocked every host) is no holder: no daemon writes one. The bound is this host's clock (a
    bound parameter: `now() + interval` is no date arithmetic on SQLite)."""
    with registry.session() as s:
        rows = s.scalars(
            select(FleetLease).where(FleetLease.host.is_not(None), FleetLease.expires_at >= func.now(),
                                     FleetLease.expires_at <= utcnow() + timedelta(seconds=LEASE_READ_MAX_S))
            .order_by(FleetLease.slot)
        ).all()  # fmt: skip
        return [{"slot": r.slot, "host": r.host, "version": r.version, "acquired_at": r.acquired_at,
                 "expires_at": r.expires_at} for r in rows]  # fmt: skip
