"""The fleet's target version and every host's row, read from the registry (no rollout code).

- `fleet_target`: the version late joiners converge to: an operator's explicit `fleet_target`
  row (`set_fleet_target`), else the newest version that some host has as `last_good` (it
  passed its health window there), never a rejected one.
- `fleet_rows`: every host's serving version, state and lag (`hotswap status --fleet`), from the
  SQL view `fleet_versions` plus the lease holders now.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select, text

from daemon.fleet_lease import holders
from daemon.registry.db import Registry
from daemon.registry.journal import CheckpointRef, Journal
from daemon.registry.models import Alias, Checkpoint, FleetTarget, utcnow
from daemon.registry.status import DEPLOYABLE, CheckpointStatus
from daemon.rollout.planner import newest

SILENT_AFTER = timedelta(seconds=120)  # no worker poll recorded for this long: the host is "silent"


@dataclass(frozen=True)
class Target:
    checkpoint: CheckpointRef
    explicit: bool  # an operator's fleet_target row (converged to even when older)
    set_by: str | None = None  # the explicit row's author and time
    set_at: datetime | None = None


class TargetRefused(ValueError):
    """A version that cannot be the fleet's target (unknown, never verified, rejected)."""


def fleet_target(journal: Journal) -> Target | None:
    reg = journal.registry
    with reg.session() as s:
        explicit = s.get(FleetTarget, 1)
        if explicit is not None:
            ref = journal.checkpoint(explicit.checkpoint_id)
            return Target(ref, True, explicit.set_by, explicit.set_at) if ref is not None else None
        ids = set(s.scalars(select(Alias.checkpoint_id).where(Alias.name == "last_good")))
        ok = set(s.scalars(select(Checkpoint.id).where(Checkpoint.id.in_(ids),
                                                        Checkpoint.status != CheckpointStatus.REJECTED.value)))  # fmt: skip
    refs = [r for r in (journal.checkpoint(i) for i in sorted(ok)) if r is not None]
    best = newest(refs)
    return Target(best, False) if best is not None else None


def set_fleet_target(registry: Registry, version: str | None, by: str) -> None:
    """Hold the whole fleet on `version` (None: back to "newest last_good"). Only a version whose
    checks passed and that is not rejected: every host would otherwise converge to it."""
    with registry.session() as s:
        row = s.get(FleetTarget, 1)
        if version is None:
            if row is not None:
                s.delete(row)
            return
        ckpt = s.scalars(select(Checkpoint).where(Checkpoint.version == version)).one_or_none()
        if ckpt is None:
            raise TargetRefused(f"unknown version {version!r}: not in the registry")
        status = CheckpointStatus(ckpt.status)
        if status is CheckpointStatus.REJECTED or status not in DEPLOYABLE:
            raise TargetRefused(
                f"version {version!r} is {status.value}{f' ({ckpt.status_message})' if ckpt.status_message else ''}: "
                "a fleet target must be a version whose checks passed and that is not rejected"
            )
        if row is None:
            s.add(FleetTarget(id=1, checkpoint_id=ckpt.id, set_by=by, set_at=utcnow()))
        else:
            row.checkpoint_id, row.set_by, row.set_at = ckpt.id, by, utcnow()


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
        if isinstance(r["last_seen"], str):  # SQLite hands the view's timestamps back as text
            r["last_seen"] = datetime.fromisoformat(r["last_seen"])
        r["state"] = _state(r, held is not None, target)
        r["last_seen"] = r["last_seen"].isoformat() if isinstance(r["last_seen"], datetime) else r["last_seen"]
    return {"host": registry.host, "target": target.checkpoint.version if target else None,
            "target_explicit": bool(target and target.explicit), "hosts": rows}  # fmt: skip


def _state(row: dict[str, Any], updating: bool, target: Target | None) -> str:
    if updating:
        return "updating"
    seen = row.get("last_seen")
    if isinstance(seen, datetime) and utcnow() - (seen if seen.tzinfo else seen.replace(tzinfo=UTC)) > SILENT_AFTER:
        return "silent"  # its daemon has not polled its workers for a while (stopped, or cut off)
    if row.get("pinned"):
        return "pinned"
    if target is not None and row.get("serving") == target.checkpoint.version:
        return "in sync"
    if row.get("workers") and row.get("workers_running") != row.get("workers"):
        return "degraded"
    return "behind" if target is not None else "-"
