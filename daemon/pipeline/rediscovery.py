"""A source handed on a version label that is already registered: what does it mean?

Every registration records a fingerprint of the directory's files (name, size, mtime of each;
stat only) in its `discovered` event; in a fleet, each host records its own copy's (a `copy`
event, when it finds or fetches the version another host registered). A fingerprint is a host's
own: it is compared only with those that host recorded (events carry their host), never with
another host's copy, whose times differ though its bytes are the same. When the same label
arrives again:

* from the same place, unchanged (every daemon start re-discovers its folder): nothing.
* from the same place, files changed: a `rejected` or `duplicate` checkpoint is verified again
  from the start (back to `discovered`: a writer that stalled past the commit timeout, or a
  re-published fix, is not lost for good); any other status keeps its verdict, and the change is
  recorded (an event and the status message; `hotswap reverify VERSION` checks it again).
* `hotswap reverify VERSION` (`request_reverify`): any settled version but the serving one goes
  back to `discovered`.
* from another place (another directory, or a manifest naming the same version): a conflict.
  The label stays with the first registration, and the conflict is recorded on it once per
  claimant (event detail `conflict`, the status message, a warning log line) so the other
  directory is never dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from daemon.registry import Checkpoint, CheckpointStatus, Event, hosts, status
from daemon.sources import DiscoveredCheckpoint, fingerprint

__all__ = ["fingerprint", "handle", "changed_since_verdict", "request_reverify"]

C = CheckpointStatus
# The reason recorded when an operator asks for it (hotswap reverify, POST /v1/checkpoints/reverify).
OPERATOR_REVERIFY = "re-verification requested by an operator (hotswap reverify)"
Outcome = Literal["unchanged", "reverify", "changed", "conflict"]
LOOK_AGAIN: tuple[CheckpointStatus, ...] = (C.REJECTED, C.DUPLICATE)


@dataclass(frozen=True, slots=True)
class Rediscovered:
    outcome: Outcome
    message: str = ""


def _details(s: Session, checkpoint_id: int) -> list[dict[str, Any]]:
    """The checkpoint's own events written by this host (rows from before hosts were recorded too),
    newest first."""
    mine = or_(Event.host == hosts.host_of(s), Event.host.is_(None))
    rows = s.scalars(
        select(Event.detail).where(Event.checkpoint_id == checkpoint_id, Event.worker.is_(None), mine)
        .order_by(Event.id.desc())
    ).all()
    return [d for d in rows if isinstance(d, dict)]


def _last_fingerprint(details: list[dict[str, Any]]) -> str | None:
    for d in details:
        fp = d.get("fingerprint")
        if isinstance(fp, str):
            return fp
    return None


def changed_since_verdict(s: Session, checkpoint_id: int, directory: Path) -> bool:
    """True when `directory` no longer holds what the checkpoint's verdict was made on: its
    fingerprint now differs from the one recorded at registration or re-verification (a
    `changed` note does not move that reference)."""
    for d in _details(s, checkpoint_id):
        fp = d.get("fingerprint")
        if isinstance(fp, str) and not d.get("changed") and not d.get("conflict"):
            return fingerprint(directory) not in (fp, None)
    return False


def handle(s: Session, ckpt: Checkpoint, item: DiscoveredCheckpoint) -> Rediscovered:
    """Decide and record (in the caller's transaction) what a re-discovered label means."""
    fp = fingerprint(item.directory)
    details = _details(s, ckpt.id)
    where = str(item.directory) if item.directory is not None else item.uri
    here = item.directory is not None and hosts.local_path(s, ckpt.id) == str(item.directory)
    if item.uri != ckpt.uri and not here:  # this host's own copy of a fleet version is the same place
        seen = any((d.get("conflict") or {}).get("uri") == item.uri for d in details)
        if seen:
            return Rediscovered("unchanged")
        message = (f"version label {ckpt.version!r} is also claimed by {where} (signal {item.signal}); it keeps "
                   f"{ckpt.uri}: rename the other or give it another version")  # fmt: skip
        status.note(s, ckpt, message, detail={"message": message, "conflict": {
            "uri": item.uri, "directory": where, "signal": item.signal, "source": item.source, "fingerprint": fp}})  # fmt: skip
        return Rediscovered("conflict", message)
    last = _last_fingerprint(details)
    if fp is None or last is None or fp == last:
        return Rediscovered("unchanged")
    was = CheckpointStatus(ckpt.status)
    if was in LOOK_AGAIN:
        message = f"files changed after it was {was.value}: verifying again"
        status.move(s, ckpt, C.DISCOVERED, message, detail={"message": message, "fingerprint": fp, "was": was.value})
        return Rediscovered("reverify", message)
    if was in status.UNFINISHED:
        return Rediscovered("unchanged")  # being verified: the checks read what is there now
    message = (f"files changed after it was {was.value} (not verified again; `hotswap reverify {ckpt.version}` "
               "checks it again)")  # fmt: skip
    status.note(s, ckpt, message, detail={"message": message, "fingerprint": fp, "changed": True})
    return Rediscovered("changed", message)


def request_reverify(s: Session, version: str, why: str) -> tuple[int, str]:
    """Move `version` back to `discovered` (in the caller's transaction); (id, status before)."""
    ckpt = s.scalars(select(Checkpoint).where(Checkpoint.version == version)).one_or_none()
    if ckpt is None:
        raise LookupError(f"unknown version {version!r} (see `hotswap history`)")
    was = ckpt.status
    if was in status.UNFINISHED:
        raise ValueError(f"version {version!r} is {was}: it is being verified already")
    if was not in status.REVERIFIABLE:
        raise ValueError(f"version {version!r} is {was}: roll back or deploy another version before verifying it again")
    status.move(s, ckpt, C.DISCOVERED, why, detail={"message": why, "reverify": True, "was": was})
    return ckpt.id, was
