"""Retention of the registry's history: old `events` and `checks` rows go, every version stays.

Online RL writes a version every few minutes: a year is 100,000 versions, 700,000 check rows and a
million events. `prune(registry, keep_days)` deletes

- `events` older than `keep_days` (their `at`), and
- `checks` of the versions that arrived more than `keep_days` ago (in arrival order: every
  version up to the newest one discovered before the cutoff),
- webhook deliveries (`webhook_deliveries`) delivered more than `keep_days` ago (a batch per run;
  pending and undeliverable ones stay),

except those of a protected version: some host's serving, last_good or pinned version, the
fleet target, a version on its way (discovered, fetching, verifying, deferred, verified, staged),
one still `deployed`, or one with a rollout in flight; the events of a rollout of a protected
version, or of any rollout in flight, stay too. `checkpoints`, `checkpoint_files` and `rollouts`
are never touched: history, show and the views keep every version, with what came from the
pruned rows gone (verify_ms, the rolled back / superseded times, each worker's update time, the
checks `hotswap show` lists, the registration fingerprint a rediscovered folder is compared with).

Rows go in batches of `BATCH`, each its own short transaction that reads the protected set
again, so a writer never waits long and a version pinned meanwhile is safe; the cost follows the
rows deleted (`ix_events_at`, `ix_checks_checkpoint_id`). On PostgreSQL one daemon of a fleet
prunes at a time (a transaction-level advisory lock; the others skip their turn).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, or_, select, text
from sqlalchemy.orm import Session

from daemon.registry.db import Registry
from daemon.registry.models import Alias, Check, Checkpoint, Event, FleetTarget, Rollout, utcnow
from daemon.registry.status import UNFINISHED, WAITING, CheckpointStatus
from daemon.registry.webhook_rows import WebhookDelivery

BATCH = 5000
# b"hotswap" + 0x02: one pruner per database at a time (0x01 is the migration lock)
PRUNE_LOCK_KEY = 0x686F7473776170_02
KEPT_STATUSES = tuple(s.value for s in (*UNFINISHED, *WAITING, CheckpointStatus.DEFERRED, CheckpointStatus.DEPLOYED))


@dataclass(frozen=True)
class Pruned:
    events: int = 0
    checks: int = 0
    skipped: bool = False  # another daemon was pruning this database


def protected(s: Session) -> tuple[set[int], set[int]]:
    """(checkpoint ids, rollout ids) whose rows retention never deletes."""
    ids = set(s.scalars(select(Alias.checkpoint_id)))  # every host's serving, last_good, pinned
    ids |= set(s.scalars(select(FleetTarget.checkpoint_id)))
    ids |= set(s.scalars(select(Checkpoint.id).where(Checkpoint.status.in_(KEPT_STATUSES))))
    in_flight = s.execute(select(Rollout.id, Rollout.checkpoint_id).where(Rollout.outcome.is_(None))).all()
    ids |= {int(c) for _, c in in_flight}
    rollouts = {int(r) for r, _ in in_flight}
    rollouts |= set(s.scalars(select(Rollout.id).where(Rollout.checkpoint_id.in_(ids))))
    return ids, rollouts


def prune(registry: Registry, keep_days: float, batch: int = BATCH) -> Pruned:
    """Delete what is older than `keep_days` and not protected; returns how many rows went."""
    cutoff = utcnow() - timedelta(days=keep_days)
    events = checks = 0
    while True:
        with registry.session() as s:
            if not _turn(s):
                return Pruned(events, checks, skipped=True)
            ids, rollouts = protected(s)
            n = _events(s, cutoff, ids, rollouts, batch)
        events += n
        if n < batch:
            break
    with registry.session() as s:  # webhook deliveries done with: delivered before the cutoff (never pending ones)
        doomed = select(WebhookDelivery.id).where(WebhookDelivery.state == "delivered",
                                                  WebhookDelivery.delivered_at < cutoff).limit(batch)  # fmt: skip
        s.execute(delete(WebhookDelivery).where(WebhookDelivery.id.in_(doomed)))
    with registry.session() as s:  # the newest version that arrived before the cutoff
        bound = s.scalar(select(Checkpoint.id).where(Checkpoint.discovered_at < cutoff)
                         .order_by(Checkpoint.id.desc()).limit(1))  # fmt: skip
    while bound is not None:
        with registry.session() as s:
            if not _turn(s):
                return Pruned(events, checks, skipped=True)
            ids, _ = protected(s)
            n = _checks(s, bound, ids, batch)
        checks += n
        if n < batch:
            break
    return Pruned(events, checks)


def _turn(s: Session) -> bool:
    if s.get_bind().dialect.name != "postgresql":
        return True  # SQLite: one writer at a time anyway
    return bool(s.scalar(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": PRUNE_LOCK_KEY}))


def _events(s: Session, cutoff: datetime, ids: set[int], rollouts: set[int], batch: int) -> int:
    where = [Event.at < cutoff]
    if ids:
        where.append(or_(Event.checkpoint_id.is_(None), Event.checkpoint_id.not_in(ids)))
    if rollouts:
        where.append(or_(Event.rollout_id.is_(None), Event.rollout_id.not_in(rollouts)))
    doomed = select(Event.id).where(*where).order_by(Event.at).limit(batch)
    return int(s.execute(delete(Event).where(Event.id.in_(doomed))).rowcount)  # type: ignore[attr-defined]


def _checks(s: Session, bound: int, ids: set[int], batch: int) -> int:
    where = [Check.checkpoint_id <= bound]
    if ids:
        where.append(Check.checkpoint_id.not_in(ids))
    doomed = select(Check.id).where(*where).order_by(Check.checkpoint_id).limit(batch)
    return int(s.execute(delete(Check).where(Check.id.in_(doomed))).rowcount)  # type: ignore[attr-defined]
