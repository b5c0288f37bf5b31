"""The operator's first minute (issue 36): `hotswap --version`, `status` and `history` wall time,
and how long `hotswap daemon` takes to stop on SIGTERM (the same handler as Ctrl-C).

Starts real daemons (`python -m daemon.cli daemon`) on fresh SQLite registries in a temp dir:

- verify-only: each CLI command N times against it (running, API answering); wall clock of the
  whole process, as a shell would see it;
- SIGTERM during the warm-up (the forward check's `import torch`, right after daemon.json
  appears) and after it: signal -> process gone;
- one managed reference worker (the quickstart's), `keep_workers_on_stop = false` (the worker is
  stopped too) and the default (it is kept for the next daemon): signal -> daemon gone.

    .venv/bin/python -m bench.cli_stop [--n 7] [--out bench/results/cli_stop-2core.json]

`status_daemon_down` is `hotswap status` once the daemon stopped (exit 3; it reads the registry).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

CLI = [sys.executable, "-m", "daemon.cli"]


def _config(root: Path, managed: bool, keep: bool = True) -> Path:
    (root / "ckpts").mkdir(parents=True, exist_ok=True)
    text = (f'[daemon]\nstate_dir = "{root / "state"}"\nlisten = "127.0.0.1:0"\n'
            f"keep_workers_on_stop = {'true' if keep else 'false'}\n"
            f'[[sources]]\npath = "{root / "ckpts"}"\n')  # fmt: skip
    if managed:
        text += '[[workers]]\nname = "local"\nlaunch = "managed"\ndevice = "cpu"\n'
    path = root / "config.toml"
    path.write_text(text)
    return path


def _start(root: Path, cfg: Path) -> subprocess.Popen[bytes]:
    runtime = root / "state" / "daemon.json"
    runtime.unlink(missing_ok=True)
    log = open(root / "daemon.log", "ab")  # noqa: SIM115 - the child keeps it
    p = subprocess.Popen([*CLI, "daemon", "-c", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not runtime.is_file():
        if time.monotonic() > deadline or p.poll() is not None:
            raise RuntimeError(f"the daemon did not start: {(root / 'daemon.log').read_text()[-2000:]}")
        time.sleep(0.02)
    return p


def _stop_s(p: subprocess.Popen[bytes]) -> float:
    t0 = time.perf_counter()
    p.send_signal(signal.SIGTERM)
    p.wait(120)
    return time.perf_counter() - t0


def _wait_healthy(root: Path, timeout: float = 240) -> None:
    url = json.loads((root / "state" / "daemon.json").read_text())["api_url"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("no worker became ready")


def _cli_s(argv: list[str], n: int) -> dict[str, Any]:
    """Wall clock of the whole process (as a shell sees it) and its CPU time (user + system, from
    wait4: on an idle machine the wall time; on this shared one the part that is the command's)."""
    times, cpu = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        p = subprocess.Popen([*CLI, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, _, usage = os.wait4(p.pid, 0)
        times.append(time.perf_counter() - t0)
        cpu.append(usage.ru_utime + usage.ru_stime)
    return {"median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3),
            "max_s": round(max(times), 3), "cpu_median_s": round(statistics.median(cpu), 3),
            "cpu_max_s": round(max(cpu), 3), "runs": n, "load_1min": round(os.getloadavg()[0], 2)}  # fmt: skip


def _publish(root: Path, count: int) -> None:
    """`count` tiny checkpoints into the watched folder, so `history` has rows to print."""
    from daemon.manifest import publish
    from daemon.tinymodel import make_tiny_checkpoint

    for i in range(count):
        stage = root / "stage" / f"bench-{i}"
        make_tiny_checkpoint(stage, seed=i)
        publish(stage, version=f"bench-{i}")
        stage.rename(root / "ckpts" / f"bench-{i}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=7)
    ap.add_argument("--out", default="bench/results/cli_stop-2core.json")
    ap.add_argument("--cli-only", action="store_true", help="the CLI timings only (no stop measurements)")
    args = ap.parse_args()
    out: dict[str, Any] = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
                           "cpus": os.cpu_count(), "load_before": os.getloadavg()[0]}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="hotswap-cli-stop-") as tmp:
        root = Path(tmp)
        cfg = _config(root / "verify", managed=False)
        if not args.cli_only:
            p = _start(root / "verify", cfg)
            out["stop_during_warmup_s"] = [round(_stop_s(p), 3)]
            for _ in range(2):
                p = _start(root / "verify", cfg)
                out["stop_during_warmup_s"].append(round(_stop_s(p), 3))
        p = _start(root / "verify", cfg)
        _publish(root / "verify", 5)
        time.sleep(30)  # the warm-up done, the 5 versions verified
        c = ["-c", str(cfg)]
        out["cli"] = {"--version": _cli_s(["--version"], args.n), "status": _cli_s(["status", *c], args.n),
                      "history": _cli_s(["history", *c], args.n)}  # fmt: skip
        out["stop_after_warmup_s"] = round(_stop_s(p), 3)
        out["cli"]["status_daemon_down"] = _cli_s(["status", *c], args.n)  # exit 3: read from the registry
        for keep in (False, True) if not args.cli_only else ():
            name = "kept" if keep else "stopped"
            cfg = _config(root / f"managed-{name}", managed=True, keep=keep)
            times = []
            for _ in range(3 if not keep else 1):
                p = _start(root / f"managed-{name}", cfg)
                _wait_healthy(root / f"managed-{name}")
                times.append(round(_stop_s(p), 3))
            out[f"stop_managed_worker_{name}_s"] = times
        for pidfile in root.glob("managed-kept/state/worker-*.json"):  # the kept worker: ours to end
            if not pidfile.name.endswith(".expect.json"):
                with contextlib.suppress(OSError, ValueError, KeyError):
                    os.kill(int(json.loads(pidfile.read_text())["pid"]), signal.SIGKILL)
    out["load_after"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
