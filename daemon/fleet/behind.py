"""Why this host does not serve the fleet target, from what its fleet agent sees on each tick.

A host is behind when the target is an operator's and it serves something else, or when the
target is newer than what it serves (a host ahead of the newest good version, e.g. inside its
own health window, is not behind: nothing moves it back). The cause, first that holds:

    pinned      an operator pinned this host (it stays there until `hotswap unpin`)
    updating    it converges now, holding a fleet lease slot
    waiting     it asked to converge and waits for a fleet lease (the holders are named)
    converging  it asked to converge; the job is queued or starting here
    not_here    the target's bytes are not on this host (no copy recorded here, and its source
                has not brought one: not found yet, not configured here, or fetching failed)
    failed      its last converge to the target did not get there (outcome and reason)
    busy        another job runs here first (a new version, a rollback, start-up)
    next        it asks to converge on its next look

`explain` is a pure function of those observations; `FleetAgent.behind` holds the last answer,
`problem` makes it the daemon's `host_behind` warning (`/health`, `/status`, `/metrics`) and
`record` writes it to `fleet_host_reasons` when it changes (one row per host, none while it is
on the target), which `hotswap status --fleet` and the `fleet_versions` view show.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from daemon.common import WARNING, Problem
from daemon.fleet.target import Target
from daemon.registry import CheckpointRef, FleetHostReason, Registry, utcnow
from daemon.rollout import newer


@dataclass(frozen=True)
class Behind:
    target: str
    cause: str  # one word (see the module docstring)
    reason: str  # one line for a person: what it serves, the target, the cause

    def doc(self) -> dict[str, str]:
        return {"target": self.target, "cause": self.cause, "reason": self.reason}


@dataclass(frozen=True)
class Attempt:
    """The agent's last request to converge: the version, and what `converge` returned (the
    controller's Future of the job's result; anything else when a test passes a plain callable)."""

    version: str
    result: object = None

    def running(self) -> bool:
        return isinstance(self.result, Future) and not self.result.done()

    def failure(self) -> str | None:
        """How a finished attempt fell short ("failed: worker w0 refused ..."), None if it did not."""
        if not isinstance(self.result, Future) or not self.result.done():
            return None
        exc = self.result.exception()
        if exc is not None:
            return f"refused: {one_line(str(exc))}"
        out: dict[str, Any] = self.result.result() or {}
        outcome = out.get("outcome")
        if outcome in ("failed", "superseded", "rolled_back"):
            why = out.get("reason")
            rid = out.get("rollout_id")
            return f"{outcome}{f' (rollout {rid})' if rid else ''}{f': {one_line(str(why))}' if why else ''}"
        return None


def is_behind(target: Target | None, serving: CheckpointRef | None) -> bool:
    """The agent would move this host (the rule of `FleetAgent.wanted`)."""
    if target is None:
        return False
    t = target.checkpoint
    return serving is None or (serving.id != t.id and (target.explicit or newer(t, serving)))


def explain(target: Target | None, serving: CheckpointRef | None, *, pinned: str | None, here: bool,
            doing: str | None, attempt: Attempt | None, leases: Sequence[dict[str, Any]], host: str,
            slots: int) -> Behind | None:  # fmt: skip
    if target is None or not is_behind(target, serving):
        return None
    t = target.checkpoint.version
    mine = attempt if attempt is not None and attempt.version == t else None

    def behind(cause: str, why: str) -> Behind:
        whose = ("the staged rollout's version for it" if target.staged
                 else "the operator's fleet target" if target.explicit else "the fleet target")
        return Behind(t, cause, f"serves {serving.version if serving else 'nothing'}, not {whose} {t}: {why}")

    if pinned is not None:
        return behind("pinned", f"pinned to {pinned} (`hotswap unpin` to follow the fleet)")
    if mine is not None and mine.running():
        held = [h for h in leases if h.get("host") == host]
        if held:
            return behind("updating", f"converging now (fleet lease slot {held[0].get('slot')})")
        if len(leases) >= slots:
            who = ", ".join(f"{h.get('host')} updating to {h.get('version')}" for h in leases)
            return behind("waiting", f"waiting for a fleet lease (all {slots} held: {who})")
        queued = doing is not None and doing != f"converge {t}"
        return behind("converging", f"asked to converge; {f'queued after {doing}' if queued else 'starting'}")
    if not here:
        return behind("not_here", "its files are not on this host (no copy recorded here, and its source "
                                  "has not brought one; tried again every 30 s)")  # fmt: skip
    failed = mine.failure() if mine is not None else None
    if failed is not None:
        return behind("failed", f"its last converge {failed}; tried again every 30 s")
    if doing:
        return behind("busy", f"busy with {doing}; converges after it")
    return behind("next", "converges on its next look")


def problem(host: str, behind: Behind | None) -> list[Problem]:
    return [Problem("host_behind", host, behind.reason, WARNING)] if behind is not None else []


def record(registry: Registry, behind: Behind | None) -> None:
    """This host's row of `fleet_host_reasons`: written when the reason changes, gone when on target."""
    with registry.session() as s:
        row = s.get(FleetHostReason, registry.host)
        if behind is None:
            if row is not None:
                s.delete(row)
            return
        now = utcnow()
        if row is None:
            s.add(FleetHostReason(host=registry.host, target=behind.target, cause=behind.cause, reason=behind.reason,
                                  since=now, updated_at=now))  # fmt: skip
            return
        if row.target != behind.target:
            row.since = now  # behind another target: its own clock
        row.target, row.cause, row.reason, row.updated_at = behind.target, behind.cause, behind.reason, now


def one_line(text: str, most: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= most else flat[: most - 1] + "…"
