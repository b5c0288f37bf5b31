"""Staged fleet rollouts: a new version reaches a few hosts first and the rest only when they pass.

    [[fleet.stages]]       # 1 canary host (the one that verified the version first), baked 60 s
    hosts = 1
    bake_s = 60
    [[fleet.stages]]
    percent = 50           # then half the fleet's hosts
    bake_s = 120
    # an implicit last stage: every host

A rollout row (`fleet_rollouts`) is begun by the first host that verifies a version newer than
the fleet's target, when its `[fleet] stages` is set; its plan is stored in the row, so every
host follows the same one. Each stage admits hosts (`fleet_rollout_hosts`: the canary first,
then by name); only admitted hosts take the version (`admitted`, asked by the rollout service
before it deploys and by the fleet agent before it converges). Nothing else moves a host onto it.

`step` is level-triggered and run by every host's fleet agent each tick; the one that locks the
`fleet_decider` row decides (daemon.fleet.trust: a row lock only the fleet role can take, and who
decided each admission), so no host is special and the death of any one costs nothing (the next
tick elsewhere decides). Hosts act only on admissions that verify. Each pass compares the stage
with what the registry says of its hosts:

- the version was rejected (a stage host's health window, or its rollout, found it bad: the same
  verdict a single host acts on) -> **halted**: no host outside the stage is ever admitted, and
  the fleet agents of the hosts on it move them back to the previous fleet version;
- every admitted host serves it and has it as `last_good` (it passed its health window there)
  -> the stage is ready; `bake_s` later the next stage is admitted; after the last, **done**.

Operators: `hotswap fleet rollout [status | pause | resume | abort]` (`command`). Every decision
is an event (`fleet_rollout_*`, `fleet_stage_*`); the view `fleet_stage_hosts` shows each stage's
hosts and their state.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from daemon.common import get_logger
from daemon.fleet.settings import FleetSettings, StageSpec
from daemon.fleet.trust import Trust, admission_message, take_lock
from daemon.registry import (
    TRANSITIONS,
    Alias,
    Checkpoint,
    CheckpointRef,
    CheckpointStatus,
    Event,
    FleetRollout,
    FleetRolloutHost,
    Journal,
    Registry,
    Worker,
    record_event,
    utcnow,
)
from daemon.registry import summary as gate_summary

log = get_logger(__name__)
ACTIVE = ("running", "paused")
BEGIN_WAIT_S = 5.0  # the host that begins a rollout waits this long for the lock to admit its canary
ENDED = ("done", "superseded")


def stage_label(index: int, stages: int) -> str:
    """How every reason, answer and status line names a stage: counted from 1 ("stage 1 of 2");
    the rows and JSON keep the 0-based index (`fleet_rollouts.stage`)."""
    return f"stage {index + 1} of {stages}"


class StageCommandRefused(ValueError):
    """An operator command that does not apply (no staged rollout in progress, already paused)."""


def plan_of(stages: list[StageSpec]) -> list[dict[str, Any]]:
    """The configured stages, with the implicit last stage (every host) when they stop short of it."""
    plan = [{k: v for k, v in asdict(st).items() if v} | {"bake_s": st.bake_s} for st in stages]
    if not plan or plan[-1].get("percent") != 100:
        plan.append({"percent": 100, "bake_s": 0})
    return plan


@dataclass(frozen=True)
class HostStage:
    """What the newest staged rollout means for one host (`for_host`)."""

    rollout_id: int
    version: CheckpointRef
    previous: CheckpointRef | None
    state: str  # running, paused, halted, aborted
    stage: int  # the rollout's stage now
    stages: int
    admitted: bool  # this host is in a stage already admitted (by an admission that verifies)
    refused: tuple[str, ...] = ()  # forged admissions seen in it (this host's own, or deleted by a decider)
    stalled: str | None = None  # a decision due and the lock held elsewhere (fleet_stalled)


def for_host(journal: Journal, host: str, trust: Trust | None = None) -> HostStage | None:
    """The newest staged rollout, when it is not over (done or superseded): None otherwise."""
    with journal.registry.session() as s:
        r = s.scalars(select(FleetRollout).order_by(FleetRollout.id.desc()).limit(1)).first()
        if r is None or r.state in ENDED:
            return None
        row = s.get(FleetRolloutHost, (r.id, host))
        mine = (trust or Trust()).admission(s, r, row) if row is not None else None
        admitted = row is not None and mine is None
        refused = [f"admission of {host} to stage {row.stage}: {mine}"] if row is not None and mine else []
        refused += [str((e or {}).get("reason")) for e in s.scalars(
            select(Event.detail).where(Event.to_state == "fleet_admission_refused", Event.checkpoint_id == r.checkpoint_id)
            .order_by(Event.id.desc()).limit(5))]  # fmt: skip
        stalled = r.stalled
        rid, ckpt_id, prev_id, state, stage, n = (
            r.id,
            r.checkpoint_id,
            r.previous_checkpoint_id,
            r.state,
            r.stage,
            len(r.plan),
        )
    version = journal.checkpoint(ckpt_id)
    if version is None:
        return None
    previous = journal.checkpoint(prev_id) if prev_id is not None else None
    return HostStage(rid, version, previous, state, stage, n, admitted, tuple(refused), stalled)


def held_back(registry: Registry) -> tuple[str, set[str]] | None:
    """The staged rollout in progress: its version and the hosts admitted so far (the others are
    held on the previous version by design, not behind); None when none is in progress."""
    with registry.session() as s:
        r = s.scalars(select(FleetRollout).where(FleetRollout.state.in_(ACTIVE))
                      .order_by(FleetRollout.id.desc()).limit(1)).first()  # fmt: skip
        if r is None:
            return None
        ckpt = s.get(Checkpoint, r.checkpoint_id)
        hosts = set(s.scalars(select(FleetRolloutHost.host).where(FleetRolloutHost.rollout_id == r.id)))
        return (ckpt.version if ckpt else "", hosts)


def admitted(journal: Journal, ckpt: CheckpointRef, settings: FleetSettings, previous: CheckpointRef | None,
             trust: Trust | None = None) -> bool:  # fmt: skip
    """May this host deploy `ckpt` now? Begins its staged rollout when none exists and stages are
    configured (`previous`: the fleet target it replaces; none: nothing to protect, no stages)."""
    host = journal.registry.host
    row = _rollout_of(journal.registry, ckpt.id)
    if row is None:
        if not settings.stages or previous is None or previous.id == ckpt.id:
            return True
        begin(journal, ckpt, previous, plan_of(settings.stages))
        step(journal, trust=trust, wait_s=BEGIN_WAIT_S)
        row = _rollout_of(journal.registry, ckpt.id)
        if row is None:
            return True
    state, rid = row
    if state == "done":
        return True
    if state != "running":
        return False
    with journal.registry.session() as s:
        r, mine = s.get(FleetRollout, rid), s.get(FleetRolloutHost, (rid, host))
        return r is not None and mine is not None and (trust or Trust()).admission(s, r, mine) is None


def stage_gates(registry: Registry, checkpoint_id: int, host: str) -> tuple[int, list[str]] | None:
    """The stage of `checkpoint_id`'s staged rollout that admitted `host`, and that stage's gates
    (`[[fleet.stages]] gates`, stored in the rollout's plan); None: no staged rollout admitted it."""
    with registry.session() as s:
        r = s.scalars(select(FleetRollout).where(FleetRollout.checkpoint_id == checkpoint_id)).first()
        row = s.get(FleetRolloutHost, (r.id, host)) if r is not None else None
        if r is None or row is None:
            return None
        return row.stage, [str(g) for g in r.plan[row.stage].get("gates", [])] if row.stage < len(r.plan) else []


def _rollout_of(registry: Registry, checkpoint_id: int) -> tuple[str, int] | None:
    with registry.session() as s:
        r = s.scalars(select(FleetRollout).where(FleetRollout.checkpoint_id == checkpoint_id)).first()
        return (r.state, r.id) if r is not None else None


def begin(journal: Journal, ckpt: CheckpointRef, previous: CheckpointRef, plan: list[dict[str, Any]]) -> None:
    """A staged rollout of `ckpt` (a second host beginning the same one finds it begun); an older
    one still in progress is superseded by it."""
    reg = journal.registry
    try:
        with reg.session() as s:
            now = utcnow()
            s.execute(update(FleetRollout).where(FleetRollout.state.in_(ACTIVE))
                      .values(state="superseded", reason=f"superseded by {ckpt.version}", updated_at=now))  # fmt: skip
            s.add(FleetRollout(checkpoint_id=ckpt.id, previous_checkpoint_id=previous.id, plan=plan, stage=0,
                               state="running", created_by=reg.host, created_at=now, updated_at=now,
                               stage_started_at=now))  # fmt: skip
            s.flush()
            record_event(s, to_state="fleet_rollout_started", checkpoint_id=ckpt.id,
                         detail={"version": ckpt.version, "previous": previous.version, "plan": plan})  # fmt: skip
    except IntegrityError:
        return  # another host began it first
    log.info("fleet_rollout_started", version=ckpt.version, previous=previous.version, stages=len(plan))


@dataclass(frozen=True)
class _Decider:
    host: str
    tick: int  # fleet_decider.tick once this pass's decisions are taken
    trust: Trust
    dry: bool = False  # a pass that only finds what is due (the lock held elsewhere), rolled back


def step(journal: Journal, now: datetime | None = None, *, trust: Trust | None = None,
         blocked: list[str] | None = None, wait_s: float = 0.0) -> list[str]:  # fmt: skip
    """One decision pass over the staged rollout in progress; the decisions taken (event names).
    When another session holds the decision lock (after `wait_s`), `blocked` gets the decisions
    this pass would have taken (found in a transaction rolled back at once), and nothing is decided."""
    decided: list[str] = []
    version = None
    host = journal.registry.host
    with journal.registry.session() as s:
        lock = take_lock(s, wait_s)
        r = s.scalars(select(FleetRollout).where(FleetRollout.state.in_(ACTIVE))
                      .order_by(FleetRollout.id.desc()).limit(1)).first()  # fmt: skip
        if r is None:
            return decided
        now = now or utcnow()
        who = _Decider(host, int(lock.tick) + 1 if lock is not None else 0, trust or Trust(), dry=lock is None)
        if lock is None:
            if blocked is not None:
                try:
                    _decide(s, r, now, blocked, who)
                except Exception:  # noqa: BLE001 - a decider at work meanwhile (its rows conflict): not stalled
                    blocked.clear()
                s.rollback()
            return decided
        version = _decide(s, r, now, decided, who)
        if decided:
            lock.tick, lock.host, lock.decided_at = who.tick, host, now
        if r.stalled is not None:
            r.stalled = None
    for d in decided:
        log.info(d, version=version, host=host)
    return decided


def _decide(s: Session, r: FleetRollout, now: datetime, decided: list[str], who: _Decider) -> str | None:
    ckpt = s.get(Checkpoint, r.checkpoint_id)
    version = ckpt.version if ckpt else None
    if ckpt is None or ckpt.status == CheckpointStatus.REJECTED.value:
        why = f"{ckpt.version if ckpt else 'the version'} was rejected at {stage_label(r.stage, len(r.plan))}"
        _end(s, r, "halted", f"{why}: {ckpt.status_message if ckpt else 'its row is gone'}", now, decided)
        return version
    if r.state == "paused":
        return version
    members = _admit(s, r, now, decided, who)
    stage_hosts = [h for h, st in members.items() if st <= r.stage]
    if _ready(s, r.checkpoint_id, stage_hosts):
        if r.stage_ready_at is None:
            r.stage_ready_at = r.updated_at = now
            _event(s, r, "fleet_stage_ready", {"hosts": sorted(stage_hosts)}, decided)
        elif (now - r.stage_ready_at).total_seconds() >= float(r.plan[r.stage].get("bake_s", 0)):
            if r.stage + 1 >= len(r.plan):
                _end(s, r, "done", None, now, decided)
            else:
                r.stage, r.stage_started_at, r.stage_ready_at, r.updated_at = r.stage + 1, now, None, now
                _event(s, r, "fleet_stage_advanced", {}, decided)
                _admit(s, r, now, decided, who)
    elif r.stage_ready_at is not None:
        r.stage_ready_at, r.updated_at = None, now  # a host left the version: bake again once back
    return version


def note_stalled(registry: Registry, rollout_id: int, reason: str) -> None:
    """Why the rollout's due decision waits (its row's `stalled`; the next pass that decides clears it)."""
    with registry.session() as s:
        s.execute(update(FleetRollout).where(FleetRollout.id == rollout_id).values(stalled=reason))


def _event(s: Session, r: FleetRollout, name: str, detail: dict[str, Any], decided: list[str]) -> None:
    record_event(s, to_state=name, checkpoint_id=r.checkpoint_id,
                 detail={"rollout_id": r.id, "stage": r.stage, "of": len(r.plan), **detail})  # fmt: skip
    decided.append(name)


def _end(
    s: Session, r: FleetRollout, state: str, reason: str | None, now: datetime, decided: list[str]
) -> None:
    r.state, r.reason, r.updated_at = state, reason, now
    _event(s, r, f"fleet_rollout_{state}", {"reason": reason} if reason else {}, decided)


def _admit(s: Session, r: FleetRollout, now: datetime, decided: list[str], who: _Decider) -> dict[str, int]:
    """Every stage up to the current one holds its hosts (admitted once, never taken back). An
    admission that does not verify (daemon.fleet.trust) is deleted, with an event saying why."""
    members: dict[str, int] = {}
    for row in list(s.scalars(select(FleetRolloutHost).where(FleetRolloutHost.rollout_id == r.id))):
        why = who.trust.admission(s, r, row)
        if why is None:
            members[row.host] = row.stage
            continue
        reason = (f"admission of {row.host} to stage {row.stage} (decided_by {row.decided_by!r}, tick {row.tick}) "
                  f"refused: {why}")  # fmt: skip
        s.execute(delete(FleetRolloutHost).where(FleetRolloutHost.rollout_id == r.id, FleetRolloutHost.host == row.host))
        _event(s, r, "fleet_admission_refused", {"host": row.host, "reason": reason}, decided)
        if not who.dry:
            log.warning("fleet_admission_refused", rollout_id=r.id, host=row.host, reason=reason)
    known = sorted({h for h in s.scalars(select(Worker.host).distinct()) if h})
    order = sorted((h for h in known if h not in members), key=lambda h: (h != r.created_by, h))
    added: list[str] = []
    for k in range(r.stage + 1):
        spec = r.plan[k]
        if spec.get("names"):
            new = [h for h in order if h in spec["names"]]
        else:
            want = (
                int(spec["hosts"])
                if spec.get("hosts")
                else math.ceil(float(spec["percent"]) * len(known) / 100)
            )
            new = order[: max(0, want - len(members))]
        for h in new:
            members[h] = k
            order.remove(h)
            sig = who.trust.sign(admission_message(r.id, r.checkpoint_id, h, k, who.host, who.tick))
            s.add(FleetRolloutHost(rollout_id=r.id, host=h, stage=k, admitted_at=now, decided_by=who.host,
                                   tick=who.tick, signature=sig))  # fmt: skip
        added += new
    if added:
        s.flush()
        _event(s, r, "fleet_stage_admitted", {"hosts": added, "tick": who.tick}, decided)
    return members


def _ready(s: Session, checkpoint_id: int, stage_hosts: list[str]) -> bool:
    """Every host of the stage serves the version and passed its health window there (last_good)."""
    if not stage_hosts:
        return False
    rows = s.execute(select(Alias.host, Alias.name).where(Alias.host.in_(stage_hosts), Alias.checkpoint_id == checkpoint_id,
                                                          Alias.name.in_(("serving", "last_good")))).all()  # fmt: skip
    on = {(h, n) for h, n in rows}
    return all((h, "serving") in on and (h, "last_good") in on for h in stage_hosts)


def command(journal: Journal, action: str, by: str) -> str:
    """pause, resume or abort the staged rollout in progress; one line saying what was done."""
    with journal.registry.session() as s:
        r = s.scalars(select(FleetRollout).where(FleetRollout.state.in_(ACTIVE))
                      .order_by(FleetRollout.id.desc()).limit(1)).first()  # fmt: skip
        if r is None:
            raise StageCommandRefused(
                "no staged fleet rollout in progress (see `hotswap fleet rollout status`)"
            )
        ckpt = s.get(Checkpoint, r.checkpoint_id)
        version = ckpt.version if ckpt else str(r.checkpoint_id)
        now = utcnow()
        decided: list[str] = []
        if action == "pause":
            if r.state == "paused":
                raise StageCommandRefused(f"the staged rollout of {version} is paused already")
            r.state, r.reason, r.updated_at = "paused", f"paused by {by}", now
            _event(s, r, "fleet_rollout_paused", {"by": by}, decided)
        elif action == "resume":
            if r.state == "running":
                raise StageCommandRefused(f"the staged rollout of {version} is running, not paused")
            r.state, r.reason, r.stage_ready_at, r.updated_at = "running", None, None, now  # bake again
            _event(s, r, "fleet_rollout_resumed", {"by": by}, decided)
        elif action == "abort":
            _end(s, r, "aborted", f"aborted by {by} at {stage_label(r.stage, len(r.plan))}", now, decided)
        else:
            raise StageCommandRefused(f"unknown action {action!r}: pause, resume or abort")
        ckpt_id, stage = r.checkpoint_id, stage_label(r.stage, len(r.plan))
    if action == "abort":
        _reject(journal, ckpt_id, f"fleet rollout aborted by {by} at {stage}")
    return f"{action}: the staged rollout of {version} ({stage})"


def _reject(journal: Journal, checkpoint_id: int, message: str) -> None:
    """Off the list of versions the fleet follows: hosts on it go back (their fleet agents)."""
    ref = journal.checkpoint(checkpoint_id)
    if ref is not None and CheckpointStatus.REJECTED in TRANSITIONS.get(ref.status, frozenset()):
        journal.move_status(checkpoint_id, CheckpointStatus.REJECTED, message)
    elif ref is not None:
        journal.note(checkpoint_id, message)


def status(registry: Registry) -> dict[str, Any] | None:
    """The newest staged rollout and each stage's hosts (the view `fleet_stage_hosts`)."""
    with registry.session() as s:
        r = s.scalars(select(FleetRollout).order_by(FleetRollout.id.desc()).limit(1)).first()
        if r is None:
            return None
        version = s.get(Checkpoint, r.checkpoint_id)
        previous = s.get(Checkpoint, r.previous_checkpoint_id) if r.previous_checkpoint_id else None
        hosts = [dict(m) for m in s.execute(text(
            "SELECT stage, host, serving, host_state FROM fleet_stage_hosts WHERE rollout_id = :r ORDER BY stage, host"),
            {"r": r.id}).mappings()]  # fmt: skip
        return {"rollout_id": r.id, "version": version.version if version else None,
                "previous": previous.version if previous else None, "state": r.state, "reason": r.reason,
                "stage": r.stage, "plan": r.plan, "created_by": r.created_by, "stalled": r.stalled,
                "stage_started_at": r.stage_started_at.isoformat(),
                "stage_ready_at": r.stage_ready_at.isoformat() if r.stage_ready_at else None, "hosts": hosts,
                "gates": gate_summary(s, r.checkpoint_id)}  # fmt: skip
