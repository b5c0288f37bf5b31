"""Fleet mode: many hosts on one PostgreSQL registry, each rolling out under a fleet-wide lease.

- `LeasedEngine`: the rollout engine with every rollout inside a lease slot
  (`daemon.fleet_lease`): at most `[fleet] max_updating_hosts` hosts move workers at once.
- `fleet_target`: the version late joiners converge to: an operator's explicit `fleet_target`
  row, else the newest version that some host has as `last_good` (it passed its health window
  there), never a rejected one.
- `FleetAgent.tick` (every `[fleet] poll_s`): when this host serves something older than the
  target, has the target's bytes here, is not pinned and is idle, it asks the rollout service to
  converge (a rollout with trigger `fleet`, under the lease like any other).
- `fleet_rows`: every host's serving version, state and lag, for `hotswap status --fleet` (the
  same as the SQL view `fleet_versions`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select, text

from daemon.fleet_config import FleetSettings
from daemon.fleet_lease import FleetLeases, holders
from daemon.logging import get_logger
from daemon.registry.db import Registry
from daemon.registry.journal import CheckpointRef, Journal
from daemon.registry.models import Alias, Checkpoint, FleetTarget
from daemon.registry.status import CheckpointStatus, RolloutOutcome, RolloutTrigger
from daemon.rollout.engine import RolloutEngine, RolloutResult
from daemon.rollout.planner import newer, newest

log = get_logger(__name__)
RETRY_S = 30.0  # a converge that did not reach the target is tried again after this long


class LeasedEngine(RolloutEngine):
    """Every rollout waits for a fleet lease slot, renews it while it runs and releases it after."""

    leases: FleetLeases
    stopping: Callable[[], bool]

    def deploy(
        self,
        ckpt: CheckpointRef,
        *,
        trigger: RolloutTrigger,
        fallback: CheckpointRef | None,
        should_yield: Callable[[], bool] = lambda: False,
        only: Collection[str] | None = None,
        detail: dict[str, Any] | None = None,
    ) -> RolloutResult:
        if self.leases.acquire(ckpt.version, ckpt.id, self.stopping) is None:
            rid = self.journal.start_rollout(ckpt.id, trigger=trigger, transport=self.stager.transport, mode="-",
                                             detail={"version": ckpt.version, **(detail or {})})  # fmt: skip
            reason = "the daemon stopped while waiting for a fleet lease"
            self.journal.finish_rollout(rid, RolloutOutcome.SUPERSEDED, {"reason": reason})
            return RolloutResult(rid, RolloutOutcome.SUPERSEDED, reason)
        try:
            with self.leases.renewing():
                return super().deploy(ckpt, trigger=trigger, fallback=fallback, should_yield=should_yield,
                                      only=only, detail=detail)  # fmt: skip
        finally:
            self.leases.release(ckpt.id)


@contextmanager
def holding(leases: FleetLeases | None, ckpt: CheckpointRef, stop: Callable[[], bool]) -> Iterator[None]:
    """A block that moves workers outside a rollout (crash recovery at start) under a lease too."""
    if leases is None or leases.acquire(ckpt.version, ckpt.id, stop) is None:
        yield
        return
    try:
        with leases.renewing():
            yield
    finally:
        leases.release(ckpt.id)


def leased(engine: RolloutEngine, leases: FleetLeases, stopping: Callable[[], bool]) -> LeasedEngine:
    """`engine` as a LeasedEngine (same journal, fleet, driver and stager)."""
    out = LeasedEngine(engine.journal, engine.fleet, engine.settings, engine.driver, engine.stager)
    out.leases, out.stopping = leases, stopping
    return out


@dataclass(frozen=True)
class Target:
    checkpoint: CheckpointRef
    explicit: bool  # an operator's fleet_target row (converged to even when older)


def fleet_target(journal: Journal) -> Target | None:
    reg = journal.registry
    with reg.session() as s:
        explicit = s.get(FleetTarget, 1)
        if explicit is not None:
            ref = journal.checkpoint(explicit.checkpoint_id)
            return Target(ref, True) if ref is not None else None
        ids = set(s.scalars(select(Alias.checkpoint_id).where(Alias.name == "last_good")))
        ok = set(s.scalars(select(Checkpoint.id).where(Checkpoint.id.in_(ids),
                                                        Checkpoint.status != CheckpointStatus.REJECTED.value)))  # fmt: skip
    refs = [r for r in (journal.checkpoint(i) for i in sorted(ok)) if r is not None]
    best = newest(refs)
    return Target(best, False) if best is not None else None


def set_fleet_target(registry: Registry, version: str | None, by: str) -> None:
    """Pin the whole fleet to `version` (None: back to "newest last_good")."""
    with registry.session() as s:
        row = s.get(FleetTarget, 1)
        if version is None:
            if row is not None:
                s.delete(row)
            return
        ckpt = s.scalars(select(Checkpoint).where(Checkpoint.version == version)).one_or_none()
        if ckpt is None:
            raise LookupError(f"unknown version {version!r}")
        if row is None:
            s.add(FleetTarget(id=1, checkpoint_id=ckpt.id, set_by=by))
        else:
            row.checkpoint_id, row.set_by = ckpt.id, by


class FleetAgent:
    """Moves this host to the fleet target when it is behind (see the module docstring)."""

    def __init__(self, journal: Journal, settings: FleetSettings, *, idle: Callable[[], bool],
                 pinned: Callable[[], str | None], converge: Callable[[str], object]) -> None:  # fmt: skip
        self.journal = journal
        self.settings = settings
        self.idle, self.pinned, self.converge = idle, pinned, converge
        self._tried: dict[str, float] = {}
        self._missing_logged: set[str] = set()

    def wanted(self) -> CheckpointRef | None:
        """The version this host should move to now, else None."""
        target = fleet_target(self.journal)
        if target is None or self.pinned() is not None:
            return None
        serving = self.journal.alias("serving")
        ckpt = target.checkpoint
        if serving is not None and (serving.id == ckpt.id or (not target.explicit and not newer(ckpt, serving))):
            return None
        if not ckpt.local_path or not Path(ckpt.local_path).is_dir():
            if ckpt.version not in self._missing_logged:
                self._missing_logged.add(ckpt.version)
                log.warning("fleet_target_not_on_this_host", version=ckpt.version, host=self.journal.registry.host)
            return None
        return ckpt

    def tick(self) -> str | None:
        """One look; the version asked for, if any."""
        if not self.idle():
            return None
        ckpt = self.wanted()
        if ckpt is None:
            return None
        now = time.monotonic()
        if now - self._tried.get(ckpt.version, -RETRY_S) < RETRY_S:
            return None
        self._tried[ckpt.version] = now
        log.info("fleet_converge", version=ckpt.version, host=self.journal.registry.host)
        self.converge(ckpt.version)
        return ckpt.version


def fleet_rows(registry: Registry) -> dict[str, Any]:
    """Every host's row of `fleet_versions`, the fleet target and the lease holders now."""
    journal = Journal(registry)
    target = fleet_target(journal)
    with registry.session() as s:
        rows = [dict(r) for r in s.execute(text("SELECT * FROM fleet_versions ORDER BY host")).mappings()]
    busy = {h["host"]: h for h in holders(registry)}
    for r in rows:
        held = busy.get(r["host"])
        r["updating_to"] = held["version"] if held else None
        r["state"] = _state(r, held is not None, target)
        r["last_seen"] = r["last_seen"].isoformat() if hasattr(r["last_seen"], "isoformat") else r["last_seen"]
    return {"host": registry.host, "target": target.checkpoint.version if target else None,
            "target_explicit": bool(target and target.explicit), "hosts": rows}  # fmt: skip


def _state(row: dict[str, Any], updating: bool, target: Target | None) -> str:
    if updating:
        return "updating"
    if row.get("pinned"):
        return "pinned"
    if target is not None and row.get("serving") == target.checkpoint.version:
        return "in sync"
    if row.get("workers") and row.get("workers_running") != row.get("workers"):
        return "degraded"
    return "behind" if target is not None else "-"
