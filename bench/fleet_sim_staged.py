"""A staged rollout whose canary fails, for bench/fleet_sim.py (`--staged-canary-fails`).

N simulated hosts (bench/fleet_sim_host.py: the real FleetAgent, leases and registry code) with
`[[fleet.stages]]` = 1 canary host (bake 2 polls), then 10 %, then every host. A bad version is
verified by the canary's host (its `FleetAgent.admits`, as the rollout service asks before it
deploys: this begins the staged rollout) and deployed there; its health window fails (simulated:
the version is rejected and the host rolled back to the previous version, as
daemon.controller.health_window does). Measured: commit -> the rollout halted (any host's agent
decides), how many hosts ever started a rollout of the bad version or served it (must be the
canary alone), and every host back on the previous version.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from bench.fleet_sim_host import Ledger, SimHost
from bench.fleet_sim_pg import Bouncer, create_database, drop_database, seed_fleet
from daemon.fleet import stages
from daemon.fleet.settings import FleetSettings, StageSpec

VERSIONS = ["v0", "bad"]


def staged_canary_fails(n: int, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    bound = max(1, round(n * args.bound_pct / 100))
    database = f"fleet_sim_{os.getpid()}_{n}_staged"
    db_url = create_database(args.pg_server, database)
    bouncer = Bouncer(args.pg_server, args.pool_size)
    names = [f"sim-{i:04d}" for i in range(n)]
    stop_all = threading.Event()
    ledger = Ledger()
    hosts: list[SimHost] = []
    plan = [StageSpec(hosts=1, bake_s=args.poll_s * 2), StageSpec(percent=10, bake_s=args.poll_s * 2)]
    out: dict[str, Any] = {"mode": "pgbouncer", "hosts": n, "bound": bound, "stages": stages.plan_of(plan),
                           "update_s": args.update_s, "poll_s": args.poll_s}  # fmt: skip
    try:
        seed_fleet(db_url, names, VERSIONS, Path(tempfile.mkdtemp(prefix="fleet-sim-")))
        bouncer.start()
        url = bouncer.url(database)
        for name in names:
            s = FleetSettings(enabled=True, host=name, max_updating_hosts=bound, lease_s=args.lease_s,
                              poll_s=args.poll_s, stages=plan)  # fmt: skip
            h = SimHost(name, url, s, args.update_s, ledger, stop_all)
            h.bad = {"bad"}
            hosts.append(h)
        rng = random.Random(n)
        for h in hosts:
            h.start(rng.uniform(0, args.poll_s))
        time.sleep(args.poll_s * 2)
        canary = hosts[0]
        t0 = time.monotonic()
        engine = create_engine(db_url)
        with engine.begin() as c:  # verified on the canary's host (not good anywhere yet)
            c.execute(text("UPDATE checkpoints SET status = 'verified', verified_at = now() WHERE version = 'bad'"))
        bad = canary.journal.checkpoint_by_version("bad")
        assert bad is not None
        out["canary_admitted"] = canary.agent.admits(bad)  # what its rollout service asks before deploying
        canary.converge("bad")  # its own deploy of what it verified
        halted = None
        while time.monotonic() - t0 < args.poll_s * 20 + 60:
            doc = stages.status(canary.registry)
            if doc is not None and doc["state"] == "halted":
                halted = time.monotonic() - t0
                out["reason"] = doc["reason"]
                break
            time.sleep(0.1)
        out["halted_s"] = None if halted is None else round(halted, 2)
        time.sleep(args.poll_s * 3)  # every host's agent has looked at the halted rollout a few times
        with engine.connect() as c:
            started = c.execute(text("SELECT DISTINCT r.host FROM rollouts r JOIN checkpoints k ON k.id = r.checkpoint_id "
                                     "WHERE k.version = 'bad'")).scalars().all()  # fmt: skip
            serving: dict[str, str] = dict(c.execute(text("SELECT a.host, k.version FROM aliases a JOIN checkpoints k ON k.id = "
                                          "a.checkpoint_id WHERE a.name = 'serving'")).all())  # fmt: skip
            status = c.execute(text("SELECT status FROM checkpoints WHERE version = 'bad'")).scalar_one()
        engine.dispose()
        out["hosts_that_rolled_out_bad"] = sorted(started)
        out["hosts_that_served_bad"] = sorted(ledger.converged.get("bad", {}))
        out["hosts_on_v0_after"] = sum(1 for h in names if serving.get(h) == "v0")
        out["bad_status"] = status
    finally:
        stop_all.set()
        for h in hosts:
            if h.thread is not None:
                h.thread.join(2)
        for h in hosts:
            h.close()
        bouncer.stop()
        drop_database(args.pg_server, database)
    out["errors"] = ledger.errors[:10]
    log(f"staged: {out}")
    return out


def table(runs: list[dict[str, Any]]) -> str:
    head = ["hosts", "stages", "commit -> halted", "hosts that rolled it out", "hosts that served it",
            "hosts on v0 after", "its status"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        plan = ", ".join(str(st.get("hosts") or f"{st.get('percent')} %") for st in r["stages"])
        lines.append("| " + " | ".join([str(r["hosts"]), plan, f"{r['halted_s']} s", str(len(r["hosts_that_rolled_out_bad"])),
                                        str(len(r["hosts_that_served_bad"])), f"{r['hosts_on_v0_after']} of {r['hosts']}",
                                        r["bad_status"]]) + " |")  # fmt: skip
    return "\n".join(lines)
