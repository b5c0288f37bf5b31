"""What a host of a fleet moves to (`FleetAgent`): the newest `last_good` of any host, an
operator's explicit target (even an older one), a version the fleet verified that nobody finished
deploying; never a version whose bytes are not on this host, never while pinned or busy."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import publish_tiny
from fake_source import FakeSource, FakeSourceConfig
from support_fleet import seed_versions

from daemon.checks import CheckSettings
from daemon.fleet.agent import FleetAgent
from daemon.fleet.fetch import fetch_here
from daemon.fleet.settings import FleetSettings
from daemon.fleet.target import fleet_target, set_fleet_target
from daemon.pipeline.coordinator import Coordinator
from daemon.registry import Registry, hosts
from daemon.registry.journal import Journal
from daemon.registry.status import CheckpointStatus

pytestmark = pytest.mark.quick

CHEAP = CheckSettings(enabled=("manifest", "headers", "crc32c"))


def two_hosts_on_v0(db_url: str, tmp_path: Path, statuses: dict[str, CheckpointStatus],
                    copies_on_b: tuple[str, ...]) -> tuple[Registry, Registry, dict[str, int], Journal, Journal]:  # fmt: skip
    """Hosts a and b serving v0 (its last good version too); host b's copies of `copies_on_b` recorded."""
    ra, rb = Registry(db_url, "host-a"), Registry(db_url, "host-b")
    ra.upgrade()
    ids = seed_versions(ra, tmp_path / "a", statuses)
    ja, jb = Journal(ra), Journal(rb)
    for j in (ja, jb):
        j.set_alias("serving", ids["v0"])
        j.set_alias("last_good", ids["v0"])
    for v in copies_on_b:
        (tmp_path / "b" / v).mkdir(parents=True)
        with rb.session() as s:
            hosts.set_location(s, ids[v], str(tmp_path / "b" / v))
    return ra, rb, ids, ja, jb


def test_what_a_host_converges_to(db_url: str, tmp_path: Path) -> None:
    ra, rb = Registry(db_url, "host-a"), Registry(db_url, "host-b")
    ra.upgrade()
    ids = seed_versions(ra, tmp_path / "a", {"v0": CheckpointStatus.RETIRED, "v1": CheckpointStatus.DEPLOYED,
                                         "v2": CheckpointStatus.VERIFIED})  # fmt: skip
    ja, jb = Journal(ra), Journal(rb)
    ja.set_alias("serving", ids["v1"])
    ja.set_alias("last_good", ids["v1"])
    asked: list[tuple[str, object]] = []
    pinned: list[str | None] = [None]
    agent = FleetAgent(jb, FleetSettings(host="host-b", enabled=True), idle=lambda: True, pinned=lambda: pinned[0],
                       converge=lambda v: asked.append(("converge", v)),
                       submit=lambda i: asked.append(("submit", i)))  # fmt: skip
    target = fleet_target(jb)
    assert target is not None and target.checkpoint.version == "v1" and not target.explicit
    assert agent.wanted() is None  # host b has no copy of v1 (nor of v2): it never uses host a's
    for v in ("v0", "v1", "v2"):  # host b's source finds the same versions in its own folder
        (tmp_path / "b" / v).mkdir(parents=True)
        with rb.session() as s:
            hosts.set_location(s, ids[v], str(tmp_path / "b" / v))
    assert agent.tick() == "v1" and asked == [("converge", "v1")]
    assert agent.tick() is None  # asked once; tried again only after a while
    jb.set_alias("serving", ids["v1"])
    wanted = agent.wanted()  # in sync with the target: the verified v2 nobody finished is next
    assert wanted is not None and wanted[0].version == "v2" and wanted[1] is False
    set_fleet_target(ra, "v0", by="operator")  # an operator holds the fleet on an older version
    wanted = agent.wanted()
    assert wanted is not None and wanted[0].version == "v0" and wanted[1] is True
    jb.set_alias("serving", ids["v0"])
    assert agent.wanted() is None  # there: nothing newer while the explicit target stands
    set_fleet_target(ra, None, by="operator")
    pinned[0] = "v0"
    assert agent.wanted() is None  # a pinned host stays where it is
    ra.close()
    rb.close()


def test_a_version_registered_by_another_host_is_fetched_from_its_source_here(db_url: str, tmp_path: Path) -> None:
    """A remote source (no local directory at discovery, like S3): host a registers, fetches and
    verifies; host b's source finds the same version, and its agent fetches b's own copy."""
    ra, rb = Registry(db_url, "host-a"), Registry(db_url, "host-b")
    ra.upgrade()
    store = tmp_path / "store"
    publish_tiny(store / "f1", seed=1, version="f1")
    src_a = FakeSource(FakeSourceConfig(store=str(store), cache=str(tmp_path / "a-cache"), name="bucket"), lambda i: None)
    src_b = FakeSource(FakeSourceConfig(store=str(store), cache=str(tmp_path / "b-cache"), name="bucket"), lambda i: None)
    a, b = Coordinator(ra, CHEAP), Coordinator(rb, CHEAP)
    a.sources, b.sources = {"bucket": src_a}, {"bucket": src_b}
    src_a.emit, src_b.emit = a.intake, b.intake
    src_a.offer("f1")
    a.process(a._queue.get_nowait())
    ja, jb = Journal(ra), Journal(rb)
    f1 = ja.checkpoint_by_version("f1")
    assert f1 is not None and f1.status == CheckpointStatus.VERIFIED and f1.local_path == str(tmp_path / "a-cache" / "f1")
    src_b.offer("f1")  # known to the fleet: not registered, not verified again, no copy here yet
    assert b._queue.empty() and jb.checkpoint(f1.id).local_path is None  # type: ignore[union-attr]
    agent = FleetAgent(jb, FleetSettings(host="host-b", enabled=True), idle=lambda: True, pinned=lambda: None,
                       converge=lambda v: None, submit=lambda i: None)  # fmt: skip
    agent.fetch = lambda cid: fetch_here(rb, b.sources, cid)
    wanted = agent.wanted()  # the verified f1 nobody deployed yet: host b fetches its own copy first
    assert wanted is not None and wanted[0].version == "f1"
    assert src_b.fetched == ["f1"] and jb.checkpoint(f1.id).local_path == str(tmp_path / "b-cache" / "f1")  # type: ignore[union-attr]
    assert ja.checkpoint(f1.id).local_path == str(tmp_path / "a-cache" / "f1")  # type: ignore[union-attr]
    ra.close()
    rb.close()


def test_clearing_an_older_target_brings_the_fleet_back_to_the_newest_good_version(db_url: str, tmp_path: Path) -> None:
    """Every host served v2; an operator held the fleet on the older v1, so every host's
    last_good became v1. Cleared, the target is v2 again (it was good on a host), never v3 (good
    once, rejected since), v4 (verified, never good anywhere) or v5 (being verified again)."""
    ra, rb = Registry(db_url, "host-a"), Registry(db_url, "host-b")
    ra.upgrade()
    ids = seed_versions(ra, tmp_path / "a", {"v1": CheckpointStatus.RETIRED, "v2": CheckpointStatus.DEPLOYED,
                                         "v3": CheckpointStatus.REJECTED, "v4": CheckpointStatus.VERIFIED,
                                         "v5": CheckpointStatus.VERIFYING})  # fmt: skip
    ja, jb = Journal(ra), Journal(rb)
    with rb.session() as s:  # host b has its own copy of every version
        for v, i in ids.items():
            (tmp_path / "b" / v).mkdir(parents=True)
            hosts.set_location(s, i, str(tmp_path / "b" / v))
    for j in (ja, jb):
        for v in ("v3", "v5", "v2"):  # v3 and v5 were some host's last_good once, as v2 is now
            j.set_alias("serving", ids[v])
            j.set_alias("last_good", ids[v])
    assert [t.checkpoint.version if (t := fleet_target(j)) else None for j in (ja, jb)] == ["v2", "v2"]
    set_fleet_target(ra, "v1", by="operator")
    for j in (ja, jb):  # what converging to the operator's target leaves on every host
        j.set_alias("serving", ids["v1"])
        j.set_alias("last_good", ids["v1"])
    target = fleet_target(jb)
    assert target is not None and (target.checkpoint.version, target.explicit) == ("v1", True)
    set_fleet_target(ra, None, by="operator")
    target = fleet_target(jb)
    seen = (target.checkpoint.version, target.explicit) if target else None
    assert seen == ("v2", False), f"after the clear the target is {seen}, not the newest good v2"
    agent = FleetAgent(jb, FleetSettings(host="host-b", enabled=True), idle=lambda: True, pinned=lambda: None,
                       converge=lambda v: None, submit=lambda i: None)  # fmt: skip
    wanted = agent.wanted()
    assert wanted is not None and (wanted[0].version, wanted[1]) == ("v2", True), wanted
    ra.close()
    rb.close()


def test_an_in_sync_host_looks_with_one_statement_until_something_changes(db_url: str, tmp_path: Path) -> None:
    """`FleetAgent.tick` on a host in sync: one statement (`fleet_mark`) while nothing it depends
    on changes; a newer good version elsewhere, or a pin here, brings back the full look."""
    from sqlalchemy import event

    ra, rb, ids, ja, jb = two_hosts_on_v0(db_url, tmp_path, {"v0": CheckpointStatus.DEPLOYED,
                                                              "v1": CheckpointStatus.DEPLOYED}, ("v0", "v1"))  # fmt: skip
    asked: list[str] = []
    pinned: list[str | None] = [None]
    agent = FleetAgent(jb, FleetSettings(host="host-b", enabled=True), idle=lambda: True, pinned=lambda: pinned[0],
                       converge=asked.append, submit=lambda i: None)  # fmt: skip
    statements: list[str] = []
    event.listen(rb.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    assert agent.tick() is None and len(statements) > 3  # the first look is a full one
    for _ in range(3):
        statements.clear()
        assert agent.tick() is None
        assert len(statements) == 1, statements  # in sync, nothing changed: the mark alone
    ja.set_alias("serving", ids["v1"])
    ja.set_alias("last_good", ids["v1"])  # host a passed v1's health window: the newest good version
    assert agent.tick() == "v1" and asked == ["v1"]
    jb.set_alias("serving", ids["v1"])
    jb.set_alias("last_good", ids["v1"])
    agent.tick()  # in sync again
    statements.clear()
    agent.tick()
    assert len(statements) == 1
    pinned[0] = "v1"  # an operator's pin here is part of what it depends on: a full look
    statements.clear()
    agent.tick()
    assert len(statements) > 1
    ra.close()
    rb.close()


def test_a_copy_recorded_here_after_a_quiet_look_is_acted_on_at_the_next_tick(db_url: str, tmp_path: Path) -> None:
    """Host a verified v1 (nobody deployed it yet); host b's agent looked before its own source had
    recorded b's copy (so: nothing to do, in sync on v0, quiet). The copy appearing is part of the
    mark: the next tick deploys v1 rather than waiting for the 5-minute full look (a CI run of
    tests/e2e/test_fleet_daemons.py saw host-0 wait out its 300 s that way)."""
    ra, rb, ids, _, jb = two_hosts_on_v0(db_url, tmp_path, {"v0": CheckpointStatus.DEPLOYED,
                                                             "v1": CheckpointStatus.VERIFIED}, ("v0",))  # fmt: skip
    submitted: list[int] = []
    agent = FleetAgent(jb, FleetSettings(host="host-b", enabled=True), idle=lambda: True, pinned=lambda: None,
                       converge=lambda v: None, submit=submitted.append)  # fmt: skip
    assert agent.tick() is None and agent.tick() is None and submitted == []  # no copy of v1 here: quiet
    (tmp_path / "b" / "v1").mkdir(parents=True)
    with rb.session() as s:
        hosts.set_location(s, ids["v1"], str(tmp_path / "b" / "v1"))  # b's source found the same bytes
    assert agent.tick() == "v1" and submitted == [ids["v1"]]
    ra.close()
    rb.close()
