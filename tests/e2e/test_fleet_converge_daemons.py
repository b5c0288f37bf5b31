"""Two real daemons (two hosts) on one PostgreSQL registry, each with its own folder and worker.

- a host whose folder lacks the fleet target's bytes says why it is behind: its `host_behind`
  warning in `/health`, `/metrics` and `hotswap status`, and its reason under the table of
  `hotswap status --fleet` (and in `--json`); all gone once its copy arrives and it converges;
- `hotswap fleet target v1` (older) moves every host back to v1, each then `in sync` with lag 0
  (v2 was deployed everywhere, but the target is v1); `--clear` brings the fleet back to v2, the
  newest good version, though every host's last_good had become v1.
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
from support_fleet_daemons import aliases_of, host_daemon
from support_rollout import WorkerPool, publish_into

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")]  # fmt: skip
ON = 240  # seconds a host may take to reach a version (two cores shared: generous)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path_factory.mktemp("pool"), n=2)
    yield p
    p.close()


def two_hosts(factory: Callable[..., DaemonProcess], url: str, pool: WorkerPool) -> list[DaemonProcess]:
    d = [host_daemon(factory, url, i, pool.workers[i], {}) for i in range(2)]
    for x in d:
        x.start(timeout=120)
    for i in range(2):
        on(url, i, "v0")
    return d


def on(url: str, i: int, version: str) -> None:
    wait_until(lambda: aliases_of(url, f"host-{i}") == {"serving": version, "last_good": version}, ON, 0.2,
               f"host-{i} serving {version} (its last_good too)")  # fmt: skip


def cli_config(tmp_path: Path, url: str) -> Path:
    return make_config_file(tmp_path / "cli.toml", database={"url": url}, fleet={"host": "host-0", "enabled": True},
                            daemon={"state_dir": str(tmp_path / "cli-state")})  # fmt: skip


def fleet_json(cfg: Path) -> dict[str, Any]:
    out = hotswap_cli("status", "--fleet", "--json", "-c", str(cfg))
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def settled(rows: Any, ok: Callable[[Any], bool]) -> Any:
    """`rows` when `ok` holds for each (a dict: for each value), else None (looked at again)."""
    return rows if all(ok(r) for r in (rows.values() if isinstance(rows, dict) else rows)) else None


def test_a_host_without_the_targets_bytes_says_why_it_is_behind(
    tmp_path: Path, pg_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = two_hosts(daemon_factory, pg_url, pool)
    cfg = cli_config(tmp_path, pg_url)
    publish_into(d[0].watch_dir, "v1", seed=1)  # only host-0's folder has v1
    on(pg_url, 0, "v1")

    def behind_problem() -> dict[str, Any] | None:  # about v1 (while host-1 starts, it is behind v0)
        doc = d[1].get("/health").json()
        return next((p for p in doc.get("problems", []) if p["kind"] == "host_behind"
                     and "fleet target v1" in p["reason"]), None)  # fmt: skip

    p = wait_until(behind_problem, 90, 0.2, "host-1's host_behind problem about v1 in /health")
    assert p["subject"] == "host-1" and p["severity"] == "warning", p
    assert "not the fleet target v1" in p["reason"] and "not on this host" in p["reason"], p
    assert d[1].get("/health").status_code == 200  # a warning: host-1 still serves v0
    gauges = [ln for ln in d[1].get("/metrics").text.splitlines() if ln.startswith("hotswap_problem{")]
    assert 'hotswap_problem{kind="host_behind",severity="warning",subject="host-1"} 1.0' in gauges, gauges
    status = hotswap_cli("status", "-c", str(d[1].config_path))
    assert f"host_behind host-1: {p['reason']}" in status.stdout, status.stdout
    row = next(h for h in fleet_json(cfg)["hosts"] if h["host"] == "host-1")
    assert (row["state"], row["behind_target"], row["behind_cause"], row["behind_reason"]) == (
        "behind", "v1", "not_here", p["reason"]), row  # fmt: skip
    table = hotswap_cli("status", "--fleet", "-c", str(cfg), env={"COLUMNS": "80"})
    lines = table.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= 80, table.stdout
    under = [ln for ln in lines if ln.startswith("host-1: ")]  # its reason, on its own line(s) under the table
    assert under and under[0].startswith("host-1: serves v0, not the fleet target v1"), table.stdout
    assert not [ln for ln in lines if ln.startswith("host-0: ")], table.stdout  # host-0 is on the target

    publish_into(d[1].watch_dir, "v1", seed=1)  # its copy arrives: it converges, and the reason goes
    on(pg_url, 1, "v1")
    wait_until(lambda: behind_problem() is None, 60, 0.2, "host-1's host_behind problem to end")
    hosts = wait_until(lambda: settled(fleet_json(cfg)["hosts"], lambda r: r["behind_reason"] is None), 60, 0.2,
                       "no host with a reason in status --fleet")  # fmt: skip
    assert {h["host"]: (h["serving"], h["state"], h["lag"]) for h in hosts} == {
        "host-0": ("v1", "in sync", 0), "host-1": ("v1", "in sync", 0)}, hosts  # fmt: skip


def test_an_older_target_then_its_clear_move_the_fleet_and_lag_agrees_with_state(
    tmp_path: Path, pg_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = two_hosts(daemon_factory, pg_url, pool)
    cfg = cli_config(tmp_path, pg_url)
    for version, seed in (("v1", 1), ("v2", 2)):
        for i in range(2):  # host-0 registers and verifies it; host-1 finds its own copy
            publish_into(d[i].watch_dir, version, seed=seed)
            on(pg_url, i, version)

    def fleet() -> dict[str, tuple[str, str, int]]:
        return {h["host"]: (h["serving"], h["state"], h["lag"]) for h in fleet_json(cfg)["hosts"]}

    assert fleet() == {"host-0": ("v2", "in sync", 0), "host-1": ("v2", "in sync", 0)}
    held = hotswap_cli("fleet", "target", "v1", "-c", str(cfg))
    assert held.returncode == 0, held.stderr
    for i in range(2):  # the operator's older target: every host goes back to v1
        on(pg_url, i, "v1")
    seen = wait_until(lambda: settled(fleet(), lambda r: r[1] == "in sync"), 60, 0.2,
                      "both hosts in sync on v1")  # fmt: skip
    assert seen == {"host-0": ("v1", "in sync", 0), "host-1": ("v1", "in sync", 0)}, seen  # v2 is newer, lag is 0
    cleared = hotswap_cli("fleet", "target", "--clear", "-c", str(cfg))
    assert cleared.returncode == 0, cleared.stderr
    assert "fleet target: v2" in cleared.stdout, cleared.stdout
    for i in range(2):  # back to the newest good version, though every last_good was v1
        on(pg_url, i, "v2")
    seen = wait_until(lambda: settled(fleet(), lambda r: r[1] == "in sync"), 60, 0.2,
                      "both hosts in sync on v2")  # fmt: skip
    assert seen == {"host-0": ("v2", "in sync", 0), "host-1": ("v2", "in sync", 0)}, seen
