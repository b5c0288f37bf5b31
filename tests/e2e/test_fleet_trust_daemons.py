"""The database alone cannot steer a fleet, with two real daemons (two hosts, each with its own real
worker) on one real PostgreSQL (daemon.fleet.trust; the decisions alone: tests/fleet/test_fleet_trust.py):

- a login without grants holds the advisory key decisions took at d23160d for the whole test: the
  canary is admitted all the same, once the fleet-role session that holds the new row lock lets go;
  while it holds it, both daemons' `/health` and `hotswap status --fleet` name `fleet_stalled`;
- a role with INSERT only on `fleet_rollout_hosts` and `fleet_target` admits the other host and
  sets a target: both are refused (each `/health` names them), and no host serves the forged
  version.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import POSTGRES_ENV, DaemonProcess, hotswap_cli, make_config_file, wait_until
from sqlalchemy import create_engine, text
from support_fleet_daemons import aliases_of, host_daemon
from support_rollout import WorkerPool, publish_into

from tests.fleet.test_fleet_trust import OLD_LOCK_KEY, role

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")]  # fmt: skip


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path / "pool", n=2)
    yield p
    p.close()


def problems(d: DaemonProcess) -> dict[str, str]:
    r = d.get("/health")
    return {p["kind"]: p["reason"] for p in r.json().get("problems", [])}


def fleet_status(tmp_path: Path, url: str) -> str:
    cfg = make_config_file(tmp_path / "cli.toml", database={"url": url}, fleet={"host": "ops", "enabled": True},
                           daemon={"state_dir": str(tmp_path / "cli-state")})  # fmt: skip
    out = hotswap_cli("status", "--fleet", "-c", str(cfg), env={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    return " ".join(out.stdout.split())


def one(url: str, sql: str, **params: Any) -> Any:
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            return c.execute(text(sql), params).scalar()
    finally:
        engine.dispose()


def test_a_stalled_lock_is_named_and_forged_admissions_and_targets_are_refused(
    tmp_path: Path, pg_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = [host_daemon(daemon_factory, pg_url, i, pool.workers[i], {}, stages=[{"hosts": 1, "bake_s": 3600.0}])
         for i in range(2)]  # fmt: skip
    for x in d:
        x.start(timeout=120)
    for i in range(2):
        wait_until(lambda i=i: aliases_of(pg_url, f"host-{i}") == {"serving": "v0", "last_good": "v0"}, 240, 0.2,
                   f"host-{i} on v0")  # fmt: skip
    with role(pg_url) as nobody:
        assert nobody.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": OLD_LOCK_KEY}).scalar()
        holder = create_engine(pg_url).connect()
        try:
            holder.execute(text("SELECT * FROM fleet_decider FOR UPDATE"))  # a fleet-role session holds the lock
            publish_into(d[1].watch_dir, "v1", seed=1)  # host-1 verifies it first: its canary, once decided
            wait_until(lambda: one(pg_url, "SELECT count(*) FROM fleet_rollouts") == 1, 240, 0.05,
                       "the staged rollout of v1 begun by host-1")  # fmt: skip
            publish_into(d[0].watch_dir, "v1", seed=1)
            wait_until(lambda: all("fleet_stalled" in problems(x) for x in d), 240, 0.3, "fleet_stalled on both")
            assert d[0].get("/health").status_code == 200  # a warning: both keep serving v0
            assert "fleet_decider" in problems(d[1])["fleet_stalled"]
            out = fleet_status(tmp_path, pg_url)
            assert "fleet stalled: staged rollout of v1, stage 0: fleet_stage_admitted due for" in out, out
        finally:
            holder.rollback()
            holder.close()
        # the advisory key is still held by the login without grants: nothing waits for it
        wait_until(lambda: aliases_of(pg_url, "host-1") == {"serving": "v1", "last_good": "v1"}, 240, 0.2,
                   "the canary on v1")  # fmt: skip
        wait_until(lambda: not any("fleet_stalled" in problems(x) for x in d), 60, 0.3, "fleet_stalled gone")
    assert one(pg_url, "SELECT created_by FROM fleet_rollouts") == "host-1"
    rid = one(pg_url, "SELECT id FROM fleet_rollouts")
    v0 = one(pg_url, "SELECT id FROM checkpoints WHERE version = 'v0'")
    forged_at = one(pg_url, "SELECT now()")
    with role(pg_url, "INSERT ON fleet_rollout_hosts", "INSERT ON fleet_target") as forger:
        # host-0 into the canary's stage (skipping its bake), and the whole fleet back to v0
        forger.execute(text("INSERT INTO fleet_rollout_hosts (rollout_id, host, stage, admitted_at, decided_by, tick) "
                            "VALUES (:r, 'host-0', 0, now(), 'host-1', 1)"), {"r": rid})  # fmt: skip
        forger.execute(text("INSERT INTO fleet_target (id, checkpoint_id, set_at, set_by) "
                            "VALUES (1, :c, now(), 'alice (forged)')"), {"c": v0})  # fmt: skip
    for x in d:  # each host looked at both and refused them
        wait_until(lambda x=x: "alice (forged)" in problems(x).get("fleet_decision_refused", ""), 120, 0.3,
                   "the forged target refused")  # fmt: skip
    wait_until(lambda: one(pg_url, "SELECT count(*) FROM events WHERE to_state = 'fleet_admission_refused'") == 1,
               120, 0.3, "the forged admission refused by a decider")  # fmt: skip
    assert "host-0 to stage 0" in problems(d[0])["fleet_decision_refused"]
    assert "fleet target refused: fleet_target v0 set by 'alice (forged)'" in fleet_status(tmp_path, pg_url)
    # the refusals above were each host's full look after the forgery: nobody moved on it
    assert one(pg_url, "SELECT count(*) FROM rollouts r JOIN checkpoints c ON c.id = r.checkpoint_id "
                       "WHERE c.version = 'v1' AND r.host = 'host-0'") == 0  # fmt: skip
    assert aliases_of(pg_url, "host-0")["serving"] == "v0" and pool.workers[0].info()["version"] == "v0"
    assert aliases_of(pg_url, "host-1")["serving"] == "v1" and pool.workers[1].info()["version"] == "v1"
    assert one(pg_url, "SELECT count(*) FROM rollouts WHERE started_at > :t", t=forged_at) == 0  # none since
