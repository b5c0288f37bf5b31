"""Manifest written -> every worker serving it, on the CPU with two tiny workers (goal in docs/reference/performance.md: <= 3 s warm).

Starts two real `hotswap worker` processes (CPU, tiny Llama) and the real daemon
(`python -m daemon.cli daemon`, SQLite, all seven checks, disk transport), then per sample:
writes a tiny checkpoint's files into the watched folder, waits, writes its manifest with
`daemon.manifest.publish` (the commit) and polls both workers' /weight_info every 2 ms until
both serve the new version (RUNNING on it). The first rollouts are warm-up (imports, first forward check);
the breakdown comes from the registry's timestamps (discovered, verified, deployed).

    .venv/bin/python -m bench.rollout_latency [--n 10] [--warmup 2] [--modes drain,pause]
                                              [--out .bench-out/rollout_latency.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import print_table, write_json

REPO = Path(__file__).resolve().parents[1]
ENV = {**{k: v for k, v in os.environ.items() if k != "HOTSWAP_CONFIG"}, "PYTHONPATH": str(REPO)}


def wait_for(fn: Any, timeout: float, what: str, interval: float = 0.002) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = fn()
        except httpx.HTTPError:
            v = None
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_worker(work: Path, name: str, model: Path, token_file: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli.main", "worker", "--model", str(model), "--port", str(port),
         "--token-file", str(token_file), "--device", "cpu", "--version", model.name],
        stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=REPO,
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def run_mode(mode: str, n: int, warmup: int, work: Path, seed0: int) -> dict[str, Any]:
    from sqlalchemy import create_engine, text

    from daemon.manifest import publish
    from daemon.tinymodel import make_tiny_checkpoint

    watch, state = work / "checkpoints", work / "state"
    watch.mkdir(parents=True)
    token_file = work / "worker.token"
    token_file.write_text(secrets.token_hex(16))
    token_file.chmod(0o600)
    v0 = watch / "v0"
    make_tiny_checkpoint(v0, seed=seed0)
    publish(v0, version="v0")
    procs = [start_worker(work, f"w{i}", v0, token_file) for i in range(2)]
    headers = {"Authorization": f"Bearer {token_file.read_text()}"}
    client = httpx.Client(headers=headers, timeout=5)

    def versions() -> list[str | None]:
        """Each worker's version while it serves (RUNNING); None while it is in the middle of an update."""
        infos = [client.get(f"{url}/weight_info").json() for _, url in procs]
        return [i.get("version") if i.get("state") == "RUNNING" else None for i in infos]

    workers = "".join(
        f'[[workers]]\nname = "w{i}"\nurl = "{url}"\ntoken_file = "{token_file}"\ndevice = "cpu"\n'
        for i, (_, url) in enumerate(procs)
    )
    cfg = work / "config.toml"
    cfg.write_text(
        f'[daemon]\nstate_dir = "{state}"\nlisten = "127.0.0.1:0"\nlog_level = "info"\n'
        f'[[sources]]\npath = "{watch}"\n[rollout]\nmode = "{mode}"\nhealth_window_s = 1.0\n{workers}'
    )
    log = open(work / "daemon.log", "wb")  # noqa: SIM115
    daemon = subprocess.Popen([sys.executable, "-m", "daemon.cli.main", "daemon", "-c", str(cfg)],
                              cwd=work, env=ENV, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    samples: list[dict[str, float]] = []
    try:
        wait_for(lambda: all(v == "v0" for v in versions()), 180, "workers up", 0.1)
        runtime = wait_for(lambda: json.loads((state / "daemon.json").read_text()) if (state / "daemon.json").exists() else None, 60, "daemon up", 0.05)
        api = runtime["api_url"]
        engine = create_engine(f"sqlite:///{state / 'hotswap.db'}")

        def idle() -> bool:
            st = httpx.get(f"{api}/v1/rollout", timeout=5).json()
            return st["ready"] and st["current"] is None and st["pending"] is None and st["last_good"] == st["serving"]

        def stamps(version: str) -> dict[str, datetime]:
            with engine.connect() as c:
                rows = c.execute(text(
                    "SELECT e.to_state, e.at FROM events e JOIN checkpoints k ON k.id = e.checkpoint_id "
                    "WHERE k.version = :v AND e.worker IS NULL"), {"v": version}).all()  # fmt: skip
            return {s: (a if isinstance(a, datetime) else datetime.fromisoformat(a)).replace(tzinfo=UTC) for s, a in rows}

        wait_for(lambda: idle() and stamps("v0").get("deployed"), 120, "v0 deployed", 0.05)
        for i in range(1, warmup + n + 1):
            version = f"{mode}-{i}"
            d = watch / version
            make_tiny_checkpoint(d, seed=seed0 + i)
            time.sleep(0.3)  # the files are old news; only the manifest commits
            publish(d, version=version)
            written, t0 = datetime.now(UTC), time.perf_counter()
            wait_for(lambda v=version: all(x == v for x in versions()), 120, f"{version} everywhere")
            total = time.perf_counter() - t0
            s = wait_for(lambda v=version: (st := stamps(v)).get("deployed") and st, 30, f"{version} recorded", 0.02)
            wait_for(idle, 60, "health window", 0.05)
            if i > warmup:
                samples.append({
                    "total_s": total,
                    "detect_s": (s["discovered"] - written).total_seconds(),
                    "verify_s": (s["verified"] - s["discovered"]).total_seconds(),
                    "rollout_s": (s["deployed"] - s["verified"]).total_seconds(),
                })  # fmt: skip
    finally:
        daemon.terminate()
        daemon.wait(30)
        for p, _ in procs:
            p.terminate()
            p.wait(30)
        client.close()
        log.close()

    def med(key: str) -> float:
        return statistics.median(s[key] for s in samples)

    totals = sorted(s["total_s"] for s in samples)
    return {
        "mode": mode,
        "n": len(samples),
        "total_s": {"median": med("total_s"), "p90": totals[int(0.9 * (len(totals) - 1))], "max": totals[-1],
                    "all": [s["total_s"] for s in samples]},  # fmt: skip
        "median_breakdown_s": {k: med(k) for k in ("detect_s", "verify_s", "rollout_s")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10, help="measured rollouts per mode")
    ap.add_argument("--warmup", type=int, default=2, help="rollouts before measuring")
    ap.add_argument("--modes", default="drain,pause")
    ap.add_argument("--out", default=str(REPO / ".bench-out" / "rollout_latency.json"))
    args = ap.parse_args(argv)

    results = []
    for k, mode in enumerate(args.modes.split(",")):
        with tempfile.TemporaryDirectory(prefix=f"hotswap-bench-rollout-{mode}-") as tmp:
            results.append(run_mode(mode, args.n, args.warmup, Path(tmp), seed0=100 * k))
    doc = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}",
        "command": "python -m bench.rollout_latency " + " ".join(argv if argv is not None else sys.argv[1:]),
        "goal_s": 3.0,
        "results": results,
    }
    print_table(
        "manifest written -> every worker serving it (2 tiny CPU workers, all checks; goal <= 3 s warm)",
        ["mode", "n", "median s", "p90 s", "max s", "detect s", "verify s", "roll out s"],
        [
            [r["mode"], r["n"], r["total_s"]["median"], r["total_s"]["p90"], r["total_s"]["max"],
             r["median_breakdown_s"]["detect_s"], r["median_breakdown_s"]["verify_s"],
             r["median_breakdown_s"]["rollout_s"]]
            for r in results
        ],
    )  # fmt: skip
    write_json(args.out, doc)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
