"""The reference worker's /health at 200 concurrent completions (issue 37: "stays under 100 ms").

    python -m bench.worker_health [--runs 3] [--concurrent 200] [--device cpu] [--out FILE]

Each run: a fresh worker as the daemon launches its managed ones (`--admin-uds`), a tiny model; a
load process sends N concurrent completions (16 tokens each, nothing hostile besides their number);
meanwhile /health is polled one request after another, 20 ms apart, on the serving port (what the
daemon's health poll probes as a client would, and an orchestrator's probe) and on the admin
socket. Prints a table and writes JSON with each run's latencies under load, the load average at
its start, and the medians over the runs (`summary`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from bench.admin_latency import REPO, TOKEN, poll, start_worker, stats, stop
from bench.common import machine_description, print_table, write_json

ROUTES = ("health (tcp)", "health (uds)")


async def _load(url: str, n: int) -> dict[str, int]:
    import httpx

    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as c:

        async def one(i: int) -> str:
            try:
                r = await c.post("/v1/completions", json={"prompt": f"request {i}", "max_tokens": 16,
                                                          "temperature": 0, "ignore_eos": True})  # fmt: skip
                return str(r.status_code)
            except httpx.TransportError as exc:
                return f"error:{type(exc).__name__}"

        return dict(Counter(await asyncio.gather(*(one(i) for i in range(n)))))


def one_run(model: Path, token: Path, device: str, concurrent: int) -> dict[str, Any]:
    sock_dir = Path(tempfile.mkdtemp(prefix="hs-bench-", dir="/tmp"))  # 0700
    sock = sock_dir / "admin.sock"
    load_avg = os.getloadavg()[0]
    proc, url = start_worker(model, token, device, sock)
    try:
        targets = {"health (tcp)": (url, "/health", False), "health (uds)": (f"unix:{sock}", "/health", False)}
        out: dict[str, list[float]] = {k: [] for k in targets}
        errors: list[str] = []
        done = threading.Event()
        t = threading.Thread(target=poll, args=(targets, done, out, errors))
        t.start()
        load = subprocess.run([sys.executable, "-m", "bench.worker_health", "--load", url, str(concurrent)],
                              capture_output=True, text=True, timeout=600, cwd=str(REPO))  # fmt: skip
        done.set()
        t.join(60)
        return {"load_average_1m": round(load_avg, 2), "latency": {k: stats(v) for k, v in out.items()},
                "n_errors": len(errors), "errors": errors[:20],
                "load": load.stdout.strip().splitlines()[-1] if load.returncode == 0 else load.stderr[-500:]}  # fmt: skip
    finally:
        stop(proc, 20)
        sock.unlink(missing_ok=True)
        sock_dir.rmdir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(REPO / ".bench-out" / "worker_health.json"))
    ap.add_argument("--load", nargs=2, metavar=("URL", "N"), help=argparse.SUPPRESS)  # the load process
    args = ap.parse_args()
    if args.load:
        print(asyncio.run(_load(args.load[0], int(args.load[1]))), flush=True)
        return
    from daemon.tinymodel import make_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="hs-worker-health-") as t:
        tmp = Path(t)
        make_tiny_checkpoint(tmp / "m", seed=6, tokenizer=True)
        token = tmp / "token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
        runs = [one_run(tmp / "m", token, args.device, args.concurrent) for _ in range(args.runs)]
    rows = [[i + 1, r["load_average_1m"], route, r["latency"][route].get("n"), r["latency"][route].get("p50_ms"),
             r["latency"][route].get("p99_ms"), r["latency"][route].get("max_ms"), r["n_errors"]]
            for i, r in enumerate(runs) for route in ROUTES]  # fmt: skip
    print_table(f"worker /health at {args.concurrent} concurrent completions (device {args.device})",
                ["run", "load avg", "route", "n", "p50 ms", "p99 ms", "max ms", "errors"], rows)  # fmt: skip
    summary = {route: {"median_max_ms": round(statistics.median(r["latency"][route]["max_ms"] for r in runs), 2),
                       "median_p99_ms": round(statistics.median(r["latency"][route]["p99_ms"] for r in runs), 2)}
               for route in ROUTES}  # fmt: skip
    print(f"medians over {len(runs)} runs: {summary}")
    write_json(args.out, {"machine": machine_description(), "device": args.device, "concurrent": args.concurrent,
                          "runs": runs, "summary": summary})  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
