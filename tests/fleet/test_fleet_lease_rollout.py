"""A fleet host's rollout and its lease slot, on real PostgreSQL with in-process fake workers.

The slot bounds how many hosts have workers out of rotation, so a rollout holds it only while
workers move: its `rollouts` row and staging come while it waits, its outcome after it releases
(at 1,000 hosts those writes inside the hold made each 2 s slot up to 0.25 s longer). A newer
command ends the wait without touching a worker.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
from conftest import POSTGRES_ENV, wait_until
from fake_worker import FakeWorkerClient
from sqlalchemy import select
from support_rollout import rollouts, worker_events

from daemon.fleet.agent import leased
from daemon.fleet.lease import FleetLeases
from daemon.fleet.settings import FleetSettings
from daemon.registry import Registry
from daemon.registry.models import Event, Rollout
from daemon.registry.status import RolloutOutcome, RolloutTrigger
from daemon.rollout.engine import RolloutResult
from tests.rollout.test_rollout_fake import rig, verified

pytestmark = pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")


def fleet_leases(url: str, host: str) -> FleetLeases:
    reg = Registry(url, host)
    reg.upgrade()
    return FleetLeases(reg, FleetSettings(host=host, enabled=True, max_updating_hosts=1))


def lease_events(reg: Registry, host: str) -> list[Event]:
    with reg.session() as s:
        return [e for e in s.scalars(select(Event).where(Event.to_state.like("fleet_lease_%")).order_by(Event.id))
                if (e.detail or {}).get("host") == host]  # fmt: skip


def in_background(fn: object) -> Future[RolloutResult]:
    out: Future[RolloutResult] = Future()

    def run() -> None:
        try:
            out.set_result(fn())  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return out


def test_the_slot_is_held_only_while_workers_move(pg_url: str, tmp_path: Path) -> None:
    other = fleet_leases(pg_url, "host-b")
    assert other.try_acquire("v9") == 0  # the fleet's only slot is busy
    here = fleet_leases(pg_url, "host-a")
    w0 = FakeWorkerClient("w0")
    r = rig(here.registry, tmp_path, w0)
    v0, v1 = verified(here.registry, "v0"), verified(here.registry, "v1")
    engine = leased(r.engine, here, stopping=lambda: False)

    job = in_background(lambda: engine.deploy(v1, trigger=RolloutTrigger.FLEET, fallback=v0))
    # waiting: the rollout is recorded (and staged) already, no worker has moved, no slot is held
    wait_until(lambda: [x["version"] for x in rollouts(here.registry)] == ["v1"], 30)
    assert not job.done() and (w0.state, w0.version) == ("RUNNING", "v0")
    assert worker_events(here.registry) == [] and lease_events(here.registry, "host-a") == []

    other.release()
    result = job.result(timeout=60)
    assert result.outcome == RolloutOutcome.SUCCEEDED and w0.version == "v1"
    acquired, released = lease_events(here.registry, "host-a")
    assert (acquired.to_state, released.to_state) == ("fleet_lease_acquired", "fleet_lease_released")
    moves = worker_events(here.registry, result.rollout_id)
    assert [m["to"] for m in moves] == ["PAUSED", "UPDATED", "RUNNING"]
    assert all(acquired.at <= m["at"] <= released.at for m in moves)  # every move inside the hold
    with here.registry.session() as s:
        row = s.get(Rollout, result.rollout_id)
        assert row is not None and row.started_at <= acquired.at
        assert row.finished_at is not None and row.finished_at >= released.at  # recorded after releasing


def test_a_newer_command_ends_the_wait_for_a_slot_and_no_worker_moves(pg_url: str, tmp_path: Path) -> None:
    other = fleet_leases(pg_url, "host-b")
    assert other.try_acquire("v9") == 0
    here = fleet_leases(pg_url, "host-a")
    w0 = FakeWorkerClient("w0")
    r = rig(here.registry, tmp_path, w0)
    v0, v1 = verified(here.registry, "v0"), verified(here.registry, "v1")
    engine = leased(r.engine, here, stopping=lambda: False)
    newer = threading.Event()

    job = in_background(lambda: engine.deploy(v1, trigger=RolloutTrigger.FLEET, fallback=v0,
                                              should_yield=newer.is_set))  # fmt: skip
    wait_until(lambda: rollouts(here.registry), 30)
    newer.set()
    result = job.result(timeout=30)
    assert result.outcome == RolloutOutcome.SUPERSEDED
    assert result.reason == "stopped while waiting for a fleet lease slot"
    assert rollouts(here.registry)[0]["outcome"] == "superseded"
    assert (w0.state, w0.version) == ("RUNNING", "v0") and worker_events(here.registry) == []
    assert lease_events(here.registry, "host-a") == [] and other.slot == 0
