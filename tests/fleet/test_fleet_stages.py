"""Staged fleet rollouts decided in the registry (daemon.fleet.stages), with four hosts' rows on
SQLite and PostgreSQL and the fleet agent's answer for each host: who is admitted when, the bake
time, a halt on a rejected version (hosts on it go back, nobody else is admitted), pause, resume
and abort, the view `fleet_stage_hosts`, and a newer version superseding the rollout.
The same code with real daemons: tests/e2e/test_fleet_stages_daemons.py."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import text
from support_fleet import HOSTS, Fleet

from daemon.fleet import stages
from daemon.fleet.settings import FleetSettings, StageSpec
from daemon.fleet.target import fleet_rows, set_fleet_target
from daemon.registry.models import utcnow
from daemon.registry.status import CheckpointStatus as C

pytestmark = pytest.mark.quick


@pytest.fixture
def fleet(db_url: str, tmp_path: Path):
    f = Fleet(db_url, tmp_path)
    yield f
    f.close()


def test_a_staged_rollout_admits_one_stage_at_a_time_and_bakes(fleet: Fleet) -> None:
    j = fleet.j
    v1 = j["host-2"].checkpoint(fleet.ids["v1"])
    assert v1 is not None
    assert fleet.agents["host-2"].admits(v1)  # the host that verified it first begins it: the canary
    assert not fleet.agents["host-0"].admits(v1)
    assert [fleet.wants(h) for h in HOSTS] == [None, None, "v1", None]  # only the canary (admitted) takes it
    fleet.on("host-2", "v1", passed=False)  # inside its health window: not ready
    assert stages.step(j["host-1"]) == []
    fleet.on("host-2", "v1")  # passed: v1 is now the newest good version, and still only host-2 has it
    assert stages.step(j["host-1"]) == ["fleet_stage_ready"]
    assert [fleet.wants(h) for h in HOSTS] == [None, None, None, None]
    # `hotswap status --fleet`: v1 is the newest good version; the hosts not admitted are held, not behind
    rows = {r["host"]: r["state"] for r in fleet_rows(fleet.regs["host-0"])["hosts"]}
    assert rows == {"host-0": "held", "host-1": "held", "host-2": "in sync", "host-3": "held"}, rows
    assert stages.step(j["host-1"], utcnow() + timedelta(seconds=10)) == []  # baking (30 s)
    assert stages.step(j["host-3"], utcnow() + timedelta(seconds=31)) == [
        "fleet_stage_advanced",
        "fleet_stage_admitted",
    ]
    assert [fleet.wants(h) for h in HOSTS] == ["v1", None, None, None]  # 50 % of 4: host-2 and host-0
    doc = stages.status(fleet.regs["host-3"])
    assert doc is not None and doc["stage"] == 1 and doc["state"] == "running"
    assert {(h["host"], h["stage"], h["host_state"]) for h in doc["hosts"]} == {
        ("host-2", 0, "passed"), ("host-0", 1, "waiting")}  # fmt: skip
    fleet.on("host-0", "v1")
    assert stages.step(j["host-0"]) == ["fleet_stage_ready"]
    assert stages.step(j["host-0"]) == ["fleet_stage_advanced", "fleet_stage_admitted"]  # bake 0
    assert [fleet.wants(h) for h in HOSTS] == [None, "v1", None, "v1"]
    for h in ("host-1", "host-3"):
        fleet.on(h, "v1")
    assert stages.step(j["host-0"]) == ["fleet_stage_ready"]
    assert stages.step(j["host-0"]) == ["fleet_rollout_done"]
    assert stages.for_host(j["host-1"], "host-1") is None  # over: the fleet target rules again
    assert fleet.agents["host-1"].admits(v1)
    with fleet.regs["host-0"].session() as s:
        names = [
            r[0]
            for r in s.execute(text("SELECT to_state FROM events WHERE to_state LIKE 'fleet_%' ORDER BY id"))
        ]
    assert names[0] == "fleet_rollout_started" and names[-1] == "fleet_rollout_done"


def test_a_rejected_version_halts_the_rollout_and_its_hosts_go_back(fleet: Fleet) -> None:
    j = fleet.j
    v1 = j["host-1"].checkpoint(fleet.ids["v1"])
    assert v1 is not None and fleet.agents["host-1"].admits(v1)
    fleet.on("host-1", "v1", passed=False)
    j["host-1"].move_status(fleet.ids["v1"], C.DEPLOYED, "serving on every worker")
    # another canary host's health window failed: v1 is rejected (the same verdict a lone host acts on)
    j["host-1"].move_status(fleet.ids["v1"], C.REJECTED, "rolled back to v0 after deploy: error rate 0.5")
    assert stages.step(j["host-3"]) == ["fleet_rollout_halted"]
    doc = stages.status(fleet.regs["host-0"])
    assert doc is not None and doc["state"] == "halted" and "rejected at stage 1 of 3" in doc["reason"]
    assert fleet.wants("host-1") == "v0"  # back to the previous fleet version
    assert "v1" not in [fleet.wants(h) for h in ("host-0", "host-2", "host-3")]  # (the verified v2 is next)
    assert not fleet.agents["host-0"].admits(v1)
    assert stages.step(j["host-3"]) == []  # halted stays halted


def test_pause_resume_abort_and_a_newer_version(fleet: Fleet) -> None:
    j = fleet.j
    v1 = j["host-0"].checkpoint(fleet.ids["v1"])
    assert v1 is not None and fleet.agents["host-0"].admits(v1)
    stages.command(j["host-3"], "pause", by="ops")
    with pytest.raises(stages.StageCommandRefused, match="paused already"):
        stages.command(j["host-3"], "pause", by="ops")
    assert not fleet.agents["host-0"].admits(v1)  # paused: nobody starts on it
    fleet.on("host-0", "v1")
    assert stages.step(j["host-1"]) == []  # no stage moves while paused
    stages.command(j["host-3"], "resume", by="ops")
    assert stages.step(j["host-1"]) == ["fleet_stage_ready"]
    # stages are counted one way everywhere: from 1, as the status lines do ("stage 1 of 3")
    assert stages.command(j["host-3"], "abort", by="ops") == "abort: the staged rollout of v1 (stage 1 of 3)"
    assert j["host-0"].checkpoint(fleet.ids["v1"]).status == C.REJECTED  # type: ignore[union-attr]
    ended = stages.status(fleet.regs["host-0"])
    assert ended is not None and ended["reason"] == "aborted by ops at stage 1 of 3", ended
    assert fleet.wants("host-0") == "v0"
    with pytest.raises(stages.StageCommandRefused, match="no staged fleet rollout in progress"):
        stages.command(j["host-3"], "resume", by="ops")
    # a newer version begins its own rollout; one still in progress would be superseded by it
    fleet.on("host-0", "v0")
    v2 = j["host-2"].checkpoint(fleet.ids["v2"])
    assert v2 is not None and fleet.agents["host-2"].admits(v2)
    doc = stages.status(fleet.regs["host-0"])
    assert doc is not None and (doc["version"], doc["previous"], doc["state"]) == ("v2", "v0", "running")


def test_bad_stages_name_the_key() -> None:
    from daemon.common.typedtoml import build_dataclass

    with pytest.raises(Exception, match=r"stages\[0\]: give exactly one of hosts, percent or names"):
        build_dataclass({"enabled": True, "stages": [{"hosts": 1, "percent": 10}]}, FleetSettings, "fleet")
    assert stages.plan_of([StageSpec(hosts=1, bake_s=5)]) == [
        {"hosts": 1, "bake_s": 5},
        {"percent": 100, "bake_s": 0},
    ]


def test_a_host_behind_with_a_worker_down_is_degraded(fleet: Fleet) -> None:
    """`hotswap status --fleet`'s `degraded`: not on the target, and not every worker RUNNING (a
    host on the target stays `in sync` whatever its workers do: the serving version is right)."""
    set_fleet_target(fleet.regs["host-0"], "v1", by="ops")
    fleet.on("host-0", "v1")
    for h in ("host-0", "host-3"):
        fleet.j[h].register_workers([("w1", "builtin", f"http://{h}:2", "cpu")])
        fleet.j[h].observe("w1", state="UNHEALTHY", weight_version=None, error="exited 1", device="cpu")
    rows = {r["host"]: (r["state"], r["workers_running"], r["workers"]) for r in fleet_rows(fleet.regs["host-1"])["hosts"]}
    assert rows == {"host-0": ("in sync", 1, 2), "host-1": ("behind", 1, 1), "host-2": ("behind", 1, 1),
                    "host-3": ("degraded", 1, 2)}, rows  # fmt: skip
