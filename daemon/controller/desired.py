"""Desired state: what the base model should serve next, as a pure function of registry facts.

No I/O and no clock: the caller reads the facts (and `now`) and acts on the answer. The answer
for the waiting checkpoint is one of: deploy it, supersede it (by a newer queued checkpoint, or
by a serving version with a higher step), skip it (no longer waiting: rejected, gone, already
deployed), or wait (a newer checkpoint is still being verified and may supersede it), with the
reason and until when. Waiting is an answer, not a sleep: the runner puts the checkpoint back
in the queue's waiting slot and asks again on a later pass (daemon.controller.decisions).

    step = desired(Facts(candidate=ckpt, now=t, waiting_since=t0, newer_verifying=True))
    step.action == "wait" and step.until == t0 + LOOKAHEAD_MAX_S

Issue 35's order of precedence is pinned, an operator's target, what the fleet stage admits,
then the newest verified. Only the last is decided here for now: the runner hands out no deploy
while a version is pinned, operator targets are their own commands, and a fleet stage filters
arrivals before they reach the queue (daemon.fleet.agent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from daemon.registry import WAITING, CheckpointRef
from daemon.rollout import newer

LOOKAHEAD_MAX_S = 600.0  # longest wait for newer checkpoints still being verified

Action = Literal["deploy", "supersede", "skip", "wait"]


@dataclass(frozen=True)
class Facts:
    """What the registry and the queue say about the waiting checkpoint, read at `now` (monotonic)."""

    candidate: CheckpointRef  # the waiting checkpoint, as it was queued
    now: float
    waiting_since: float  # when the candidate began waiting for newer ones (the bound counts from here)
    newer_queued: CheckpointRef | None = None  # a newer verified checkpoint waits in the queue
    newer_verifying: bool = False  # a newer checkpoint is still being verified
    stopping: bool = False  # the daemon shuts down: no more waiting
    fresh: CheckpointRef | None = None  # the candidate's row now (None: gone); read only once not waiting
    serving: CheckpointRef | None = None


@dataclass(frozen=True)
class Desired:
    action: Action
    checkpoint: CheckpointRef  # the one deployed, superseded, skipped or waiting
    by: CheckpointRef | None = None  # supersede: the newer version that takes its place
    reason: str = ""
    until: float | None = None  # wait: the latest `now` it waits until


def lookahead(f: Facts) -> Desired | None:
    """Wait for a newer checkpoint still being verified, up to LOOKAHEAD_MAX_S; None: done waiting.
    Needs none of the rows: a caller that gets a wait reads nothing more."""
    until = f.waiting_since + LOOKAHEAD_MAX_S
    if f.newer_queued is None and not f.stopping and f.now < until and f.newer_verifying:
        return Desired("wait", f.candidate, reason="a newer checkpoint is still being verified", until=until)
    return None


def desired(f: Facts) -> Desired:
    """The next step for the waiting checkpoint (see the module docstring)."""
    if (wait := lookahead(f)) is not None:
        return wait
    if f.newer_queued is not None and f.newer_queued.id != f.candidate.id and newer(f.newer_queued, f.candidate):
        return Desired("supersede", f.candidate, by=f.newer_queued, reason="a newer checkpoint is queued")
    fresh = f.fresh
    if fresh is None or fresh.status not in WAITING:
        return Desired("skip", f.candidate, reason=f"it is {fresh.status.value if fresh else 'gone'}")
    if f.serving is not None and f.serving.id != fresh.id and newer(f.serving, fresh):
        # e.g. step-999 verified after step-1000 is serving: newer is the step, not arrival
        return Desired("supersede", fresh, by=f.serving, reason="a newer step is serving")
    return Desired("deploy", fresh)
