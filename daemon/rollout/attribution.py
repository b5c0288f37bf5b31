"""Failure attribution: whose fault was a failed rollout, the checkpoint's or the fleet's?

Only a failure the checkpoint caused rejects it: the worker refused it (`refused`), answered
with other weights or a failed probe (`mismatch`), or failed otherwise while answering
(`error`). A worker that crashed or stopped answering mid-rollout (`unreachable`), or one
that was down before the rollout began (`unavailable`), is the fleet's fault: the version
stays `verified` and is rolled out again, at once when every worker is back on the fallback,
else when the health poll sees the whole fleet RUNNING again.

A worker that stops answering in the post-deploy health window is treated the same way: the
fleet is rolled back to the fallback, the version goes back to `verified` and is rolled out again.

The retries are bounded: a checkpoint whose rollouts keep killing a worker (it may be what
crashes it) is rejected after `max_infra_retries` such rollouts. `unavailable` (no worker
was touched) never counts against it. The count comes from the `rollouts` table, so it
survives a daemon restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sqlalchemy import select

from daemon.registry import FailureKind, Registry, Rollout, RolloutOutcome, RolloutTrigger

INFRA_KINDS: frozenset[FailureKind] = frozenset({FailureKind.UNREACHABLE, FailureKind.UNAVAILABLE})

Verdict = Literal["reject", "retry_now", "retry_when_back"]


@dataclass(frozen=True, slots=True)
class Attribution:
    verdict: Verdict
    attempts: int  # rollouts of this version that failed for a worker crash or outage (unreachable)
    message: str


def infra_attempts(registry: Registry, checkpoint_id: int) -> int:
    """`new` rollouts of the checkpoint that failed because a worker stopped answering: mid-rollout
    (failed, kind unreachable) or in the health window (rolled back, `health_window.infra`)."""
    with registry.session() as s:
        rows = s.execute(
            select(Rollout.outcome, Rollout.detail).where(
                Rollout.checkpoint_id == checkpoint_id,
                Rollout.trigger == RolloutTrigger.NEW.value,
                Rollout.outcome.in_((RolloutOutcome.FAILED.value, RolloutOutcome.ROLLED_BACK.value)),
            )
        ).all()
    n = 0
    for outcome, detail in rows:
        d = detail or {}
        if outcome == RolloutOutcome.FAILED.value:
            n += d.get("kind") == FailureKind.UNREACHABLE.value
        else:
            n += bool((d.get("health_window") or {}).get("infra"))
    return n


def attribute(
    registry: Registry,
    checkpoint_id: int,
    kind: FailureKind | None,
    unrecovered: list[str],
    reason: str | None,
    max_retries: int,
) -> Attribution:
    """What a failed rollout of a new checkpoint means for it."""
    if kind not in INFRA_KINDS:
        return Attribution("reject", 0, f"the checkpoint's fault: {reason}")
    attempts = infra_attempts(registry, checkpoint_id)
    if attempts > max_retries:
        return Attribution(
            "reject", attempts,
            f"{attempts} rollouts failed with a worker not answering (last: {reason}); gave up after "
            f"{max_retries} retries (rollout.max_infra_retries): it may be what crashes the worker",
        )  # fmt: skip
    left = max_retries - attempts
    if kind == FailureKind.UNAVAILABLE or unrecovered:
        return Attribution(
            "retry_when_back", attempts,
            f"not deployed yet: {reason}; not the checkpoint's fault, retried when every worker is back"
            + (f" ({left} retries left)" if attempts else ""),
        )  # fmt: skip
    return Attribution(
        "retry_now", attempts,
        f"not deployed yet: {reason}; a worker stopped answering (not the checkpoint's fault), "
        f"the fleet is back on the fallback: retrying ({left} retries left)",
    )  # fmt: skip
