"""daemon.controller.desired: the waiting checkpoint's next step, from facts alone (no registry, no clock)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from daemon.controller.desired import LOOKAHEAD_MAX_S, Desired, Facts, desired, lookahead
from daemon.registry.journal import CheckpointRef
from daemon.registry.status import CheckpointStatus as C

pytestmark = pytest.mark.quick


def ref(id: int, status: C = C.VERIFIED, step: int | None = None) -> CheckpointRef:
    return CheckpointRef(id=id, version=f"v{id}", digest=None, local_path=f"/ckpt/v{id}", tensor_count=1,
                         status=status, verified=status != C.VERIFYING, step=step)  # fmt: skip


V5 = ref(5)


def facts(**kw: object) -> Facts:
    """V5 waits since t=100, looked at t=100; its row unchanged, nothing serving, nothing newer."""
    return replace(Facts(candidate=V5, now=100.0, waiting_since=100.0, fresh=V5), **kw)  # type: ignore[arg-type]


def test_a_verified_checkpoint_with_nothing_newer_is_deployed() -> None:
    assert desired(facts()) == Desired("deploy", V5)


def test_a_newer_checkpoint_in_verification_means_wait_until_the_bound() -> None:
    step = desired(facts(newer_verifying=True))
    assert step.action == "wait" and step.checkpoint is V5
    assert step.until == 100.0 + LOOKAHEAD_MAX_S and "verified" in step.reason


def test_the_bound_counts_from_when_it_began_waiting_not_from_now() -> None:
    assert desired(facts(newer_verifying=True, waiting_since=40.0, now=100.0)).until == 40.0 + LOOKAHEAD_MAX_S


def test_waiting_ends_at_the_600_s_bound_and_it_is_deployed() -> None:
    assert LOOKAHEAD_MAX_S == 600.0
    just_before = facts(newer_verifying=True, waiting_since=0.0, now=599.9)
    assert desired(just_before).action == "wait"
    assert desired(replace(just_before, now=600.0)) == Desired("deploy", V5)
    assert desired(replace(just_before, now=10_000.0)) == Desired("deploy", V5)


def test_no_waiting_while_the_daemon_stops() -> None:
    assert desired(facts(newer_verifying=True, stopping=True)) == Desired("deploy", V5)


def test_a_newer_queued_checkpoint_supersedes_it_without_waiting() -> None:
    v6 = ref(6)
    step = desired(facts(newer_queued=v6, newer_verifying=True))
    assert (step.action, step.checkpoint, step.by) == ("supersede", V5, v6)


def test_a_queued_checkpoint_that_is_not_newer_does_not_supersede_it() -> None:
    assert desired(facts(newer_queued=V5)) == Desired("deploy", V5)
    older_step = ref(9, step=1)  # arrived later, but an older training step
    assert desired(facts(candidate=ref(5, step=2), fresh=ref(5, step=2), newer_queued=older_step)).action == "deploy"


@pytest.mark.parametrize("status", [C.REJECTED, C.SUPERSEDED, C.DEPLOYED, C.RETIRED, C.VERIFYING])
def test_a_checkpoint_no_longer_waiting_is_skipped(status: C) -> None:
    step = desired(facts(fresh=ref(5, status)))
    assert step.action == "skip" and status.value in step.reason


def test_a_checkpoint_whose_row_is_gone_is_skipped() -> None:
    step = desired(facts(fresh=None))
    assert step.action == "skip" and "gone" in step.reason


def test_a_staged_checkpoint_still_waits_its_turn_and_is_deployed() -> None:
    staged = ref(5, C.STAGED)
    assert desired(facts(fresh=staged)) == Desired("deploy", staged)


def test_a_higher_step_serving_supersedes_a_lower_step_verified_later() -> None:
    s999, s1000 = ref(7, step=999), ref(3, C.DEPLOYED, step=1000)  # step-999 arrived after step-1000
    step = desired(facts(candidate=s999, fresh=s999, serving=s1000))
    assert (step.action, step.checkpoint, step.by) == ("supersede", s999, s1000)


def test_an_older_serving_version_lets_it_deploy() -> None:
    assert desired(facts(serving=ref(2, C.DEPLOYED))) == Desired("deploy", V5)
    assert desired(facts(serving=ref(9, C.DEPLOYED, step=1), candidate=ref(5, step=2), fresh=ref(5, step=2))).action == "deploy"


def test_serving_the_candidate_itself_is_not_a_supersede() -> None:
    assert desired(facts(serving=V5)) == Desired("deploy", V5)


def test_the_wait_comes_before_the_rows_are_looked_at() -> None:
    # a pass that waits reads only the lookahead facts: the rows may be unread (None) then
    waiting = facts(newer_verifying=True, fresh=None)
    assert desired(waiting).action == "wait" and lookahead(waiting) == desired(waiting)
    assert lookahead(facts()) is None


def test_it_deploys_the_fresh_row_not_the_queued_copy() -> None:
    fresh = ref(5, C.STAGED)
    assert desired(facts(fresh=fresh)).checkpoint is fresh
