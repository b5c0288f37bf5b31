"""Detection latency of a local commit and the daemon's idle CPU (goals in docs/reference/performance.md: <= 200 ms, < 1 %).

Starts the real daemon (`python -m daemon.cli daemon`) on a fresh SQLite registry in a temp dir,
then N times: put a tiny checkpoint into the watched folder, wait, write its manifest with
`daemon.manifest.publish` and time manifest-rename -> the `discovered` event row is in the
database (wall clock, one machine). Each checkpoint is verified (all checks) before the next.
Then the daemon sits idle and its CPU time is sampled with psutil.

    .venv/bin/python -m bench.detect [--n 20] [--idle-s 30] [--out .bench-out/detect.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table
from sqlalchemy import create_engine, text

REPO = Path(__file__).resolve().parents[1]


def wait_for(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.005)
    raise TimeoutError(what)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="checkpoints to publish")
    ap.add_argument("--idle-s", type=float, default=30.0, help="idle CPU sampling window")
    ap.add_argument("--out", default=str(REPO / ".bench-out" / "detect.json"))
    args = ap.parse_args(argv)

    from daemon.manifest import publish
    from daemon.tinymodel import make_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="hotswap-bench-detect-"))
    watch, state = work / "checkpoints", work / "state"
    db = state / "hotswap.db"
    cfg = work / "config.toml"
    cfg.write_text(
        f'[daemon]\nstate_dir = "{state}"\nlisten = "127.0.0.1:0"\nlog_level = "info"\n'
        f'[[sources]]\npath = "{watch}"\n'
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HOTSWAP_CONFIG", None)
    log = open(work / "daemon.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli.main", "daemon", "-c", str(cfg)],
        cwd=work,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: (state / "daemon.json").exists(), 60, "daemon start")
        engine = create_engine(f"sqlite:///{db}")

        def discovered_at(version: str) -> datetime | None:
            with engine.connect() as c:
                row = c.execute(
                    text(
                        "SELECT e.at FROM events e JOIN checkpoints k ON k.id = e.checkpoint_id "
                        "WHERE k.version = :v AND e.to_state = 'discovered'"
                    ),
                    {"v": version},
                ).first()
            return datetime.fromisoformat(row[0]).replace(tzinfo=UTC) if row else None

        def status(version: str) -> str | None:
            with engine.connect() as c:
                row = c.execute(
                    text("SELECT status FROM checkpoints WHERE version = :v"), {"v": version}
                ).first()
            return row[0] if row and row[0] not in ("discovered", "verifying") else None

        latencies_ms: list[float] = []
        verify_s: list[float] = []
        for i in range(args.n):
            d = watch / f"step-{i}"
            make_tiny_checkpoint(d, seed=i)
            time.sleep(0.3)  # the files are old news; only the manifest commits
            publish(d, version=f"step-{i}")
            written = datetime.now(UTC)  # publish returns right after the rename (+ directory fsync)
            t0 = time.monotonic()
            at = wait_for(functools.partial(discovered_at, f"step-{i}"), 10, f"step-{i} discovered")
            latencies_ms.append((at - written).total_seconds() * 1000.0)
            st = wait_for(functools.partial(status, f"step-{i}"), 60, f"step-{i} verified")
            verify_s.append(time.monotonic() - t0)
            assert st == "verified", f"step-{i} is {st}"

        p = psutil.Process(proc.pid)
        time.sleep(2.0)  # let the last verification's threads settle
        c0, w0 = sum(p.cpu_times()[:2]), time.monotonic()
        time.sleep(args.idle_s)
        c1, w1 = sum(p.cpu_times()[:2]), time.monotonic()
        idle_pct = 100.0 * (c1 - c0) / (w1 - w0)
        rss_mb = p.memory_info().rss / 1e6
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()

    lat = sorted(latencies_ms)
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {psutil.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, Python {platform.python_version()}",
        "command": "python -m bench.detect " + " ".join(argv if argv is not None else sys.argv[1:]),
        "n": args.n,
        "detect_ms": {
            "min": lat[0],
            "median": statistics.median(lat),
            "p90": lat[int(0.9 * (len(lat) - 1))],
            "max": lat[-1],
            "all": latencies_ms,
        },
        "manifest_to_verified_s": {"median": statistics.median(verify_s), "max": max(verify_s)},
        "idle_cpu_percent": idle_pct,
        "idle_window_s": args.idle_s,
        "daemon_rss_mb": rss_mb,
    }
    t = Table(title=f"local commit detection, {args.n} checkpoints (goal: <= 200 ms; idle CPU < 1 %)")
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("manifest written -> discovered, median", f"{result['detect_ms']['median']:.1f} ms")
    t.add_row("  p90 / max", f"{result['detect_ms']['p90']:.1f} / {result['detect_ms']['max']:.1f} ms")
    t.add_row(
        "manifest written -> verified (all checks), median",
        f"{result['manifest_to_verified_s']['median'] * 1000:.0f} ms",
    )
    t.add_row(f"daemon idle CPU over {args.idle_s:.0f} s", f"{idle_pct:.2f} %")
    t.add_row("daemon RSS", f"{rss_mb:.0f} MB")
    Console().print(t)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
