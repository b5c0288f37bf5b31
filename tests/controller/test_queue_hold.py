"""daemon.controller.queue: a checkpoint put back to wait is held in the slot, commands still go first;
each command (daemon.controller.commands) says what it is."""

from __future__ import annotations

import time

import pytest

from daemon.controller.commands import (
    AdapterDeploy,
    AdapterPin,
    AdapterReconcile,
    AdapterRollback,
    AdapterUnpin,
    Converge,
    Deploy,
    Pin,
    Reconcile,
    ResumeWindow,
    Rollback,
    Unpin,
)
from daemon.controller.queue import RolloutQueue
from daemon.registry.journal import CheckpointRef
from daemon.registry.status import CheckpointStatus as C

pytestmark = pytest.mark.quick


def ref(id: int) -> CheckpointRef:
    return CheckpointRef(id=id, version=f"v{id}", digest=None, local_path=None, tensor_count=1,
                         status=C.VERIFIED, verified=True)  # fmt: skip


def test_a_held_checkpoint_is_not_handed_out_before_its_time_but_stays_pending() -> None:
    q = RolloutQueue()
    assert q.put_back(ref(1), until=time.monotonic() + 60) is None
    assert q.take(0.01, deploy_allowed=True) is None and q.pending == ref(1)


def test_a_command_is_taken_at_once_while_a_checkpoint_is_held() -> None:
    q = RolloutQueue()
    q.put_back(ref(1), until=time.monotonic() + 60)
    pin = Pin("v0")
    q.command(pin)
    assert q.take(30, deploy_allowed=True) is pin and q.pending == ref(1)


def test_the_held_checkpoint_is_handed_out_when_its_time_comes_within_one_take() -> None:
    q = RolloutQueue()
    q.put_back(ref(1), until=time.monotonic() + 0.05)
    started = time.monotonic()
    job = q.take(30, deploy_allowed=True)
    assert job == Deploy(ref(1))
    assert time.monotonic() - started < 10  # woke at the hold's end, not at the take's timeout


def test_a_newer_arrival_replaces_the_held_one_and_is_not_held() -> None:
    q = RolloutQueue()
    q.put_back(ref(1), until=time.monotonic() + 60)
    assert q.offer(ref(2)) == ref(1)  # the caller records v1 superseded
    job = q.take(0.01, deploy_allowed=True)
    assert job is not None and job.checkpoint == ref(2)


def test_putting_back_behind_a_newer_arrival_supersedes_the_one_put_back() -> None:
    q = RolloutQueue()
    q.offer(ref(2))
    assert q.put_back(ref(1), until=time.monotonic() + 60) == ref(1)
    job = q.take(0.01, deploy_allowed=True)
    assert job is not None and job.checkpoint == ref(2)  # not held: v2 never waited


def test_nothing_is_deployed_while_pinned_held_or_not() -> None:
    q = RolloutQueue()
    q.put_back(ref(1), until=0.0)
    assert q.take(0.01, deploy_allowed=False) is None and q.pending == ref(1)


def test_a_wait_ends_when_a_command_it_waits_for_arrives_and_sleeps_whole_when_it_already_holds() -> None:
    """The runner's sleep between a window's steps: cut short by a command that ends the window,
    but never a spin when that already holds (a window whose gates are still finishing)."""
    import threading

    q = RolloutQueue()
    t0 = time.monotonic()
    threading.Timer(0.1, lambda: q.command(Rollback())).start()
    q.wait(t0 + 30, unless=lambda: q.has_command((Rollback,)))
    assert time.monotonic() - t0 < 20  # woken by the rollback, long before the step was due
    t0 = time.monotonic()
    q.wait(t0 + 0.2, unless=lambda: True)  # holds already: the whole sleep, not a return at once
    assert time.monotonic() - t0 >= 0.19


def test_each_command_says_what_it_is_for_logs_and_status() -> None:
    # status's "current" and the fleet agent's "busy with ..." show these; daemon.fleet.behind
    # tells its own converge apart by "converge VERSION"
    said = [Deploy(ref(3)), Rollback(), Rollback("v1"), Pin("v2", force=True), Unpin(), Converge("v4"), Reconcile(),
            AdapterDeploy(ref(5)), AdapterRollback("x"), AdapterRollback("x", "x-v1"), AdapterPin("x-v2"),
            AdapterUnpin("x"), AdapterReconcile(), ResumeWindow(ref(6), 9, None)]  # fmt: skip
    assert [c.describe() for c in said] == [
        "deploy v3", "rollback", "rollback v1", "pin v2", "unpin", "converge v4", "reconcile", "adapter v5",
        "adapter_rollback x", "adapter_rollback x-v1", "adapter_pin x-v2", "adapter_unpin x", "adapter_reconcile", "health window v6"]
