"""A host that is not on the fleet target says why (`daemon.fleet.behind`): its agent's `behind`,
the daemon's `host_behind` warning (through the health monitor's extra probe), and its row of
`fleet_host_reasons` that `hotswap status --fleet` shows; all gone once it serves the target."""

from __future__ import annotations

from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from support_fleet import seed_versions

from daemon.fleet.agent import FleetAgent
from daemon.fleet.behind import Attempt, explain
from daemon.fleet.settings import FleetSettings
from daemon.fleet.target import Target, fleet_rows
from daemon.process.health import HealthMonitor
from daemon.registry import Registry, hosts
from daemon.registry.journal import Journal
from daemon.registry.models import FleetHostReason, FleetLease, utcnow
from daemon.registry.status import CheckpointStatus

pytestmark = pytest.mark.quick


def test_a_host_says_why_it_is_not_on_the_fleet_target(db_url: str, tmp_path: Path) -> None:
    ra, rb = Registry(db_url, "host-a"), Registry(db_url, "host-b")
    ra.upgrade()
    ids = seed_versions(ra, tmp_path / "a", {"v0": CheckpointStatus.RETIRED, "v1": CheckpointStatus.DEPLOYED})
    ja, jb = Journal(ra), Journal(rb)
    for j, v in ((ja, "v1"), (jb, "v0")):  # host a passed v1's health window; host b serves v0
        j.set_alias("serving", ids[v])
        j.set_alias("last_good", ids[v])

    def copy_on_b(v: str) -> None:
        (tmp_path / "b" / v).mkdir(parents=True)
        with rb.session() as s:
            hosts.set_location(s, ids[v], str(tmp_path / "b" / v))

    copy_on_b("v0")
    asked: list[Future[dict[str, Any]]] = []

    def converge(_v: str) -> Future[dict[str, Any]]:
        asked.append(Future())
        return asked[-1]

    pinned: list[str | None] = [None]
    agent = FleetAgent(jb, FleetSettings(host="host-b", enabled=True, max_updating_hosts=1),
                       idle=lambda: all(f.done() for f in asked), pinned=lambda: pinned[0], converge=converge,
                       submit=lambda i: None)  # fmt: skip
    monitor = HealthMonitor(rb, lambda: [], extra=[agent.problems])

    def looks() -> tuple[str | None, str, list[tuple[str, str, str]], dict[str, Any]]:
        """One tick: the agent's cause and reason, the daemon's host_behind problems, host b's row."""
        agent.tick()
        monitor.tick()
        problems = [(p.subject, p.severity, p.reason) for p in monitor.check() if p.kind == "host_behind"]
        row = next(r for r in fleet_rows(ra)["hosts"] if r["host"] == "host-b")
        b = agent.behind
        return (b.cause if b else None), (b.reason if b else ""), problems, row

    def behind(cause: str, *words: str) -> None:
        got, reason, problems, row = looks()
        seen = f"cause={got} reason={reason!r} problems={problems} row={row}"
        assert got == cause and "v1" in reason and all(w in reason for w in words), seen
        assert problems == [("host-b", "warning", reason)], seen
        assert (row["behind_target"], row["behind_cause"], row["behind_reason"]) == ("v1", cause, reason), seen
        assert row["state"] in ("behind", "pinned", "updating"), seen

    behind("not_here", "serves v0", "not on this host")  # the target's bytes are not here
    pinned[0] = "v0"
    behind("pinned", "pinned to v0")
    pinned[0] = None
    copy_on_b("v1")
    with ra.session() as s:  # host c holds the only lease slot
        s.add(FleetLease(slot=0, host="host-c", version="v1", acquired_at=utcnow(),
                         expires_at=utcnow() + timedelta(seconds=60)))  # fmt: skip  (one lease_s: a real holder's)
    behind("waiting", "fleet lease", "host-c updating to v1")
    assert len(asked) == 1  # it asked to converge, once
    with ra.session() as s:
        s.get_one(FleetLease, 0).host = "host-b"
    behind("updating", "slot 0")
    asked[0].set_result({"outcome": "failed", "rollout_id": 7, "reason": "worker w0 refused: a shape differs"})
    with ra.session() as s:
        s.get_one(FleetLease, 0).host = None
    behind("failed", "failed (rollout 7): worker w0 refused: a shape differs")

    jb.set_alias("serving", ids["v1"])  # converged: no reason, no problem, no row
    cause, reason, problems, row = looks()
    assert (cause, problems, row["behind_reason"], row["state"]) == (None, [], None, "in sync"), (reason, row)
    with rb.session() as s:
        assert s.get(FleetHostReason, "host-b") is None
    ra.close()
    rb.close()


def test_the_causes_in_order(db_url: str, tmp_path: Path) -> None:
    reg = Registry(db_url, "host-a")
    reg.upgrade()
    ids = seed_versions(reg, tmp_path, {"v0": CheckpointStatus.RETIRED, "v1": CheckpointStatus.DEPLOYED,
                                        "v2": CheckpointStatus.DEPLOYED})  # fmt: skip
    j = Journal(reg)
    v0, v1, v2 = (j.checkpoint(ids[v]) for v in ("v0", "v1", "v2"))
    assert v0 is not None and v1 is not None and v2 is not None
    implicit, explicit = Target(v1, False), Target(v1, True, "operator")
    kw: dict[str, Any] = {"pinned": None, "here": True, "doing": None, "attempt": None, "leases": [],
                          "host": "host-a", "slots": 1}  # fmt: skip

    def cause(target: Target, serving: Any, **over: Any) -> str | None:
        b = explain(target, serving, **{**kw, **over})
        return b.cause if b else None

    assert cause(implicit, v1) is None  # on the target
    assert cause(implicit, v2) is None  # ahead of the newest good version: nothing moves it back
    assert cause(explicit, v2) == "next"  # an operator's older target moves it back
    assert cause(implicit, v0) == "next" and cause(implicit, None) == "next"
    assert cause(implicit, v0, doing="deploy v9") == "busy"
    assert cause(implicit, v0, doing="deploy v9", here=False) == "not_here"
    running = Attempt("v1", Future())
    assert cause(implicit, v0, attempt=running, doing="deploy v9") == "converging"
    assert cause(implicit, v0, attempt=running, leases=[{"host": "host-x", "slot": 0, "version": "v1"}]) == "waiting"
    assert cause(implicit, v0, attempt=running, pinned="v0") == "pinned"
    refused: Future[dict[str, Any]] = Future()
    refused.set_exception(ValueError("version 'v1' has no local copy"))
    b = explain(explicit, v0, **{**kw, "attempt": Attempt("v1", refused)})
    assert b is not None and b.cause == "failed" and "operator's fleet target v1" in b.reason
    assert "refused: version 'v1' has no local copy" in b.reason, b
    assert cause(implicit, v0, attempt=Attempt("v0", refused)) == "next"  # an attempt at another version
    assert explain(None, v0, **kw) is None  # no fleet target yet
    reg.close()
