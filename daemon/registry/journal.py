"""Everything the rollout engine writes to (and reads from) the registry, one short transaction each.

Each write commits before the call returns, so an event is durable before the
engine takes the next step: a daemon killed at any point finds the last thing
it did in `events`. Rows cross threads as frozen `CheckpointRef`s, never as
live ORM objects. Status changes go through `daemon.registry.status`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, and_, delete, func, select, update
from sqlalchemy.orm import Session

from daemon.registry import hosts, status
from daemon.registry.db import Registry
from daemon.registry.models import (
    Alias,
    Checkpoint,
    CheckpointFile,
    CheckpointLocation,
    Event,
    Rollout,
    Worker,
    utcnow,
)
from daemon.registry.outbox import deferrable
from daemon.registry.queries import by_status, record_event
from daemon.registry.status import (
    UNFINISHED,
    WAITING,
    CheckpointStatus,
    RolloutOutcome,
    RolloutTrigger,
)

# statuses every host moves a version to as it deploys or replaces it: the first host's move stands
_FLEET_WIDE_MOVES = frozenset({CheckpointStatus.DEPLOYED, CheckpointStatus.RETIRED})


@dataclass(frozen=True, slots=True)
class CheckpointRef:
    id: int
    version: str
    digest: str | None
    local_path: str | None
    tensor_count: int | None
    status: CheckpointStatus
    verified: bool  # its checks passed at some point (verified_at set)
    step: int | None = None  # the manifest's training step, when it has one: what "newer" means first

    def __str__(self) -> str:
        return self.version


@dataclass(frozen=True, slots=True)
class RolloutRef:
    id: int
    checkpoint: CheckpointRef
    trigger: RolloutTrigger
    transport: str
    mode: str
    detail: dict[str, Any]


class Missing:
    """Not read yet (None is an answer: no copy on this host)."""


MISSING = Missing()


def _with_location(s: Session) -> Select[Checkpoint, str | None]:
    """A checkpoint and this host's copy of it, in one statement (a fleet agent reads a few every
    poll_s on every host: issue 28)."""
    here = and_(CheckpointLocation.checkpoint_id == Checkpoint.id, CheckpointLocation.host == hosts.host_of(s))
    return select(Checkpoint, CheckpointLocation.local_path).outerjoin(CheckpointLocation, here)


def _ref(s: Session, c: Checkpoint, local_path: str | None | Missing = MISSING) -> CheckpointRef:
    return CheckpointRef(
        id=c.id,
        version=c.version,
        digest=c.digest,
        # this host's copy; another host's path never
        local_path=hosts.local_path(s, c.id) if isinstance(local_path, Missing) else local_path,

        tensor_count=c.tensor_count,
        status=CheckpointStatus(c.status),
        verified=c.verified_at is not None,
        step=c.step,
    )



def _recently_deployed(exclude_ids: Iterable[int]) -> Select[Checkpoint]:
    """Deployed or retired versions, the most recently deployed first, read newest first from
    `ix_checkpoints_last_deployed` (every deploy sets `last_deployed_at`; 0011 filled it in where
    an older release had only `deployed_at`), not by sorting the whole history."""
    return (
        select(Checkpoint)
        .where(
            Checkpoint.id.not_in(list(exclude_ids)),
            Checkpoint.kind != "adapter",  # a LoRA adapter is never the base's fallback
            Checkpoint.last_deployed_at.is_not(None),
            Checkpoint.deployed_at.is_not(None),
            Checkpoint.status.in_((CheckpointStatus.DEPLOYED, CheckpointStatus.RETIRED)),
        )
        .order_by(Checkpoint.last_deployed_at.desc(), Checkpoint.id.desc())
    )


def _set_alias(s: Session, name: str, checkpoint_id: int | None) -> None:
    if checkpoint_id is None:
        s.execute(delete(Alias).where(Alias.host == hosts.host_of(s), Alias.name == name))
        return
    now = utcnow()
    a = hosts.alias_row(s, name)
    if a is None:
        s.add(Alias(host=hosts.host_of(s), name=name, checkpoint_id=checkpoint_id, updated_at=now))
    else:
        a.checkpoint_id = checkpoint_id
        a.updated_at = now
    if name == "last_good":
        s.execute(update(Checkpoint).where(Checkpoint.id == checkpoint_id).values(last_good_at=now))


def apply_moves(s: Session, moves: list[tuple[int, CheckpointStatus, str | None]], detail: dict[str, Any] | None = None) -> None:
    """`Journal.move_statuses` inside the caller's transaction (rows locked in id order)."""
    rows = {c.id: c for c in s.scalars(select(Checkpoint).where(Checkpoint.id.in_([m[0] for m in moves]))
                                        .order_by(Checkpoint.id).with_for_update())}  # fmt: skip
    for checkpoint_id, to, message in moves:
        c = rows.get(checkpoint_id)
        if c is None or (to in _FLEET_WIDE_MOVES and c.status == to.value):
            continue
        if to == CheckpointStatus.RETIRED and (others := hosts.served_elsewhere(s, checkpoint_id)):
            status.note(s, c, f"{message or 'replaced'} on {hosts.host_of(s)}; still serving on "
                        f"{', '.join(sorted(others))}")  # fmt: skip
            continue
        status.move(s, c, to, message, detail=detail)


class Journal:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    # -- checkpoints and aliases -------------------------------------------------
    def checkpoint(self, checkpoint_id: int) -> CheckpointRef | None:
        with self.registry.session() as s:
            row = s.execute(_with_location(s).where(Checkpoint.id == checkpoint_id)).one_or_none()
            return _ref(s, row[0], row[1]) if row else None

    def checkpoint_by_version(self, version: str) -> CheckpointRef | None:
        with self.registry.session() as s:
            c = s.scalars(select(Checkpoint).where(Checkpoint.version == version)).one_or_none()
            return _ref(s, c) if c else None

    def verified_files(self, checkpoint_id: int) -> list[tuple[str, int, str | None, str | None, str | None]]:
        """(path, bytes, crc32c, hash_alg, hash) of every file, as the verify stage computed them."""
        with self.registry.session() as s:
            rows = s.scalars(select(CheckpointFile).where(CheckpointFile.checkpoint_id == checkpoint_id)).all()
            return [(r.path, r.bytes, r.crc32c, r.hash_alg, r.hash) for r in sorted(rows, key=lambda r: r.path)]

    def alias(self, name: str) -> CheckpointRef | None:
        with self.registry.session() as s:
            row = s.execute(_with_location(s).join(Alias, Alias.checkpoint_id == Checkpoint.id)
                            .where(Alias.host == hosts.host_of(s), Alias.name == name)).one_or_none()  # fmt: skip
            return _ref(s, row[0], row[1]) if row else None

    @deferrable
    def set_alias(self, name: str, checkpoint_id: int | None) -> None:
        """Set (or clear) one of this host's aliases. A `last_good` is also remembered on the
        checkpoint (`last_good_at`): the fleet target is the newest version ever good somewhere."""
        with self.registry.session() as s:
            _set_alias(s, name, checkpoint_id)

    @deferrable
    def serve(self, checkpoint_id: int, moves: list[tuple[int, CheckpointStatus, str | None]]) -> None:
        """This host's `serving` alias and the status moves that go with it (`move_statuses`) in one
        transaction: a reader never finds `serving` on a version whose status is not yet `deployed`."""
        with self.registry.session() as s:
            _set_alias(s, "serving", checkpoint_id)
            apply_moves(s, moves)

    @deferrable
    def move_status(
        self, checkpoint_id: int, to: CheckpointStatus, message: str | None = None, detail: dict[str, Any] | None = None
    ) -> None:
        """A status transition (see `daemon.registry.status.TRANSITIONS`).

        A version another host still serves is never `retired` (the status is fleet-wide):
        the move becomes a note. A move to `deployed` or `retired` that another host already made
        is done: two hosts leaving v1 for v2 at once each read v1 `deployed`, and the later one's
        `retired -> retired` failed its rollout's bookkeeping after the worker served v2 (its
        aliases then never moved). The row is locked, so the later one sees the earlier's move."""
        with self.registry.session() as s:
            apply_moves(s, [(checkpoint_id, to, message)], detail)

    @deferrable
    def move_statuses(self, moves: list[tuple[int, CheckpointStatus, str | None]]) -> None:
        """Several `move_status` in one transaction: a new version `deployed` and the one it
        replaced `retired` are seen together or not at all (a reader never finds both deployed).
        Rows are locked in id order, so two hosts moving the same pair never wait on each other."""
        with self.registry.session() as s:
            apply_moves(s, moves)

    @deferrable
    def note(self, checkpoint_id: int, message: str) -> None:
        """Only the status message changes (e.g. why a verified version waits)."""
        with self.registry.session() as s:
            c = s.get(Checkpoint, checkpoint_id)
            if c is not None:
                status.note(s, c, message)

    @deferrable
    def checkpoint_event(self, checkpoint_id: int, to_state: str, detail: dict[str, Any], rollout_id: int | None) -> None:
        """A checkpoint milestone that is not a status (e.g. `rolled_back`)."""
        with self.registry.session() as s:
            record_event(s, checkpoint_id=checkpoint_id, rollout_id=rollout_id, to_state=to_state, detail=detail)

    def previous_deployed(self, exclude_id: int) -> CheckpointRef | None:
        """The most recently deployed version other than `exclude_id` that was not rejected since."""
        with self.registry.session() as s:
            c = s.scalars(_recently_deployed([exclude_id]).limit(1)).one_or_none()
            return _ref(s, c) if c else None

    def good_versions(self, exclude_ids: Iterable[int] = (), limit: int = 10) -> list[CheckpointRef]:
        """Versions that served (deployed or retired, not rejected since), most recently deployed first."""
        with self.registry.session() as s:
            return [_ref(s, c) for c in s.scalars(_recently_deployed(exclude_ids).limit(limit)).all()]

    def newer_in_verification(self, checkpoint_id: int) -> bool:
        """A newer checkpoint is still being verified (it may supersede `checkpoint_id`)."""
        with self.registry.session() as s:
            n = s.scalar(
                select(func.count())
                .select_from(Checkpoint)
                .where(Checkpoint.id > checkpoint_id, Checkpoint.status.in_(UNFINISHED))
            )
            return bool(n)

    def waiting(self) -> list[CheckpointRef]:
        """Every verified full checkpoint that never started deploying, in arrival order (adapters:
        daemon.registry.adapters)."""
        with self.registry.session() as s:
            return [_ref(s, c) for c in by_status(s, [w.value for w in WAITING]) if c.kind != "adapter"]

    def last_rollout_of(self, checkpoint_id: int) -> int | None:
        with self.registry.session() as s:
            return s.scalar(
                select(Rollout.id)
                .where(Rollout.checkpoint_id == checkpoint_id, Rollout.host == hosts.host_of(s))
                .order_by(Rollout.id.desc())
                .limit(1)
            )

    def register_seed(self, *, version: str, local_path: str, digest: str, total_bytes: int, tensors: int) -> CheckpointRef:
        """Record a checkpoint the daemon made itself (the embedded tiny seed) as deployed."""
        with self.registry.session() as s:
            c = s.scalars(select(Checkpoint).where(Checkpoint.version == version)).one_or_none()
            if c is None:
                c = status.create_made(
                    s, version=version, local_path=local_path, digest=digest, total_bytes=total_bytes, tensors=tensors,
                    why="made by the daemon (embedded default)", deployed="initial version of the managed worker",
                )  # fmt: skip
            elif hosts.local_path(s, c.id) is None:  # another host made it first: this host's copy
                hosts.set_location(s, c.id, local_path)
            return _ref(s, c)

    # -- workers -------------------------------------------------------------------
    def register_workers(self, workers: Iterable[tuple[str, str, str, str]]) -> None:
        """Insert or refresh a `workers` row per configured (name, kind, url, device); its state is kept."""
        with self.registry.session() as s:
            for name, kind, url, device in workers:
                w = hosts.worker_row(s, name)
                if w is None:
                    s.add(Worker(host=hosts.host_of(s), name=name, kind=kind, url=url, device=device, state="UNKNOWN"))
                else:
                    w.kind, w.url, w.device = kind, url, device

    def worker_state(self, name: str) -> tuple[str, str | None]:
        with self.registry.session() as s:
            w = hosts.worker_row(s, name)
            if w is None:
                raise LookupError(f"worker {name!r} is not registered on host {hosts.host_of(s)!r}")
            return w.state, w.weight_version

    @deferrable
    def transition(
        self,
        *,
        rollout_id: int | None,
        worker: str,
        from_state: str | None,
        to_state: str,
        duration_ms: float | None,
        detail: dict[str, Any] | None = None,
        weight_version: str | None = None,
        error: str | None = None,
        device: str | None = None,
        at: datetime | None = None,
    ) -> None:
        """Append a worker transition and move `workers.state` (and its version) with it.
        Called only by the state machine's move (`daemon.rollout.driver`); `at`: when it
        happened (set by `deferrable`, so a write kept through an outage keeps its time)."""
        with self.registry.session() as s:
            record_event(
                s,
                at=at,
                rollout_id=rollout_id,
                worker=worker,
                from_state=from_state,
                to_state=to_state,
                duration_ms=None if duration_ms is None else round(duration_ms, 3),
                detail=detail,
            )
            values: dict[str, Any] = {"state": to_state, "updated_at": utcnow(), "last_error": error}
            if weight_version is not None:
                values["weight_version"] = weight_version
            if device:
                values["device"] = device
            s.execute(update(Worker).where(Worker.host == hosts.host_of(s), Worker.name == worker).values(**values))

    @deferrable
    def observe(
        self, worker: str, *, state: str, weight_version: str | None, error: str | None, device: str | None = None,
        at: datetime | None = None,
    ) -> str | None:
        """The health poll's view of a worker; an event only when its state changed. Returns the old state."""
        with self.registry.session() as s:
            w = hosts.worker_row(s, worker)
            if w is None:
                return None
            previous = w.state
            if previous != state:
                record_event(
                    s,
                    at=at,
                    worker=worker,
                    from_state=previous,
                    to_state=state,
                    detail={"source": "health_poll", **({"error": error} if error else {})},
                )
            w.state = state
            if weight_version is not None:
                w.weight_version = weight_version
            if device:
                w.device = device
            w.last_error = error
            w.updated_at = utcnow()
            return previous

    # -- rollouts ------------------------------------------------------------------
    def start_rollout(
        self, checkpoint_id: int, *, trigger: RolloutTrigger, transport: str, mode: str, detail: dict[str, Any]
    ) -> int:
        with self.registry.session() as s:
            r = Rollout(
                checkpoint_id=checkpoint_id,
                trigger=trigger.value,
                transport=transport,
                mode=mode,
                started_at=utcnow(),
                detail=detail,
            )
            s.add(r)
            s.flush()
            return r.id

    @deferrable
    def finish_rollout(
        self, rollout_id: int, outcome: RolloutOutcome, detail: dict[str, Any] | None = None, *, transport: str | None = None
    ) -> None:
        """`transport`: the paths the workers really took, when not the configured one (ipc -> disk)."""
        with self.registry.session() as s:
            r = s.get(Rollout, rollout_id)
            if r is None:
                return
            if transport:
                r.transport = transport
            r.outcome = outcome.value
            r.finished_at = utcnow()
            if detail:
                r.detail = {**(r.detail or {}), **detail}

    @deferrable
    def amend_rollout(self, rollout_id: int, *, outcome: RolloutOutcome | None = None, detail: dict[str, Any]) -> None:
        """Change a finished rollout's outcome (health window verdict) without moving finished_at."""
        with self.registry.session() as s:
            r = s.get(Rollout, rollout_id)
            if r is None:
                return
            if outcome is not None:
                r.outcome = outcome.value
            r.detail = {**(r.detail or {}), **detail}

    def unfinished_rollouts(self) -> list[RolloutRef]:
        """This host's base rollouts in flight, oldest first: every host's from `ix_rollouts_in_flight`
        (a handful), this one's kept here (by host, SQLite's planner would read all of this host's
        rollouts). An adapter rollout's end is the adapter reconcile (daemon.controller.adapters)."""
        with self.registry.session() as s:
            rows = s.scalars(select(Rollout).where(Rollout.outcome.is_(None)).order_by(Rollout.id)).all()
            return [
                RolloutRef(r.id, _ref(s, r.checkpoint), RolloutTrigger(r.trigger), r.transport, r.mode, dict(r.detail or {}))
                for r in rows if r.host == hosts.host_of(s) and r.transport != "adapter"
            ]

    def rollout_had_failure(self, rollout_id: int) -> bool:
        with self.registry.session() as s:
            n = s.scalar(
                select(func.count())
                .select_from(Event)
                .where(Event.rollout_id == rollout_id, Event.to_state.in_(("UNHEALTHY", "UNCERTAIN")))
            )
            return bool(n)

    def rollout_events(self, rollout_id: int) -> Sequence[tuple[str | None, str | None, str]]:
        with self.registry.session() as s:
            rows = s.execute(
                select(Event.worker, Event.from_state, Event.to_state).where(Event.rollout_id == rollout_id).order_by(Event.id)
            ).all()
            return [(w, f, t) for w, f, t in rows]
