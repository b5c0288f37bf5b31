"""Fleet simulation (issue 28): N hosts on one PostgreSQL registry roll out a new version under the
fleet-wide lease bound, through PgBouncer in transaction mode or directly.

    python -m bench.fleet_sim [--hosts 100 300 1000] [--modes pgbouncer direct] [--bound-pct 5]
        [--update-s 2] [--poll-s 5] [--lease-s 10] [--pool-size 40] [--direct-max-hosts 20]
        [--steady-polls 2] [--no-kill] [--staged-canary-fails] [--pg-server postgresql+psycopg://postgres@127.0.0.1:5432]
        [--gb 16.06 [--ratios 1 0.015] [--link-gbps 25] [--origin-gbps 100] [--model]] [--out FILE.json]

Each host (bench/fleet_sim_host.py) is the real `FleetAgent`, `FleetLeases` and registry code with
its own `Registry` (own engine: its own connection path), ticking every `poll_s`; a fake update is
`update_s` of sleep inside the lease, between the rollout's rows. Threads of one process, or of
`--procs` processes reporting to one ledger (bench/fleet_sim_procs.py).

Per run, in a throw-away database `fleet_sim_<pid>_<n>` (migrated, seeded, dropped after):

1. steady state: every host on v0 and ticking; for `steady_polls` poll intervals, the statements
   (and pool pre-pings) each host sends, server connections and transactions per second;
2. rollout: v1 becomes good (its first host's health window passed); commit -> every host serving
   v1, against the ideal ceil(N / bound) x update_s; most hosts holding a slot at once (the sim's
   ledger and `fleet_leases` sampled every 0.25 s); double grants; connections and queries per second;
3. SIGKILL (unless --no-kill): v2 the same way, the first host of its second wave killed halfway
   through its update (nothing renews or releases its slot; not restarted); commit -> every live
   host on v2, and how long the slot stayed dead (kill -> the slot's next acquisition).

`direct`: every host connects to PostgreSQL itself, up to two connections each while it updates
(its agent's look and the rollout); `max_connections` (100), shared with other users of the server,
allows about 20 such hosts, so direct runs use min(N, --direct-max-hosts) hosts (the run says so).

Bytes (`--gb`, issue 38; bench/fleet_sim_bytes.py): each version is `--gb` GB x a delta/full ratio
(`--ratios`, or `--ratios-from` bench/delta.py's record: full, 1 % density, the RL-like and
SFT-like Adam steps) that no host has yet; a host fetches it in its tick through one origin of
`--origin-gbps` shared by the hosts fetching at once, each at most its `--link-gbps` (a list:
round-robin over the hosts), then converges. Each run also gives the virtual-time model's figure
for the same setting; `--model` runs only the model (any size: 1,000 hosts x 16 GB in a second).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.fleet_sim_bytes import GBIT, bytes_table, links_for, model_rollout, model_table, recorded_ratios
from bench.fleet_sim_host import Ledger
from bench.fleet_sim_pg import (
    Bouncer,
    Sampler,
    commit_version,
    create_database,
    drop_database,
    seed_fleet,
    window,
)
from bench.fleet_sim_procs import HostGroup, shared_ledger, start_hosts, totals
from bench.fleet_sim_staged import staged_canary_fails
from bench.fleet_sim_staged import table as staged_table
from daemon.common.logging import configure_logging
from daemon.fleet.settings import FleetSettings

VERSIONS = ["v0", "v1", "v2"]


def load_average() -> str:
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def wait_converged(ledger: Ledger, version: str, names: list[str], timeout_s: float) -> float | None:
    """Seconds until every live host serves `version` (None: not within `timeout_s`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        at = ledger.converged_at(version, names)
        if at is not None:
            return max(at, t0) - t0
        time.sleep(0.1)
    return None


def where_the_time_went(snap: dict[str, Any], version: str, t0: float) -> dict[str, Any]:
    """Commit -> first slot taken, mean slot hold (acquire -> release), mean time a freed slot
    stayed free before its next holder took it, and the last release -> the end."""
    taken = sorted((t, h, slot) for t, h, slot, v in snap["acquisitions"] if v == version)
    if not taken:
        return {}
    first = taken[0][0]
    released = sorted((t, h, slot) for t, h, slot in snap["releases"] if t >= first)
    holds = []
    for t, h, slot in taken:
        end = next((r for r, rh, rs in released if rh == h and rs == slot and r >= t), None)
        if end is not None:
            holds.append(end - t)
    gaps = []
    for r, _h, slot in released:
        nxt = next((t for t, _, s in taken if s == slot and t >= r), None)
        if nxt is not None:
            gaps.append(nxt - r)
    done = snap["converged"].get(version, {})
    return {"first_slot_s": round(first - t0, 2),
            "hold_mean_s": round(sum(holds) / len(holds), 3) if holds else None,
            "slot_free_mean_s": round(sum(gaps) / len(gaps), 3) if gaps else None,
            "tail_s": round(max(done.values()) - released[-1][0], 2) if done and released else None}  # fmt: skip


def rollout(version: str, db_url: str, hosts: list[HostGroup], names: list[str], ledger: Ledger, sampler: Sampler,
            bouncer: Bouncer | None, database: str, ideal_s: float, bytes_ideal_s: float = 0.0) -> dict[str, Any]:  # fmt: skip
    before, bstats, t0 = totals(hosts), bouncer.stats(database) if bouncer else {}, time.monotonic()
    commit_version(db_url, version)
    took = wait_converged(ledger, version, names, timeout_s=(ideal_s + bytes_ideal_s) * 4 + 60)
    t1 = time.monotonic()
    after, astats = totals(hosts), bouncer.stats(database) if bouncer else {}
    span = t1 - t0
    snap = ledger.snapshot()
    out: dict[str, Any] = {
        "version": version,
        "converged_s": None if took is None else round(took, 2),
        "ideal_s": ideal_s,
        "ratio": None if took is None else round(took / ideal_s, 3),
        "hosts_converged": len(snap["converged"].get(version, {})),
        **where_the_time_went(snap, version, t0),
        "statements_per_s": round((after[0] - before[0]) / span, 1),
        "pings_per_s": round((after[1] - before[1]) / span, 1),
        "sessions_per_s": round((after[2] - before[2]) / span, 1),
        **window(sampler.between(t0, t1), span),
        **ledger.fetch_summary(version, t0),
    }
    if astats:
        out["pgbouncer_queries_per_s"] = round(
            (astats["total_query_count"] - bstats["total_query_count"]) / span, 1
        )
        out["pgbouncer_xacts_per_s"] = round(
            (astats["total_xact_count"] - bstats["total_xact_count"]) / span, 1
        )
    return out


def simulate(
    mode: str, n: int, args: argparse.Namespace, log: Any, ratio: tuple[str, float] | None = None
) -> dict[str, Any]:
    wanted = n
    if mode == "direct":
        n = min(n, args.direct_max_hosts)
    bound = max(1, math.ceil(n * args.bound_pct / 100))
    database = f"fleet_sim_{os.getpid()}_{n}_{mode}"
    db_url = create_database(args.pg_server, database)
    bouncer = Bouncer(args.pg_server, args.pool_size) if mode == "pgbouncer" else None
    folder = Path(tempfile.mkdtemp(prefix="fleet-sim-"))
    names = [f"sim-{i:04d}" for i in range(n)]
    kill: dict[str, Any] = {"kill_at_acquisition": None if args.no_kill else bound + 1, "kill_version": "v2"}
    nbytes = args.gb * 1e9 * ratio[1] if ratio is not None else 0.0
    if ratio is not None:  # the bytes dimension: v1 and v2 are fetched through the origin model
        kill.update(origin_bps=args.origin_gbps[0] * GBIT, version_bytes={v: nbytes for v in VERSIONS[1:]},
                    links=links_for(names, args.link_gbps), copies=str(folder))  # fmt: skip
    manager, ledger = shared_ledger(**kill) if args.procs > 1 else (None, Ledger(**kill))
    hosts: list[HostGroup] = []
    stopped: list[dict[str, int]] = []
    sampler = Sampler(db_url, database)
    result: dict[str, Any] = {"mode": mode, "hosts": n, "hosts_asked": wanted, "bound": bound,
                              "update_s": args.update_s, "poll_s": args.poll_s, "lease_s": args.lease_s,
                              "pool_size": args.pool_size if bouncer else None, "procs": args.procs}  # fmt: skip
    if ratio is not None:
        result.update(encoding=ratio[0], ratio=ratio[1], bytes_per_host=nbytes, link_gbps=args.link_gbps,
                      origin_gbps=args.origin_gbps[0])  # fmt: skip
    try:
        seed_fleet(db_url, names, VERSIONS, folder, copies=1 if ratio is not None else None)
        if bouncer is not None:
            bouncer.start()
        url = bouncer.url(database) if bouncer else db_url
        settings = FleetSettings(
            enabled=True, max_updating_hosts=bound, lease_s=args.lease_s, poll_s=args.poll_s
        )
        rng = random.Random(n)
        phases = [rng.uniform(0, args.poll_s) for _ in names]
        hosts = start_hosts(names, url, settings, args.update_s, ledger, phases, args.procs)
        sampler.start()
        log(f"{mode} {n} hosts, bound {bound}: started; warming up {args.poll_s * 2:.0f} s")
        time.sleep(args.poll_s * 2)  # every host's first ticks (connections, a first fleet_host_reasons look)
        before, bstats, t0 = totals(hosts), bouncer.stats(database) if bouncer else {}, time.monotonic()
        time.sleep(args.poll_s * args.steady_polls)
        after, astats, t1 = totals(hosts), bouncer.stats(database) if bouncer else {}, time.monotonic()
        polls = n * (t1 - t0) / args.poll_s
        steady: dict[str, Any] = {
            "statements_per_host_per_poll": round((after[0] - before[0]) / polls, 2),
            "pings_per_host_per_poll": round((after[1] - before[1]) / polls, 2),
            "sessions_per_host_per_poll": round((after[2] - before[2]) / polls, 2),
            "statements_per_s": round((after[0] - before[0]) / (t1 - t0), 1),
            **window(sampler.between(t0, t1), t1 - t0),
        }
        if astats:
            steady["pgbouncer_queries_per_host_per_poll"] = round(
                (astats["total_query_count"] - bstats["total_query_count"]) / polls, 2)  # fmt: skip
            steady["pgbouncer_xacts_per_host_per_poll"] = round(
                (astats["total_xact_count"] - bstats["total_xact_count"]) / polls, 2)  # fmt: skip
        result["steady"] = steady
        log(f"steady: {steady}")
        ideal = math.ceil(n / bound) * args.update_s
        model = (model_rollout(n, bound, args.update_s, args.poll_s, nbytes, args.link_gbps, args.origin_gbps[0])
                 if ratio is not None else None)  # fmt: skip
        fetch_s = model["last_fetch_end_s"] if model is not None else 0.0
        result["rollout"] = rollout("v1", db_url, hosts, names, ledger, sampler, bouncer, database, ideal,
                                    fetch_s)  # fmt: skip
        if model is not None:
            result["rollout"]["model"] = model
        log(f"rollout: {result['rollout']}")
        if not args.no_kill:
            result["kill"] = rollout("v2", db_url, hosts, names, ledger, sampler, bouncer, database, ideal,
                                     fetch_s)  # fmt: skip
            k = result["kill"]
            k["cost_s"] = (round(k["converged_s"] - result["rollout"]["converged_s"], 2)
                           if k["converged_s"] is not None and result["rollout"]["converged_s"] is not None else None)  # fmt: skip
            snap = ledger.snapshot()
            k["killed"] = [h for _, h, _ in snap["kills"]]
            k["slot_dead_s"] = [round(t["after_kill_s"], 2) for t in snap["takeovers"]]
            log(f"kill: {k}")
    finally:
        sampler.stop()
        stopped = [g.stop() for g in hosts]
        if bouncer is not None:
            bouncer.stop()
        drop_database(args.pg_server, database)
        snap = ledger.snapshot()
        if manager is not None:
            manager.shutdown()
    result["peak_holders_ledger"] = snap["peak"]
    result["double_grants"] = snap["double_grants"]
    result["lost_leases"] = sum(x.get("lost_leases", 0) for x in stopped)
    result["unexpected_submits"] = sum(x.get("unexpected_submits", 0) for x in stopped)
    result["errors"] = snap["errors"][:10]
    result["error_count"] = len(snap["errors"])
    return result


def table(doc: dict[str, Any]) -> str:
    head = ["mode", "hosts", "bound", "commit->converged", "ideal", "ratio", "peak holders (ledger/db)",
            "double grants", "server conns peak (steady/rollout)",
            "per host per poll: statements + pings (queries PgBouncer passed on)",
            "stmts/s steady / rollout", "xacts/s steady / rollout", "SIGKILL cost (slot dead)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in doc["runs"]:
        st, ro, k = r.get("steady", {}), r.get("rollout", {}), r.get("kill", {})
        dead = ", ".join(f"{s:.1f}" for s in k.get("slot_dead_s", []))
        cells = [r["mode"], str(r["hosts"]), str(r["bound"]), f"{ro.get('converged_s')} s", f"{ro.get('ideal_s')} s",
                 f"{ro.get('ratio')}", f"{r['peak_holders_ledger']} / {max(ro.get('holders_peak_db', 0), k.get('holders_peak_db', 0))}",
                 str(r["double_grants"]), f"{st.get('server_conns_peak')} / {max(ro.get('server_conns_peak', 0), k.get('server_conns_peak', 0))}",
                 f"{st.get('statements_per_host_per_poll')} + {st.get('pings_per_host_per_poll')}"
                 + (f" ({st['pgbouncer_queries_per_host_per_poll']})" if "pgbouncer_queries_per_host_per_poll" in st else ""),
                 f"{st.get('statements_per_s')} / {ro.get('statements_per_s')}",
                 f"{st.get('xacts_per_s')} / {ro.get('xacts_per_s')}",
                 f"{k.get('cost_s')} s ({dead} s)" if k else "-"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, nargs="+", default=[100, 300, 1000])
    p.add_argument("--modes", nargs="+", default=["pgbouncer", "direct"], choices=["pgbouncer", "direct"])
    p.add_argument(
        "--bound-pct", type=float, default=5.0, help="[fleet] max_updating_hosts as a share of the hosts"
    )
    p.add_argument("--update-s", type=float, default=2.0, help="a fake update's time, inside the lease")
    p.add_argument("--poll-s", type=float, default=5.0, help="[fleet] poll_s")
    p.add_argument("--lease-s", type=float, default=10.0, help="[fleet] lease_s (the daemon's default is 60)")
    p.add_argument(
        "--pool-size", type=int, default=40, help="PgBouncer's server connections (default_pool_size)"
    )
    p.add_argument("--direct-max-hosts", type=int, default=20)
    p.add_argument("--procs", type=int, default=1,
                   help="spread the hosts over this many processes (one runs about 100 before it is the bottleneck)")  # fmt: skip
    p.add_argument("--steady-polls", type=float, default=2.0)
    p.add_argument("--no-kill", action="store_true")
    p.add_argument("--staged-canary-fails", action="store_true",
                   help="instead: a staged rollout whose canary fails (bench/fleet_sim_staged.py)")  # fmt: skip
    p.add_argument("--pg-server", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--gb", type=float, default=0.0, help="a full version's GB (0: every host has every copy)")
    p.add_argument("--ratios", type=float, nargs="+", default=[], help="delta/full ratios (1: full)")
    p.add_argument("--ratios-from", default="bench/results/delta-2core.json", help="else: bench/delta.py's")
    p.add_argument("--link-gbps", type=float, nargs="+", default=[25.0], help="each host's link, round-robin")
    p.add_argument("--origin-gbps", type=float, nargs="+", default=[100.0],
                   help="the origin's bandwidth, shared by the hosts fetching (--model: one run each)")  # fmt: skip
    p.add_argument("--model", action="store_true", help="with --gb: the virtual-time model alone (no SQL)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    configure_logging(level="warning")  # 1,000 hosts' info lines would cost more CPU than their SQL
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)

    doc: dict[str, Any] = {"command": " ".join(["python -m bench.fleet_sim", *sys.argv[1:]]),
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                           "uptime_before": load_average(),
                           "runs": []}  # fmt: skip
    ratios = ({("full" if r == 1 else f"delta {100 * r:g} %"): r for r in args.ratios} if args.ratios
              else recorded_ratios(Path(args.ratios_from)))  # fmt: skip
    if args.gb and args.model:
        doc["model"] = [{**model_rollout(n, max(1, math.ceil(n * args.bound_pct / 100)), args.update_s, args.poll_s,
                                         args.gb * 1e9 * r, args.link_gbps, o),
                         "encoding": name, "ratio": r, "origin_gbps": o, "link_gbps": args.link_gbps}
                        for n in args.hosts for o in args.origin_gbps for name, r in ratios.items()]  # fmt: skip
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(doc, indent=2))
        print(model_table(doc["model"]))
        return 0
    if args.staged_canary_fails:
        doc["staged"] = []
        for n in args.hosts:
            doc["staged"].append(staged_canary_fails(n, args, log))
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(doc, indent=2))
        print()
        print(staged_table(doc["staged"]))
        return 0
    done: set[tuple[str, int]] = set()
    for n in args.hosts:
        for mode in args.modes:
            if (mode, min(n, args.direct_max_hosts) if mode == "direct" else n) in done:
                continue  # direct at 300 and 1,000 hosts is the same capped run
            done.add((mode, min(n, args.direct_max_hosts) if mode == "direct" else n))
            for ratio in ratios.items() if args.gb else [None]:
                run = simulate(mode, n, args, log, ratio)
                run["uptime_after"] = load_average()
                doc["runs"].append(run)
                if args.out:  # after each run: a long run that dies keeps what it measured
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.out).write_text(json.dumps(doc, indent=2))
    print()
    print(table(doc))
    if args.gb:
        print()
        print(bytes_table(doc["runs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
