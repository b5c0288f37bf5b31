"""Which registry events are webhook events, and the names receivers see.

A webhook event is an `events` row (daemon.registry): a checkpoint status moving to verified,
rejected or deployed; a version rolled back; a staged fleet rollout advancing, halting, aborting
or finishing; a problem starting or ending. Nothing else is sent.
"""

from __future__ import annotations

STATUS_EVENTS = {"verified": "version.verified", "rejected": "version.rejected", "deployed": "version.deployed"}
OTHER_EVENTS = {
    "rolled_back": "version.rolled_back",
    "fleet_stage_advanced": "rollout.stage_advanced",
    "fleet_rollout_halted": "rollout.halted",
    "fleet_rollout_aborted": "rollout.aborted",
    "fleet_rollout_done": "rollout.done",
    "problem_started": "problem.started",
    "problem_ended": "problem.ended",
}
WEBHOOK_EVENTS = (*STATUS_EVENTS.values(), *OTHER_EVENTS.values())


def webhook_event(from_state: str | None, to_state: str) -> str | None:
    """The webhook event an events row is, or None (a status note, from a status to itself, is none)."""
    if to_state in STATUS_EVENTS:
        return STATUS_EVENTS[to_state] if from_state != to_state else None
    return OTHER_EVENTS.get(to_state)
