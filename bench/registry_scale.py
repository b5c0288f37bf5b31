"""A registry after years of updates: history, status, the documented views, start-up, one rollout (issue 28).

    python -m bench.registry_scale [--versions 100000 1000000] [--backends sqlite postgresql]
        [--pg-server postgresql+psycopg://postgres@127.0.0.1:5432] [--workdir .bench-out/registry]
        [--reuse] [--keep] [--timeout-s 60] [--start-only] [--start-repeat N] [--out FILE.json]

For each backend and size: a database filled by bench/registry_fill.py (or, with --reuse, the one
a previous --keep run left: SQLite `<workdir>/registry-N.db`, PostgreSQL database `hs_bench_N`),
migrated to the daemon's head (the migration's own time is reported), then each measurement in
its own process (bench/registry_probe.py; imports before the clock, --timeout-s caps a run):

- `hotswap history -n 20`, `hotswap status`, `hotswap status --fleet`, `hotswap show VERSION`: the
  CLI's own entry point in-process (`daemon.cli.main.main`, output discarded), no daemon running;
  history and status also as whole commands (`python -m daemon.cli.main ...`, interpreter start
  and imports included: that constant is shown beside an empty registry's);
- every view query README and docs/ show, and the filters their columns invite (QUERIES);
- one /metrics scrape of the registry series;
- daemon start: `build_daemon` + `start()` until the rollout service has finished start-up and
  recovery (two in-process workers serving the host's serving version), against this registry,
  the same shape with 100 versions and an empty migrated one (nothing serving: less to do
  whatever the history), --start-repeat cold processes each, alternating, with the seconds its
  SQL statements took (every thread's, until ready) and its process's CPU seconds (what it did,
  not what it waited for on a busy machine);
- one rollout's registry writes (registry_probe._rollout_writes).

Goals (docs/reference/performance.md): at 1,000,000 versions, history and status <= 0.5 s, every filtered view query
<= 100 ms, start within 10 % of an empty (here: small) registry's. Prints a table per database; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from bench.registry_fill import fill, make_folders
from bench.registry_probe import CLI, QUERIES, write_config

REPO = Path(__file__).resolve().parents[1]
STARTUP_S = 60.0  # a probe's imports and set-up, before its first run's clock
GOALS = {"history -n 20": 0.5, "status": 0.5, **{name: 0.1 for name, _ in QUERIES}}
MEASURES = [*CLI, "show", *(name for name, _ in QUERIES), "metrics", "rollout writes", "fleet mark"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def run_probe(url: str, config: Path, what: str, repeat: int, timeout_s: float) -> dict[str, Any]:
    """Runs of one measurement in a fresh process: seconds each; a run past `timeout_s` (its
    process's start-up not counted) is killed and recorded as such."""
    cmd = [sys.executable, "-m", "bench.registry_probe", "--url", url, "--config", str(config), "--what", what,
           "--repeat", str(repeat)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    assert proc.stdout is not None
    runs: list[float] = []
    sql: list[float] = []  # start: the seconds its SQL statements took
    slowest = 0.0  # and its slowest statement
    cpu: list[float] = []  # and the CPU seconds of the daemon's process
    deadline = time.monotonic() + timeout_s + STARTUP_S
    while len(runs) < repeat:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = proc.stdout.readline() if ready else ""
        if not line:
            break
        if line.startswith("{"):
            doc = json.loads(line)
            runs.append(doc["s"])
            sql += [doc["sql_s"]] if "sql_s" in doc else []
            cpu += [doc["cpu_s"]] if "cpu_s" in doc else []
            slowest = max([slowest, doc.get("sql_max_s", 0.0)])
            deadline = time.monotonic() + timeout_s
    timed_out = len(runs) < repeat and proc.poll() is None
    proc.kill()
    _, err = proc.communicate()
    if timed_out:
        return {"runs": runs, "timed_out_after_s": timeout_s, "median_s": None}
    if len(runs) < repeat:
        return {"runs": runs, "error": (err.strip().splitlines() or ["no result"])[-1], "median_s": None}
    return {"runs": runs, "median_s": round(statistics.median(runs), 4), **({"sql_runs": sql, "sql_slowest_s": slowest, "cpu_runs": cpu} if sql else {})}


def whole_command(config: Path, argv: list[str], repeat: int, timeout_s: float) -> dict[str, Any]:
    """`python -m daemon.cli.main ARGV -c CONFIG` from outside: what a person at a shell waits."""
    runs: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        try:
            subprocess.run([sys.executable, "-m", "daemon.cli.main", *argv, "-c", str(config)], capture_output=True,
                           timeout=timeout_s, env=_env(), cwd=REPO, check=True)  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"runs": runs, "timed_out_after_s": timeout_s, "median_s": None}
        runs.append(round(time.perf_counter() - t0, 4))
    return {"runs": runs, "median_s": round(statistics.median(runs), 4)}


def database(backend: str, n: int | str, args: argparse.Namespace) -> str:
    if backend == "sqlite":
        return f"sqlite:///{Path(args.workdir).absolute() / f'registry-{n}.db'}"
    return f"{args.pg_server}/hs_bench_{n}"


def exists(url: str) -> bool:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return Path(parsed.database or "").is_file()
    admin = create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        found = c.execute(text("SELECT 1 FROM pg_database WHERE datname = :d"), {"d": parsed.database}).first()
    admin.dispose()
    return found is not None


def create(url: str) -> None:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        drop(url)
        Path(parsed.database or "").parent.mkdir(parents=True, exist_ok=True)
        return
    admin = create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'DROP DATABASE IF EXISTS "{parsed.database}" WITH (FORCE)'))
        c.execute(text(f'CREATE DATABASE "{parsed.database}"'))
    admin.dispose()


def drop(url: str) -> None:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path((parsed.database or "") + suffix).unlink(missing_ok=True)
        return
    admin = create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'DROP DATABASE IF EXISTS "{parsed.database}" WITH (FORCE)'))
    admin.dispose()


def migrate(url: str) -> dict[str, Any]:
    """To the daemon's head (what the first daemon of a new release does), timed."""
    from daemon.registry import Registry

    reg = Registry(url, host="bench-0")
    before = reg.current_revision()
    t0 = time.perf_counter()
    reg.upgrade()
    took = time.perf_counter() - t0
    after = reg.current_revision()
    reg.close()
    return {"from": before, "to": after, "s": round(took, 2)}


def measure(backend: str, n: int, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    url = database(backend, n, args)
    work = Path(args.workdir).absolute() / f"{backend}-{n}"
    out: dict[str, Any] = {"backend": backend, "versions": n, "database": make_url(url).render_as_string()}
    root = Path(args.workdir).absolute() / "ckpt" / str(n)
    if args.reuse and exists(url):
        log(f"{backend} {n:,}: reusing {out['database']}")
    else:
        create(url)
        log(f"{backend} {n:,}: filling")
        out["fill"] = fill(url, n, root=str(root), log=log)
    make_folders(root, n - 60, n)  # the newest versions' folders, whole (what aliases and fallbacks look at)
    out["migration"] = migrate(url)
    config = write_config(work / "config.toml", url, work)
    results: dict[str, Any] = {}
    for what in MEASURES if not args.start_only else ():
        repeat = 1 if what == "rollout writes" else args.repeat
        results[what] = run_probe(url, config, what, repeat, args.timeout_s)
        log(f"  {what}: {_show(results[what])}")
    for name, argv in (("history -n 20 (whole command)", ["history", "-n", "20"]), ("status (whole command)", ["status"])
                       ) if not args.start_only else ():  # fmt: skip
        results[name] = whole_command(config, argv, args.repeat, args.timeout_s)
        log(f"  {name}: {_show(results[name])}")
    results.update(_starts(backend, url, work, args, log))
    out["results"] = results
    if not args.keep:
        drop(url)
    return out


SMALL = 100  # versions of the small registry that start-up is compared with (same shape, no history to speak of)


def _starts(backend: str, url: str, work: Path, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """Daemon start against this registry, the same shape with SMALL versions, and an empty one
    (no serving version: less to do at start whatever the history), alternating."""
    urls = {"full": url, "small": database(backend, "small", args), "empty": database(backend, "empty", args)}
    create(urls["empty"])
    migrate(urls["empty"])
    create(urls["small"])
    fill(urls["small"], SMALL, root=str(work / "small-ckpt"), log=lambda _: None)
    make_folders(work / "small-ckpt", SMALL - 60, SMALL)
    configs = {which: write_config(work / f"start-{which}.toml", u, work / which, workers=True) for which, u in urls.items()}
    runs: dict[str, list[float]] = {w: [] for w in urls}
    sql: dict[str, list[float]] = {w: [] for w in urls}
    slowest: dict[str, float] = {w: 0.0 for w in urls}
    cpu: dict[str, list[float]] = {w: [] for w in urls}
    errors: list[str] = []
    for _ in range(args.start_repeat or args.repeat):
        for which in ("empty", "small", "full"):
            r = run_probe(urls[which], configs[which], "start", 1, args.timeout_s)
            runs[which] += r["runs"]
            sql[which] += r.get("sql_runs", [])
            slowest[which] = max(slowest[which], r.get("sql_slowest_s", 0.0))
            cpu[which] += r.get("cpu_runs", [])
            errors += [f"{which}: {r.get('error') or 'timed out'}"] if not r["runs"] else []
    drop(urls["empty"])
    drop(urls["small"])
    out: dict[str, dict[str, Any]] = {f"daemon start ({which} registry)": {"runs": rs, "median_s": round(statistics.median(rs), 4) if rs else None}
           for which, rs in runs.items()}  # fmt: skip
    out.update({f"daemon start, its SQL ({which} registry)": {"runs": rs, "median_s": round(statistics.median(rs), 4),
                                                              "slowest_statement_s": slowest[which]}
                for which, rs in sql.items() if rs})  # fmt: skip
    out.update({f"daemon start, its CPU ({which} registry)": {"runs": rs, "median_s": round(statistics.median(rs), 4)}
                for which, rs in cpu.items() if rs})  # fmt: skip
    if errors:
        out["daemon start errors"] = {"runs": [], "median_s": None, "error": "; ".join(errors)}
    for name, r in out.items():
        log(f"  {name}: {_show(r)}")
    return out


def _show(r: dict[str, Any]) -> str:
    if r.get("median_s") is not None:
        return f"{r['median_s'] * 1000:.1f} ms (runs {', '.join(f'{x * 1000:.0f}' for x in r['runs'])})"
    if "timed_out_after_s" in r:
        return f"> {r['timed_out_after_s']:.0f} s (killed)"
    return str(r.get("error", "?"))


def table(doc: dict[str, Any]) -> str:
    """One line per measurement, one column per database, the goal beside it."""
    runs = doc["runs"]
    heads = [f"{r['backend']} {r['versions']:,}" for r in runs]
    names = list(dict.fromkeys(k for r in runs for k in r["results"]))
    lines = [" | ".join(["what", *heads, "goal"]), " | ".join(["---"] + ["---:"] * (len(heads) + 1))]
    for name in names:
        cells = []
        for r in runs:
            res = r["results"].get(name)
            cells.append("" if res is None else _cell(res))
        goal = GOALS.get(name)
        lines.append(" | ".join([name, *cells, f"<= {goal * 1000:.0f} ms" if goal else ""]))
    for base in ("small", "empty"):
        start = [(r["results"].get("daemon start (full registry)"), r["results"].get(f"daemon start ({base} registry)"))
                 for r in runs]  # fmt: skip
        ratios = [f"{f['median_s'] / e['median_s'] * 100 - 100:+.0f} %" if f and e and f["median_s"] and e["median_s"]
                  else "" for f, e in start]  # fmt: skip
        lines.append(" | ".join([f"daemon start, full vs {base}", *ratios, "<= +10 %"]))
    return "\n".join("| " + ln + " |" for ln in lines)


def _cell(res: dict[str, Any]) -> str:
    if res.get("median_s") is None:
        return f"> {res['timed_out_after_s']:.0f} s" if "timed_out_after_s" in res else "error"
    s = res["median_s"]
    return f"{s * 1000:.1f} ms" if s < 10 else f"{s:.1f} s"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"])
    p.add_argument("--pg-server", default="postgresql+psycopg://postgres@127.0.0.1:5432")
    p.add_argument("--workdir", default=".bench-out/registry")
    p.add_argument("--reuse", action="store_true", help="use a database a --keep run left (no fill)")
    p.add_argument("--keep", action="store_true", help="leave the filled databases for --reuse")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=60.0, help="a run taking longer is killed and shown as '> T s'")
    p.add_argument("--start-only", action="store_true", help="only daemon start, full against empty")
    p.add_argument("--start-repeat", type=int, default=0, help="daemon starts of each kind (default --repeat)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)

    doc: dict[str, Any] = {"command": " ".join(["python -m bench.registry_scale", *sys.argv[1:]]),
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                           "runs": []}  # fmt: skip
    for n in args.versions:
        for backend in args.backends:
            doc["runs"].append(measure(backend, n, args, log))
            if args.out:  # after each database: a long run that dies keeps what it measured
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(doc, indent=2))
    print()
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
