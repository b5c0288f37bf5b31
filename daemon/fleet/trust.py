"""Who decided: the staged-rollout decision lock, and the admissions and fleet target hosts act on.

The database alone must not steer a fleet (issue 37):

- **The lock.** A decision pass (`daemon.fleet.stages.step`) locks the one row of
  `fleet_decider` (`SELECT ... FOR UPDATE SKIP LOCKED`). PostgreSQL lets only a role with UPDATE
  on that table take a row lock there, so a login with no grants can no longer stall the fleet
  (an advisory key needs no privilege at all). A pass that finds the row held and a decision due
  says so; several such polls in a row are the `fleet_stalled` problem (`Stall`).
- **Who decided.** Each admission (`fleet_rollout_hosts`) carries the deciding host and its tick
  (`fleet_decider.tick` after the decision), each explicit target (`fleet_target`) its `set_by`
  (the operator's name) and `set_at`. With `[fleet] signing_key` (Ed25519, PEM or 32 raw bytes,
  the same on every host and operator machine: any host may decide) each is signed over its
  canonical JSON, and hosts act only on rows whose signature verifies. Without a key, an admission
  counts only when its decider is a known host (it has `workers` rows) that recorded the
  `fleet_stage_admitted` event naming it, and an explicit target only when the newest
  `fleet_target_set` / `fleet_target_cleared` event is its setting. A role that can INSERT into
  those two tables but not into `events` (or, with a key, that lacks the key) is refused: the
  decider deletes a refused admission (event `fleet_admission_refused`), and every host names it
  as a problem (`fleet_decision_refused`) while the rollout or the row lasts.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from daemon.checks import read_ed25519_private
from daemon.common import WARNING, Problem
from daemon.registry import (
    Checkpoint,
    Event,
    FleetDecider,
    FleetRollout,
    FleetRolloutHost,
    FleetTarget,
    Worker,
)

STALL_POLLS = 5  # a decision due this many polls in a row, the lock held elsewhere: fleet_stalled
TARGET_EVENTS = ("fleet_target_set", "fleet_target_cleared")


def _stamp(at: datetime) -> str:
    return (at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)).isoformat()


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def admission_message(rollout_id: int, checkpoint_id: int, host: str, stage: int, decided_by: str | None,
                      tick: int | None) -> bytes:  # fmt: skip
    return _canonical({"what": "fleet_admission", "rollout_id": rollout_id, "checkpoint_id": checkpoint_id,
                       "host": host, "stage": stage, "decided_by": decided_by, "tick": tick})  # fmt: skip


def target_message(checkpoint_id: int, set_by: str | None, set_at: datetime) -> bytes:
    return _canonical({"what": "fleet_target", "checkpoint_id": checkpoint_id, "set_by": set_by,
                       "set_at": _stamp(set_at)})  # fmt: skip


@dataclass(frozen=True)
class Trust:
    """How this host signs its decisions and checks everyone's (`key` None: unsigned rules)."""

    key: Ed25519PrivateKey | None = None

    @classmethod
    def from_file(cls, path: str | Path | None) -> Trust:
        return cls(read_ed25519_private(Path(path)) if path else None)

    def sign(self, message: bytes) -> str | None:
        return base64.b64encode(self.key.sign(message)).decode("ascii") if self.key is not None else None

    def _signed(self, message: bytes, signature: str | None) -> str | None:
        """Why `signature` is not this key's over `message` (None: it is, or no key is configured)."""
        if self.key is None:
            return None
        if not signature:
            return "unsigned, and [fleet] signing_key is set"
        try:
            self.key.public_key().verify(base64.b64decode(signature, validate=True), message)
        except (InvalidSignature, binascii.Error, ValueError):
            return "its signature does not verify with [fleet] signing_key"
        return None

    def admission(self, s: Session, r: FleetRollout, row: FleetRolloutHost) -> str | None:
        """Why this host may not act on admission `row` (None: it may)."""
        msg = admission_message(r.id, r.checkpoint_id, row.host, row.stage, row.decided_by, row.tick)
        bad = self._signed(msg, row.signature)
        if bad is not None:
            return bad
        if not row.decided_by:
            return "no deciding host recorded"
        if s.scalars(select(Worker.host).where(Worker.host == row.decided_by).limit(1)).first() is None:
            return f"decided by {row.decided_by!r}, which is not a known host"
        events = s.scalars(select(Event.detail).where(Event.to_state == "fleet_stage_admitted",
                                                      Event.checkpoint_id == r.checkpoint_id,
                                                      Event.host == row.decided_by))  # fmt: skip
        for d in events:
            d = json.loads(d) if isinstance(d, str) else (d or {})
            if d.get("rollout_id") == r.id and row.host in d.get("hosts", ()):
                return None
        return f"{row.decided_by} recorded no admission of {row.host} (no fleet_stage_admitted event)"

    def target(self, s: Session, row: FleetTarget) -> str | None:
        """Why hosts may not follow the explicit target `row` (None: they may)."""
        bad = self._signed(target_message(row.checkpoint_id, row.set_by, row.set_at), row.signature)
        if bad is not None:
            return bad
        last = s.scalars(select(Event).where(Event.to_state.in_(TARGET_EVENTS))
                         .order_by(Event.id.desc()).limit(1)).first()  # fmt: skip
        d = (json.loads(last.detail) if isinstance(last.detail, str) else last.detail or {}) if last else {}
        if last is None or last.to_state != "fleet_target_set" or last.checkpoint_id != row.checkpoint_id \
                or d.get("by") != row.set_by:  # fmt: skip
            return "no fleet_target_set event records this setting"
        return None


def refused_target(s: Session, trust: Trust) -> tuple[FleetTarget | None, str | None]:
    """The explicit target row, and why it is refused (None: it stands, or there is none)."""
    row = s.get(FleetTarget, 1)
    if row is None:
        return None, None
    why = trust.target(s, row)
    if why is None:
        return row, None
    ckpt = s.get(Checkpoint, row.checkpoint_id)
    return row, f"fleet_target {ckpt.version if ckpt else row.checkpoint_id} set by {row.set_by!r}: refused ({why})"


def take_lock(s: Session, wait_s: float = 0.0) -> FleetDecider | None:
    """The decision lock (the `fleet_decider` row, locked until the transaction ends); None when
    another session holds it (after waiting up to `wait_s` for it: the host that begins a rollout
    decides its canary itself rather than leave it to the next tick elsewhere)."""
    if wait_s > 0 and s.get_bind().dialect.name == "postgresql":
        try:
            s.execute(text(f"SET LOCAL lock_timeout = '{int(wait_s * 1000)}ms'"))
            return s.scalars(select(FleetDecider).where(FleetDecider.id == 1).with_for_update()).first()
        except OperationalError:  # lock_timeout: held all that while
            s.rollback()
            return None
    row = s.scalars(select(FleetDecider).where(FleetDecider.id == 1).with_for_update(skip_locked=True)).first()
    if row is not None:
        return row
    if s.scalars(select(FleetDecider.id).where(FleetDecider.id == 1)).first() is not None:
        return None  # there, and locked by another session
    try:
        with s.begin_nested():
            s.add(FleetDecider(id=1, tick=0))
    except IntegrityError:
        return None
    return s.scalars(select(FleetDecider).where(FleetDecider.id == 1).with_for_update(skip_locked=True)).first()


class Stall:
    """Counts a host's polls in a row on which a decision was due and the lock held elsewhere."""

    def __init__(self) -> None:
        self.polls = 0
        self.reason: str | None = None
        self._last: tuple[Any, ...] | None = None

    def observe(self, mark: tuple[Any, ...] | None, due: list[str], what: str) -> str | None:
        """One poll: `mark` the rollout's (id, stage, state), `due` what a pass would have decided
        with the lock. The reason to report once STALL_POLLS polls in a row were stuck (else None)."""
        if not due or mark is None:
            self.polls, self._last, self.reason = 0, None, None
            return None
        self.polls = self.polls + 1 if mark == self._last else 1
        self._last = mark
        if self.polls < STALL_POLLS:
            return None
        self.reason = (f"{what}: {', '.join(sorted(set(due)))} due for {self.polls} polls, but another "
                       "database session holds the fleet decision lock (the fleet_decider row)")  # fmt: skip
        return self.reason


def problems(host: str, stalled: str | None, refused: list[str]) -> list[Problem]:
    out = [Problem("fleet_stalled", host, stalled, WARNING)] if stalled else []
    out += [Problem("fleet_decision_refused", host, "; ".join(refused), WARNING)] if refused else []
    return out
