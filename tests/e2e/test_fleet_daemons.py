"""Three real daemons (three hosts) on one PostgreSQL registry, fleet bound 1, then a fourth.

Each daemon has its own state dir, host name, watched folder and one real reference worker.
What a fleet relies on:
- at no moment do two hosts update at once: from `events`, every host's lease periods
  (fleet_lease_acquired -> _released) are disjoint, and every worker transition of a rollout
  lies inside a lease period of its own host;
- a daemon SIGKILLed mid-rollout (held at PAUSED with its lease) stops renewing: its slot
  expires within `lease_s` of the kill and the other hosts go on;
- every host ends on the same version, with its own `serving` and `last_good`, its worker
  on its own folder's copy; a fourth daemon started later converges to the fleet version.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
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
from sqlalchemy import select, text
from support_fleet_daemons import LEASE_S, aliases_of, host_daemon
from support_rollout import WorkerPool, publish_into

from daemon.registry import Registry
from daemon.registry.models import Event

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")]  # fmt: skip


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path / "pool", n=4)
    yield p
    p.close()


def db_now(url: str) -> datetime:
    reg = Registry(url)
    try:
        with reg.engine.connect() as c:
            now: datetime = c.execute(text("SELECT now()")).scalar_one()
            return now
    finally:
        reg.close()


def lease_periods(events: list[Event], killed: dict[str, datetime]) -> list[tuple[str, datetime, datetime]]:
    """(host, start, end) per lease taken; one left open by a killed daemon ends at its kill."""
    periods: list[tuple[str, datetime, datetime]] = []
    open_: dict[str, datetime] = {}
    for e in events:
        host = str((e.detail or {}).get("host"))
        if e.to_state == "fleet_lease_acquired" and host not in open_:
            open_[host] = e.at
        elif e.to_state == "fleet_lease_acquired":  # re-taken by the same host: a restart's stale one ended
            periods.append((host, open_[host], killed.get(host, e.at)))
            open_[host] = e.at
        elif e.to_state == "fleet_lease_released" and host in open_:
            periods.append((host, open_.pop(host), e.at))
    for host, start in open_.items():
        periods.append((host, start, killed.get(host, datetime.max.replace(tzinfo=start.tzinfo))))
    return sorted(periods, key=lambda p: p[1])


def test_three_hosts_bound_one_kill_mid_rollout_and_a_late_joiner(
    tmp_path: Path, pg_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    w = pool.workers
    release = tmp_path / "never-released"
    hold = {"HOTSWAP_TEST_HOLD_STATE": "PAUSED", "HOTSWAP_TEST_HOLD_WORKER": w[1].name,
            "HOTSWAP_TEST_HOLD_VERSION": "v1", "HOTSWAP_TEST_HOLD_RELEASE": str(release)}  # fmt: skip
    d = [host_daemon(daemon_factory, pg_url, i, w[i], hold if i == 1 else {}) for i in range(3)]
    for x in d:
        x.start(timeout=120)
    for i in range(3):  # hosts 1 and 2 found v0 registered by the fleet and converged to it
        wait_until(lambda i=i: aliases_of(pg_url, f"host-{i}") == {"serving": "v0", "last_good": "v0"}, 240,
                   0.2, f"host-{i} on v0")  # fmt: skip

    # v1 reaches host-1 first: it verifies it and is first to roll it out (held at PAUSED, lease held)
    publish_into(d[1].watch_dir, "v1", seed=1)
    wait_until(lambda: "test_hold_begin" in d[1].log(), 300, 0.2, "host-1 paused mid-rollout of v1")
    for i in (0, 2):  # the same bytes reach the other hosts: they wait for the lease
        publish_into(d[i].watch_dir, "v1", seed=1)
    d[1].kill()  # SIGKILL (waited for): its lease is not released, only no longer renewed
    # read after the kill: a renewal just before it is then inside the bound asserted below
    killed_at = db_now(pg_url)
    reg = Registry(pg_url, "host-0")
    with reg.engine.connect() as c:  # what it held at the kill: nothing renews it any more
        dead = c.execute(text("SELECT slot, expires_at FROM fleet_leases WHERE host = 'host-1'")).one()
    # the dead host's slot expires within lease_s of the kill
    assert dead.expires_at <= killed_at + timedelta(seconds=LEASE_S), (dead, killed_at)
    for i in (0, 2):  # the others go on
        wait_until(lambda i=i: aliases_of(pg_url, f"host-{i}")["last_good"] == "v1", 300, 0.2, f"host-{i} on v1")
    with reg.engine.connect() as c:
        taken = [json.loads(r.detail) if isinstance(r.detail, str) else r.detail for r in c.execute(text(
            "SELECT detail FROM events WHERE to_state = 'fleet_lease_acquired' AND at > :k ORDER BY at, id"),
            {"k": killed_at})]  # fmt: skip
        took_slot = c.execute(text(
            "SELECT MIN(at) FROM events WHERE to_state = 'fleet_lease_acquired' AND at > :k"), {"k": killed_at},
        ).scalar_one()  # fmt: skip
    # ... and no other host took a slot before the dead host's slot expired (the bound is 1)
    assert taken and all(t["host"] != "host-1" and t["slot"] == dead.slot for t in taken[:1]), taken
    assert took_slot >= dead.expires_at, (took_slot, dead.expires_at)

    d[1].env = {}  # restarted without the hold: recovery, then it converges like any host
    d[1].start(timeout=120)
    wait_until(lambda: aliases_of(pg_url, "host-1") == {"serving": "v1", "last_good": "v1"}, 300, 0.2, "host-1 on v1")

    late = host_daemon(daemon_factory, pg_url, 3, w[3], {})
    publish_into(late.watch_dir, "v1", seed=1)
    late.start(timeout=120)
    wait_until(lambda: aliases_of(pg_url, "host-3") == {"serving": "v1", "last_good": "v1"}, 300, 0.2,
               "the late joiner on the fleet version")  # fmt: skip

    daemons = [*d, late]
    for i, x in enumerate(daemons):  # every worker serves v1 from its own host's folder
        info = w[i].wait_running(120, version="v1")
        assert Path(info["path"]).resolve() == (x.watch_dir / "v1").resolve(), (i, info)
    with reg.session() as s:
        rows = s.execute(text("SELECT host, name, checkpoint_id FROM aliases ORDER BY host, name")).all()
        hosts = {r.host for r in rows}
        events = list(s.scalars(select(Event).order_by(Event.at, Event.id)))
        status = s.execute(text("SELECT c.status FROM checkpoints c WHERE c.version = 'v1'")).scalar_one()
    assert hosts == {f"host-{i}" for i in range(4)}  # each host's aliases are its own rows
    assert status == "deployed"

    # the killed host's lease ends when its slot expired, not at the kill: a slot taken in between overlaps
    periods = lease_periods([e for e in events if e.to_state.startswith("fleet_lease_")], {"host-1": dead.expires_at})
    assert {p[0] for p in periods} == {f"host-{i}" for i in range(4)}
    for (h1, _, end1), (h2, start2, _) in zip(periods, periods[1:], strict=False):
        assert start2 >= end1, f"{h2} took a lease at {start2} while {h1} held one until {end1}"
    moves = [e for e in events if e.worker is not None and e.rollout_id is not None]
    assert moves
    for e in moves:  # every worker update happened inside its own host's lease
        assert any(h == e.host and start <= e.at <= end for h, start, end in periods), (e.host, e.worker, e.at, periods)

    cfg = make_config_file(tmp_path / "cli.toml", database={"url": pg_url}, fleet={"host": "host-0"},
                           daemon={"state_dir": str(tmp_path / "cli-state")})  # fmt: skip
    out = hotswap_cli("status", "--fleet", "-c", str(cfg), env={"COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= 80, out.stdout
    assert "fleet target: v1" in out.stdout and all(f"host-{i}" in out.stdout for i in range(4)), out.stdout
    js = hotswap_cli("status", "--fleet", "--json", "-c", str(cfg))
    doc: dict[str, Any] = json.loads(js.stdout)
    assert {h["host"]: (h["serving"], h["state"], h["lag"]) for h in doc["hosts"]} == {
        f"host-{i}": ("v1", "in sync", 0) for i in range(4)}  # fmt: skip
    reg.close()
