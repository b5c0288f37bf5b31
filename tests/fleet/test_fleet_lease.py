"""The fleet lease on real PostgreSQL: contention (SKIP LOCKED, the bound holds under a race),
expiry (a holder that stops renewing loses its slot), renewal (a renewed slot is never taken),
and two hosts' registries on one database keeping their own aliases, workers and locations.

Each test gets a fresh database on $HOTSWAP_TEST_POSTGRES_URL (conftest); without it they skip.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from conftest import POSTGRES_ENV, wait_until

from daemon.controller.supervise import choose_launch
from daemon.fleet.lease import FleetLeases, holders
from daemon.fleet.settings import FleetSettings
from daemon.registry import Registry
from daemon.registry import queries as q
from daemon.registry.journal import Journal
from daemon.registry.models import Checkpoint, Event
from daemon.registry.status import CheckpointStatus

pytestmark = [pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}"), pytest.mark.quick]


def host_registry(url: str, host: str) -> Registry:
    reg = Registry(url, host)
    reg.upgrade()
    return reg


def leases(url: str, host: str, **kw: float) -> FleetLeases:
    return FleetLeases(host_registry(url, host), FleetSettings(host=host, enabled=True, **kw))  # type: ignore[arg-type]


def test_one_slot_one_holder_and_release_hands_it_on(pg_url: str) -> None:
    a, b = leases(pg_url, "host-a"), leases(pg_url, "host-b")
    assert a.try_acquire("v1") == 0
    assert b.try_acquire("v1") is None  # the bound: one host at a time
    assert [h["host"] for h in holders(a.registry)] == ["host-a"]
    assert a.try_acquire("v1") == 0  # nested (recovery running a rollout): the same slot
    a.release()
    assert b.try_acquire("v1") is None  # the outer hold goes on
    a.release()
    assert b.try_acquire("v1") == 0
    with b.registry.session() as s:  # acquisitions and releases are events, with their host
        kinds = [(e.host, e.to_state) for e in s.query(Event).order_by(Event.id) if e.to_state.startswith("fleet_")]
    assert kinds == [("host-a", "fleet_lease_acquired"), ("host-a", "fleet_lease_released"),
                     ("host-b", "fleet_lease_acquired")]


def _race(hosts: list[FleetLeases]) -> list[int | None]:
    got: list[int | None] = [None] * len(hosts)
    start = threading.Barrier(len(hosts))

    def take(i: int) -> None:
        start.wait()
        got[i] = hosts[i].try_acquire("v")

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(hosts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


def test_racing_hosts_never_exceed_the_bound(pg_url: str) -> None:
    for bound in (1, 2):
        hosts = [leases(pg_url, f"race{bound}-{i}", max_updating_hosts=bound) for i in range(6)]
        got = _race(hosts)
        winners = [i for i, slot in enumerate(got) if slot is not None]
        assert len(winners) == bound, got
        assert sorted(got[i] for i in winners) == list(range(bound))  # type: ignore[type-var]
        for i in winners:
            hosts[i].release()


def test_a_holder_that_stops_renewing_loses_its_slot(pg_url: str) -> None:
    a, b = leases(pg_url, "host-a", lease_s=0.5), leases(pg_url, "host-b", lease_s=60)
    assert a.try_acquire("v1") == 0
    # a's daemon "died": nobody renews; b gets the slot once the lease has expired
    wait_until(lambda: b.try_acquire("v2") == 0, 30, 0.1, "the expired slot to be taken")
    assert not a.renew() and a.lost  # the old holder learns it lost the slot
    assert [h["host"] for h in holders(b.registry)] == ["host-b"]


def test_a_renewed_slot_is_never_taken(pg_url: str) -> None:
    # lease_s long enough that a renewal thread starved for a moment on two loaded cores does not
    # let it lapse (then b taking it would be right); the loop spans 2.5 lease periods
    a, b = leases(pg_url, "host-a", lease_s=3.0), leases(pg_url, "host-b", lease_s=3.0)
    assert a.try_acquire("v1") == 0
    with a.renewing():  # renewed every lease_s / 4
        for _ in range(25):
            assert b.try_acquire("v2") is None
            threading.Event().wait(0.3)
    assert not a.lost
    a.release()
    assert b.try_acquire("v2") == 0


def test_release_stale_frees_what_a_previous_run_of_this_host_held(pg_url: str) -> None:
    a = leases(pg_url, "host-a", lease_s=600)
    assert a.try_acquire("v1") == 0
    again = leases(pg_url, "host-a", lease_s=600)  # the restarted daemon
    assert again.release_stale() == 1
    assert leases(pg_url, "host-b").try_acquire("v1") == 0


def test_two_hosts_keep_their_own_aliases_workers_and_locations(pg_url: str) -> None:
    ra, rb = host_registry(pg_url, "host-a"), host_registry(pg_url, "host-b")
    with ra.session() as s:
        v1 = Checkpoint(version="v1", source="local:/a", uri="file:///a/v1", local_path="/a/v1",
                        status=CheckpointStatus.DEPLOYED.value)  # fmt: skip
        v2 = Checkpoint(version="v2", source="local:/a", uri="file:///a/v2", local_path="/a/v2",
                        status=CheckpointStatus.DEPLOYED.value)  # fmt: skip
        s.add_all([v1, v2])
    ja, jb = Journal(ra), Journal(rb)
    assert ja.checkpoint(v1.id).local_path == "/a/v1"  # type: ignore[union-attr]
    assert jb.checkpoint(v1.id).local_path is None  # type: ignore[union-attr]  # never another host's path
    ja.register_workers([("w0", "builtin", "http://a:1", "cpu")])
    jb.register_workers([("w0", "builtin", "http://b:1", "cpu")])  # the same name on another host
    ja.set_alias("serving", v1.id)
    jb.set_alias("serving", v2.id)
    ja.set_alias("last_good", v1.id)
    assert ja.alias("serving").version == "v1" and jb.alias("serving").version == "v2"  # type: ignore[union-attr]
    assert jb.alias("last_good") is None
    # host a moves on to v2 and "retires" v1 ... which host b does not serve: retired
    ja.set_alias("serving", v2.id)
    ja.move_status(v1.id, CheckpointStatus.RETIRED, "replaced by v2")
    assert ja.checkpoint(v1.id).status == CheckpointStatus.RETIRED  # type: ignore[union-attr]
    # host b replaces v2, but host a serves it: never retired, a note instead
    jb.move_status(v2.id, CheckpointStatus.RETIRED, "replaced by v3")
    ref = jb.checkpoint(v2.id)
    assert ref is not None and ref.status == CheckpointStatus.DEPLOYED
    with ra.session() as s:
        assert [w["url"] for w in q.worker_rows(s)] == ["http://a:1"]
        assert q.aliases(s)["serving"] == "v2"
    with rb.session() as s:
        assert [w["url"] for w in q.worker_rows(s)] == ["http://b:1"]
        assert "still serving on host-a" in (s.get(Checkpoint, v2.id).status_message or "")  # type: ignore[union-attr]


def test_a_status_move_another_host_made_first_is_done(pg_url: str) -> None:
    """Two hosts leave v1 for v2 at once: each read v1 `deployed` before either moved it. The later
    one's moves (v2 deployed, v1 retired) failed as `deployed -> deployed` / `retired -> retired`,
    after its worker already served v2, so its rollout's bookkeeping (aliases, health window)
    never ran (seen in CI: tests/e2e/test_fleet_converge_daemons.py)."""
    ra, rb = host_registry(pg_url, "host-a"), host_registry(pg_url, "host-b")
    with ra.session() as s:
        v1 = Checkpoint(version="v1", source="local:/a", uri="file:///a/v1", status=CheckpointStatus.DEPLOYED.value)
        v2 = Checkpoint(version="v2", source="local:/a", uri="file:///a/v2", status=CheckpointStatus.VERIFIED.value)
        s.add_all([v1, v2])
    ja, jb = Journal(ra), Journal(rb)
    for j in (ja, jb):
        j.set_alias("serving", v2.id)
    jb.move_status(v2.id, CheckpointStatus.DEPLOYED, "serving on every worker")
    jb.move_status(v1.id, CheckpointStatus.RETIRED, "replaced by v2")
    ja.move_status(v2.id, CheckpointStatus.DEPLOYED, "serving on every worker")
    ja.move_status(v1.id, CheckpointStatus.RETIRED, "replaced by v2")
    with ra.session() as s:
        assert s.get(Checkpoint, v1.id).status == CheckpointStatus.RETIRED.value  # type: ignore[union-attr]
        assert s.get(Checkpoint, v2.id).status == CheckpointStatus.DEPLOYED.value  # type: ignore[union-attr]
        moves = [(e.checkpoint_id, e.to_state) for e in s.query(Event).filter(Event.checkpoint_id.in_([v1.id, v2.id]))]
    assert sorted(moves) == sorted([(v2.id, "deployed"), (v1.id, "retired")]), moves  # the first host's, once


def test_a_host_never_launches_a_worker_on_another_hosts_path(pg_url: str, tmp_path: Path) -> None:
    ra, rb = host_registry(pg_url, "host-a"), host_registry(pg_url, "host-b")
    ja, jb = Journal(ra), Journal(rb)
    seed = ja.register_seed(version="seed", local_path=str(tmp_path / "a-seed"), digest="blake3:00",
                            total_bytes=1, tensors=1)  # fmt: skip
    (tmp_path / "a-seed").mkdir()
    ja.set_alias("serving", seed.id)
    jb.set_alias("serving", seed.id)  # host b serves the same version, from a copy it does not have yet
    b_serving = jb.alias("serving")
    assert b_serving is not None and b_serving.local_path is None
    b_choice = choose_launch(jb, "", deep=False)  # what the supervisor would launch host b's worker on
    assert b_choice.model is None and b_choice.skipped == {"seed": "no local copy to deploy from"}  # never a's path
    assert choose_launch(ja, "", deep=False).model == str(tmp_path / "a-seed")
    (tmp_path / "b-seed").mkdir()  # host b makes its own seed: recorded as its copy of the same row
    again = jb.register_seed(version="seed", local_path=str(tmp_path / "b-seed"), digest="blake3:00",
                             total_bytes=1, tensors=1)  # fmt: skip
    assert again.id == seed.id and again.local_path == str(tmp_path / "b-seed")
    assert ja.checkpoint(seed.id).local_path == str(tmp_path / "a-seed")  # type: ignore[union-attr]
