"""Staged fleet rollouts with three real daemons (three hosts, each with its own real worker and
folder) on one PostgreSQL registry (daemon.fleet.stages; the decisions alone: test_fleet_stages.py).

- a good version goes canary -> stage 2 -> every host, each host's rollout starting only after its
  stage was admitted; a pause holds the next stage, a resume lets it go; the canary's daemon, which
  took the first decisions, is SIGKILLed mid-rollout and the others finish it;
- a bad version fails on the canary: the rollout halts, no other host ever rolls it out or serves
  it, the canary is back on the previous version; a good one after it is aborted by the operator at
  its canary, which goes back too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    POSTGRES_ENV,
    DaemonProcess,
    hotswap_cli,
    make_config_file,
    wait_until,
)
from sqlalchemy import text
from support_fleet_daemons import aliases_of, host_daemon
from support_rollout import WorkerPool, publish_into, wait_passes

from daemon.fleet import stages
from daemon.registry import Registry
from daemon.registry.journal import Journal

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")]  # fmt: skip

BAKE_S = 2.0


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path / "pool", n=3)
    yield p
    p.close()


def start_hosts(
    factory: Callable[..., DaemonProcess], url: str, pool: WorkerPool, stages: list[dict[str, Any]]
) -> list[DaemonProcess]:
    d = [host_daemon(factory, url, i, pool.workers[i], {}, stages=stages) for i in range(3)]
    for x in d:
        x.start(timeout=120)
    for i in range(3):
        wait_until(lambda i=i: aliases_of(url, f"host-{i}") == {"serving": "v0", "last_good": "v0"}, 240, 0.2,
                   f"host-{i} on v0")  # fmt: skip
    return d


def query(url: str, sql: str, **params: Any) -> list[Any]:
    reg = Registry(url)
    try:
        with reg.engine.connect() as c:
            return list(c.execute(text(sql), params))
    finally:
        reg.close()


def rollout_cli(tmp_path: Path, url: str, *args: str) -> Any:
    cfg = make_config_file(tmp_path / "cli.toml", database={"url": url}, fleet={"host": "ops", "enabled": True},
                           daemon={"state_dir": str(tmp_path / "cli-state")})  # fmt: skip
    out = hotswap_cli("fleet", "rollout", *args, "-c", str(cfg))
    assert out.returncode == 0, out.stderr
    return out.stdout


def status(url: str) -> dict[str, Any]:
    """The staged rollout as `hotswap fleet rollout status --json` prints it (read in-process: quick)."""
    reg = Registry(url)
    try:
        return stages.status(reg) or {}
    finally:
        reg.close()


def steer(url: str, action: str) -> None:
    reg = Registry(url, "ops")
    try:
        stages.command(Journal(reg), action, by="test")
    finally:
        reg.close()


def hosts_that_rolled_out(url: str, version: str) -> set[str]:
    rows = query(url, "SELECT r.host FROM rollouts r JOIN checkpoints c ON c.id = r.checkpoint_id WHERE c.version = :v",
                 v=version)  # fmt: skip
    return {r.host for r in rows}


def test_a_good_version_goes_stage_by_stage_through_a_pause_and_the_deciding_hosts_death(
    tmp_path: Path, pg_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = start_hosts(
        daemon_factory, pg_url, pool, [{"hosts": 1, "bake_s": 10.0}, {"hosts": 2, "bake_s": BAKE_S}]
    )
    publish_into(d[1].watch_dir, "v1", seed=1)  # host-1 verifies it first: its canary
    wait_until(lambda: status(pg_url).get("version") == "v1", 240, 0.05, "the staged rollout of v1")
    steer(pg_url, "pause")  # at once: the canary (admitted already) still takes it, nobody else
    for i in (0, 2):
        publish_into(d[i].watch_dir, "v1", seed=1)
    wait_until(
        lambda: aliases_of(pg_url, "host-1") == {"serving": "v1", "last_good": "v1"},
        240,
        0.2,
        "the canary on v1",
    )
    for x in d:  # what must not happen: several full looks of every host's fleet agent, and no stage moves
        wait_passes(x, "fleet_agent", 3)
    doc = status(pg_url)
    assert (doc["state"], doc["stage"], doc["stage_ready_at"]) == ("paused", 0, None), doc
    assert hosts_that_rolled_out(pg_url, "v1") == {"host-1"}
    assert pool.workers[0].info()["version"] == pool.workers[2].info()["version"] == "v0"
    out = rollout_cli(tmp_path, pg_url)
    assert "v1 (from v0), paused" in out and "host-1 passed" in out, out

    assert "resume" in rollout_cli(tmp_path, pg_url, "resume")
    wait_until(lambda: status(pg_url)["stage"] >= 1, 120, 0.05, "stage 2 admitted")
    d[1].kill()  # the canary's daemon began the rollout and took its first decisions: gone mid-rollout
    (killed_at,) = query(pg_url, "SELECT now() AS at")
    wait_until(lambda: status(pg_url)["state"] == "done", 300, 0.5, "the rollout done without host-1")
    for i in (0, 2):
        assert aliases_of(pg_url, f"host-{i}") == {"serving": "v1", "last_good": "v1"}
        pool.workers[i].wait_running(60, version="v1")

    doc = status(pg_url)
    assert {h["host"]: (h["stage"], h["host_state"]) for h in doc["hosts"]} == {
        "host-1": (0, "passed"), "host-0": (1, "passed"), "host-2": (2, "passed")}  # fmt: skip
    events = query(pg_url, "SELECT e.host, e.to_state, e.at, e.detail FROM events e WHERE e.to_state LIKE 'fleet_%' "
                           "AND e.to_state NOT LIKE 'fleet_lease%' ORDER BY e.at, e.id")  # fmt: skip
    admitted = {}
    for e in events:
        if e.to_state == "fleet_stage_admitted":
            detail = e.detail if isinstance(e.detail, dict) else json.loads(e.detail)
            for h in detail["hosts"]:
                admitted[h] = e.at
    starts = {r.host: r.started_at for r in query(pg_url, "SELECT r.host, MIN(r.started_at) AS started_at FROM rollouts r "
                                                   "JOIN checkpoints c ON c.id = r.checkpoint_id WHERE c.version = 'v1' "
                                                   "GROUP BY r.host")}  # fmt: skip
    for h in ("host-0", "host-2"):  # nobody rolled it out before its stage admitted it
        assert starts[h] >= admitted[h], (h, starts[h], admitted[h])
    assert admitted["host-1"] < admitted["host-0"] < admitted["host-2"]
    deciders_after_kill = {e.host for e in events if e.at > killed_at.at}  # (a SIGKILLed daemon writes none)
    assert events[0].host == "host-1" and deciders_after_kill, events  # the others finished it


def test_a_bad_canary_halts_the_rollout_and_an_abort_takes_the_canary_back(
    tmp_path: Path, pg_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = start_hosts(
        daemon_factory, pg_url, pool, [{"hosts": 1, "bake_s": 20.0}]
    )  # the abort lands in its bake
    publish_into(d[1].watch_dir, "bad", seed=1, fault="nan")  # the worker's own probe fails on it
    wait_until(lambda: status(pg_url).get("version") == "bad", 240, 0.05, "the staged rollout of bad")
    for i in (0, 2):
        publish_into(d[i].watch_dir, "bad", seed=1, fault="nan")
    wait_until(lambda: status(pg_url)["state"] == "halted", 240, 0.3, "the halt")
    doc = status(pg_url)
    assert "rejected at stage 1 of 2" in doc["reason"], doc
    assert "halted" in rollout_cli(tmp_path, pg_url)
    pool.workers[1].wait_running(120, version="v0")
    wait_until(lambda: aliases_of(pg_url, "host-1")["serving"] == "v0", 60, 0.2, "the canary back on v0")

    publish_into(d[1].watch_dir, "v2", seed=2)
    wait_until(lambda: status(pg_url).get("version") == "v2", 240, 0.3, "the staged rollout of v2")
    for i in (0, 2):
        publish_into(d[i].watch_dir, "v2", seed=2)
    wait_until(
        lambda: aliases_of(pg_url, "host-1") == {"serving": "v2", "last_good": "v2"},
        240,
        0.2,
        "the canary on v2",
    )
    assert "abort" in rollout_cli(tmp_path, pg_url, "abort")  # in stage 1's bake (20 s)
    wait_until(
        lambda: aliases_of(pg_url, "host-1")["serving"] == "v0",
        240,
        0.2,
        "the canary back on v0 after the abort",
    )
    pool.workers[1].wait_running(60, version="v0")
    assert status(pg_url)["state"] == "aborted"
    for i in (0, 2):  # never rolled out or served anywhere outside the canary
        assert aliases_of(pg_url, f"host-{i}")["serving"] == "v0"
        assert pool.workers[i].info()["version"] == "v0"
    assert hosts_that_rolled_out(pg_url, "bad") == {"host-1"}
    assert hosts_that_rolled_out(pg_url, "v2") == {"host-1"}
    (st,) = query(pg_url, "SELECT status FROM checkpoints WHERE version = 'v2'")
    assert st.status == "rejected"
