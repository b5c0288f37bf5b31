"""The fleet's target version and every host's row, read from the registry (no rollout code).

- `fleet_target`: the version late joiners converge to: an operator's explicit `fleet_target`
  row (`set_fleet_target`), else the newest good version: verified, deployable and not
  rejected, and some host's `last_good` now or before (`checkpoints.last_good_at`: it passed
  its health window there, or a rollback, pin or the fleet put it there). "Before" matters:
  after an operator's older target every host's last_good is the older one, and clearing the
  target must bring the fleet back to the newer one. Newest: by step (a version without one
  counts as older than any with one), then by arrival.
- `fleet_rows`: every host's serving version, state, lag and why it is behind (`hotswap status
  --fleet`), from the SQL view `fleet_versions` (which computes the same target, and the lag
  towards it) plus the lease holders now; a host a staged rollout has not admitted yet is `held`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, text
from sqlalchemy.orm import Session

from daemon.fleet.lease import holders
from daemon.fleet.stages import held_back
from daemon.fleet.trust import Trust, refused_target, target_message
from daemon.registry import (
    DEPLOYABLE,
    GOOD_WHERE,
    Alias,
    Checkpoint,
    CheckpointLocation,
    CheckpointRef,
    CheckpointStatus,
    FleetRollout,
    FleetTarget,
    Journal,
    Registry,
    record_event,
    utcnow,
)

SILENT_AFTER = timedelta(seconds=120)  # no worker poll recorded for this long: the host is "silent"


@dataclass(frozen=True)
class Target:
    checkpoint: CheckpointRef
    explicit: bool  # an operator's fleet_target row (converged to even when older)
    set_by: str | None = None  # the explicit row's author and time
    set_at: datetime | None = None
    staged: bool = False  # this host's place in a staged rollout (daemon.fleet.stages), not the fleet's target


class TargetRefused(ValueError):
    """A version that cannot be the fleet's target (unknown, never verified, rejected)."""


def fleet_target(journal: Journal, trust: Trust | None = None) -> Target | None:
    """An explicit row counts only when it verifies (daemon.fleet.trust); else the newest good."""
    reg = journal.registry
    with reg.session() as s:
        explicit, refused = refused_target(s, trust or Trust())
        if explicit is not None and refused is None:
            ref = journal.checkpoint(explicit.checkpoint_id)
            return Target(ref, True, explicit.set_by, explicit.set_at) if ref is not None else None
        best = newest_good(s)
    ref = journal.checkpoint(best) if best is not None else None
    return Target(ref, False) if ref is not None else None


def good() -> ColumnElement[bool]:
    """A version the fleet may follow without an operator: its checks passed, it is deployable
    and not rejected, and it was some host's last_good (the alias now, or `last_good_at`)."""
    return and_(
        Checkpoint.verified_at.is_not(None),
        Checkpoint.status.in_([st.value for st in DEPLOYABLE if st is not CheckpointStatus.REJECTED]),
        or_(Checkpoint.last_good_at.is_not(None),
            Checkpoint.id.in_(select(Alias.checkpoint_id).where(Alias.name == "last_good"))),
    )  # fmt: skip


def newest_good(s: Session) -> int | None:
    """The newest `good()` version's id, from the first entries of the index of good versions
    (`ix_checkpoints_good`, in its own literal terms so both databases use it) and the few that are
    good only through a `last_good` alias: a handful of rows whatever the history's length."""
    cols = select(Checkpoint.id, Checkpoint.step)
    found = [
        *s.execute(cols.where(text(GOOD_WHERE), Checkpoint.step.is_not(None))
                   .order_by(Checkpoint.step.desc(), Checkpoint.id.desc()).limit(1)),
        *s.execute(cols.where(text(GOOD_WHERE), Checkpoint.step.is_(None)).order_by(Checkpoint.id.desc()).limit(1)),
        *s.execute(cols.where(Checkpoint.id.in_(select(Alias.checkpoint_id).where(Alias.name == "last_good")),
                              Checkpoint.last_good_at.is_(None), good())),  # read from aliases, not the history
    ]  # fmt: skip
    best = max(found, key=lambda r: (r.step is not None, r.step or 0, r.id), default=None)
    return None if best is None else int(best.id)


def fleet_mark(registry: Registry) -> tuple[Any, ...]:
    """One statement: everything in the registry a fleet agent's decision for this host rests on
    (the explicit target, the newest good versions, any host's last_good moving, this host's
    serving version, the newest waiting version, the newest staged rollout's state, and whether
    this host has a copy of the waiting, target and newest good versions). Unchanged,
    and this host was in sync at the last look: nothing to decide (FleetAgent.tick)."""
    c, a, r, loc = Checkpoint, Alias, FleetRollout, CheckpointLocation
    newest = select(c.id).where(text(GOOD_WHERE))
    stepped = newest.where(c.step.is_not(None)).order_by(c.step.desc(), c.id.desc()).limit(1)  # ix_checkpoints_good
    unstepped = newest.where(c.step.is_(None)).order_by(c.id.desc()).limit(1)
    explicit = select(FleetTarget.checkpoint_id).where(FleetTarget.id == 1)
    waiting = select(func.max(c.id)).where(c.status.in_([st.value for st in (CheckpointStatus.VERIFIED, CheckpointStatus.STAGED)]))

    def copy_here(checkpoint: Any) -> Any:  # this host's copy of it recorded (a primary-key lookup)
        return select(func.count()).select_from(loc).where(loc.host == registry.host,
                                                           loc.checkpoint_id == checkpoint.scalar_subquery())  # fmt: skip

    marks = [
        stepped,
        unstepped,
        select(func.max(a.updated_at)).where(a.name == "last_good"),  # an older daemon's alias-only good version
        explicit,
        select(FleetTarget.set_at).where(FleetTarget.id == 1),
        select(a.checkpoint_id).where(a.host == registry.host, a.name == "serving"),
        waiting,
        select(r.id).order_by(r.id.desc()).limit(1),
        select(r.updated_at).order_by(r.id.desc()).limit(1),
        # a copy of what it may move to appearing here (its source registered it after the look)
        *(copy_here(m) for m in (waiting, explicit, stepped, unstepped)),
    ]  # fmt: skip
    # autocommit: one statement on the wire, no BEGIN / COMMIT around it (what a pooler counts too)
    with registry.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        return tuple(conn.execute(select(*(m.scalar_subquery() for m in marks))).one())


def set_fleet_target(registry: Registry, version: str | None, by: str, trust: Trust | None = None) -> None:
    """Hold the whole fleet on `version` (None: back to the newest good version). Only a version whose
    checks passed and that is not rejected: every host would otherwise converge to it. Signed with
    `trust`'s key when it has one, and recorded as an event (what unsigned verification reads)."""
    trust = trust or Trust()
    with registry.session() as s:
        row = s.get(FleetTarget, 1)
        if version is None:
            if row is not None:
                s.delete(row)
                record_event(s, to_state="fleet_target_cleared", checkpoint_id=row.checkpoint_id, detail={"by": by})
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
        now = utcnow()
        sig = trust.sign(target_message(ckpt.id, by, now))
        if row is None:
            s.add(FleetTarget(id=1, checkpoint_id=ckpt.id, set_by=by, set_at=now, signature=sig))
        else:
            row.checkpoint_id, row.set_by, row.set_at, row.signature = ckpt.id, by, now, sig
        record_event(s, to_state="fleet_target_set", checkpoint_id=ckpt.id,
                     detail={"version": version, "by": by, "set_at": now.isoformat()})  # fmt: skip


def fleet_rows(registry: Registry, trust: Trust | None = None) -> dict[str, Any]:
    """Every host's row of `fleet_versions`, the fleet target and the lease holders now; a refused
    explicit target (daemon.fleet.trust) and a stalled staged rollout, named."""
    journal = Journal(registry)
    target = fleet_target(journal, trust)
    with registry.session() as s:  # with target, lag and why each host is behind (daemon.fleet.behind)
        rows = [dict(r) for r in s.execute(text("SELECT * FROM fleet_versions ORDER BY host")).mappings()]
        _, refused = refused_target(s, trust or Trust())
        stalled = s.scalars(select(FleetRollout.stalled).where(FleetRollout.state.in_(("running", "paused")))
                            .order_by(FleetRollout.id.desc()).limit(1)).first()  # fmt: skip
    busy = {h["host"]: h for h in holders(registry)}
    staged = held_back(registry)
    for r in rows:
        if refused is not None:  # the view follows the row: what hosts follow is the verified target
            r["target"], r["lag"] = (target.checkpoint.version if target else None), None
        if isinstance(r["behind_since"], datetime):  # SQLite: text already
            r["behind_since"] = r["behind_since"].isoformat()
        held = busy.get(r["host"])
        r["updating_to"] = held["version"] if held else None
        if isinstance(r["last_seen"], str):  # SQLite hands the view's timestamps back as text
            r["last_seen"] = datetime.fromisoformat(r["last_seen"])
        r["state"] = _state(r, held is not None, bool(target and target.explicit))
        if staged is not None and r["state"] == "behind" and r["target"] == staged[0] and r["host"] not in staged[1]:
            r["state"] = "held"  # a staged rollout keeps it on the previous version until its stage comes
        r["last_seen"] = r["last_seen"].isoformat() if isinstance(r["last_seen"], datetime) else r["last_seen"]
    return {"host": registry.host, "target": target.checkpoint.version if target else None,
            "target_explicit": bool(target and target.explicit), "target_refused": refused, "stalled": stalled,
            "hosts": rows}  # fmt: skip


def _state(row: dict[str, Any], updating: bool, explicit: bool) -> str:
    """From the view's row: its `target` and `lag` come from one query, so `in sync` (serving the
    target) always has lag 0, and a host the agent would move has lag >= 1 (migration 0010)."""
    if updating:
        return "updating"
    seen = row.get("last_seen")
    if isinstance(seen, datetime) and utcnow() - (seen if seen.tzinfo else seen.replace(tzinfo=UTC)) > SILENT_AFTER:
        return "silent"  # its daemon has not polled its workers for a while (stopped, or cut off)
    if row.get("pinned"):
        return "pinned"
    target = row.get("target")
    if target is not None and row.get("serving") == target:
        return "in sync"
    if row.get("workers") and row.get("workers_running") != row.get("workers"):
        return "degraded"
    if target is None:
        return "-"
    # newer than the newest good version (its own health window): nothing moves it back
    return "ahead" if not explicit and row.get("serving") is not None and not row.get("lag") else "behind"
