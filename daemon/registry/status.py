"""Checkpoint status: the one enum, the table of allowed transitions, and the one writer.

The pipeline's path is discovered -> [fetching ->] verifying -> verified -> [staged ->] deployed
-> retired; the side exits are rejected, deferred (retried), duplicate and superseded. The full
table is `TRANSITIONS` below.

`move(s, ckpt, to, message)` is the only code that changes `checkpoints.status` (a test greps the
package for other writers); a transition outside `TRANSITIONS` raises `IllegalStatusTransition`,
so a bug cannot write a history that skips verification. `note(s, ckpt, message)` changes only
the message. `create(...)` inserts a new row as `discovered`; `create_made(...)` records a
checkpoint the daemon made itself (the embedded seed). Every change appends an `events` row in
the caller's transaction.

The enums themselves (this one, rollout triggers and outcomes, failure kinds) live beside the
tables in `daemon.registry.models`, which validates every row against them; they are re-exported here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from daemon.registry.models import (
    Checkpoint,
    CheckpointStatus,
    Event,
    FailureKind,
    RolloutOutcome,
    RolloutTrigger,
    utcnow,
)

C = CheckpointStatus

# Operator commands may put back any version whose checks passed once (rejected and superseded
# included), so those lead back to deployed. Back to discovered (verified again from the start):
# a rejected or duplicate checkpoint whose files changed, and any version not serving on
# `hotswap reverify` (REVERIFIABLE).
TRANSITIONS: dict[CheckpointStatus, frozenset[CheckpointStatus]] = {
    C.DISCOVERED: frozenset({C.FETCHING, C.VERIFYING}),
    C.FETCHING: frozenset({C.FETCHING, C.VERIFYING, C.DISCOVERED, C.REJECTED}),  # fetching again: resumed
    C.VERIFYING: frozenset({C.VERIFYING, C.VERIFIED, C.REJECTED, C.DEFERRED, C.DUPLICATE}),  # again: resumed
    C.DEFERRED: frozenset({C.DISCOVERED}),
    C.VERIFIED: frozenset({C.STAGED, C.DEPLOYED, C.REJECTED, C.SUPERSEDED, C.DISCOVERED}),
    C.STAGED: frozenset({C.DEPLOYED, C.REJECTED, C.SUPERSEDED, C.DISCOVERED}),
    C.DEPLOYED: frozenset({C.RETIRED, C.REJECTED}),
    C.RETIRED: frozenset({C.DEPLOYED, C.DISCOVERED}),
    C.REJECTED: frozenset({C.DEPLOYED, C.RETIRED, C.DISCOVERED}),
    C.SUPERSEDED: frozenset({C.DEPLOYED, C.DISCOVERED}),
    C.DUPLICATE: frozenset({C.DISCOVERED}),
}

# Being processed when the daemon stopped: resumed on start.
UNFINISHED: tuple[CheckpointStatus, ...] = (C.DISCOVERED, C.FETCHING, C.VERIFYING)
# Verified and not yet deployed: a rollout may pick it up.
WAITING: tuple[CheckpointStatus, ...] = (C.VERIFIED, C.STAGED)
# Its checks passed once, whatever happened since: an operator may deploy it again.
DEPLOYABLE: tuple[CheckpointStatus, ...] = (C.VERIFIED, C.STAGED, C.DEPLOYED, C.RETIRED, C.REJECTED, C.SUPERSEDED)
# May be verified again from the start (`hotswap reverify`): everything settled except serving.
REVERIFIABLE: tuple[CheckpointStatus, ...] = (C.VERIFIED, C.STAGED, C.RETIRED, C.REJECTED, C.SUPERSEDED, C.DUPLICATE,
                                              C.DEFERRED)  # fmt: skip


__all__ = [
    "DEPLOYABLE", "REVERIFIABLE", "TRANSITIONS", "UNFINISHED", "WAITING", "CheckpointStatus", "FailureKind", "IllegalStatusTransition",
    "RolloutOutcome", "RolloutTrigger", "create", "create_made", "move", "note",
]  # fmt: skip


class IllegalStatusTransition(RuntimeError):
    """A status change the table does not have: a bug, never a checkpoint's fault."""


def _event(s: Session, ckpt: Checkpoint, previous: str | None, to: str, duration_ms: float | None,
           detail: dict[str, Any] | None) -> None:  # fmt: skip
    s.add(Event(at=utcnow(), checkpoint_id=ckpt.id, from_state=previous, to_state=to, duration_ms=duration_ms,
                detail=detail))  # fmt: skip


def move(
    s: Session,
    ckpt: Checkpoint,
    to: CheckpointStatus,
    message: str | None = None,
    *,
    duration_ms: float | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    """Change a checkpoint's status (an allowed transition) and append it to `events`."""
    to = CheckpointStatus(to)
    previous = CheckpointStatus(ckpt.status)
    if to not in TRANSITIONS[previous]:
        allowed = ", ".join(sorted(TRANSITIONS[previous])) or "none"
        raise IllegalStatusTransition(
            f"checkpoint {ckpt.version}: {previous} -> {to} is not allowed (from {previous}: {allowed})"
        )
    ckpt.status = to.value
    ckpt.status_message = message
    now = utcnow()
    if to is C.VERIFIED:
        ckpt.verified_at = now
    elif to is C.DEPLOYED:  # deployed_at stays the first deploy's; a rollback or pin records its own time
        if ckpt.deployed_at is None:
            ckpt.deployed_at = now
        ckpt.last_deployed_at = now
    _event(s, ckpt, previous.value, to.value, duration_ms, detail or ({"message": message} if message else None))


def note(s: Session, ckpt: Checkpoint, message: str | None, *, detail: dict[str, Any] | None = None) -> None:
    """Change only the status message (recorded as an event from the status to itself)."""
    ckpt.status_message = message
    _event(s, ckpt, ckpt.status, ckpt.status, None, detail or ({"message": message} if message else None))


def create(
    s: Session,
    *,
    version: str,
    source: str,
    uri: str,
    local_path: str | None,
    commit_signal: str | None,
    discovered_at: datetime | None = None,
    detail: dict[str, Any] | None = None,
) -> Checkpoint | None:
    """Insert a `discovered` checkpoint; None when the version is already known (a no-op).

    Uniqueness is enforced by the database, so two racing registrations of the same
    version still produce one row.
    """
    ckpt = Checkpoint(version=version, source=source, uri=uri, local_path=local_path, commit_signal=commit_signal,
                      status=C.DISCOVERED.value, discovered_at=discovered_at or utcnow())  # fmt: skip
    try:
        with s.begin_nested():
            s.add(ckpt)
            s.flush()
    except IntegrityError:
        return None
    _event(s, ckpt, None, C.DISCOVERED.value, None, {"source": source, "signal": commit_signal, **(detail or {})})
    return ckpt


def create_made(s: Session, *, version: str, local_path: str, digest: str, total_bytes: int, tensors: int,
                why: str, deployed: str) -> Checkpoint:  # fmt: skip
    """A checkpoint the daemon made itself (the embedded seed): recorded as verified, then deployed."""
    now = utcnow()
    ckpt = Checkpoint(version=version, source="embedded", uri=f"file://{local_path}", local_path=local_path,
                      commit_signal="manifest", digest=digest, total_bytes=total_bytes, tensor_count=tensors,
                      status=C.DISCOVERED.value, discovered_at=now)  # fmt: skip
    s.add(ckpt)
    s.flush()
    ckpt.status, ckpt.status_message, ckpt.verified_at = C.VERIFIED.value, why, now
    _event(s, ckpt, C.DISCOVERED.value, C.VERIFIED.value, None, {"message": why})
    move(s, ckpt, C.DEPLOYED, deployed)
    return ckpt
