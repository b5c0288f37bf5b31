"""/health and admin latency of the reference worker while hostile serving load hits it (issue 10).

    python -m bench.admin_latency [--device cpu|cuda:0] [--concurrent 200] [--idle-s 2]
                                  [--out .bench-out/admin_latency.json]

For each layout, a real worker process on a tiny model:
  uds: `--admin-uds` (what the daemon's managed workers run): /health and /weight_info polled on
       the private socket, served by their own thread and event loop; /health on TCP too.
  tcp: admin on the serving port (external workers): /health and /weight_info polled on TCP.
  daemon: `hotswap daemon` on the embedded default's shape (SQLite, a watched folder, one managed
       worker): the load goes to the managed worker's serving port, the daemon's own /health and
       /status are polled on its control API (what an orchestrator's probe and an operator see).
The load (tests/support_hostile.py, its own process): a 100 MB body with Content-Length, a 100 MB
chunked body, a 10 MB text prompt and N concurrent completions, all at once. The poller sends
one request after another (20 ms apart) during 2 s idle, then for the whole load. Prints a table
(p50 / p99 / max in ms) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import machine_description, print_table, write_json

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-admin-latency-token"


def start_worker(model: Path, token: Path, device: str, admin_uds: Path | None) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "daemon.worker.server", "--model", str(model), "--port", "0", "--device", device,
           "--token-file", str(token), "--max-body-bytes", str(16 << 20), "--log-level", "warning"]  # fmt: skip
    if admin_uds is not None:
        cmd += ["--admin-uds", str(admin_uds)]
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # keep carried wheels
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(REPO))
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    seen: list[str] = []
    for line in proc.stdout:
        if line.startswith("hotswap worker ready:"):
            threading.Thread(target=_drain, args=(proc,), daemon=True).start()
            return proc, line.split("url=", 1)[1].split()[0]
        seen = (seen + [line.rstrip()])[-30:]
        if time.monotonic() > deadline:
            break
    proc.kill()
    tail = "\n".join(seen)
    raise RuntimeError(f"worker did not start (rc {proc.wait()}): {' '.join(cmd)}\n{tail}")


def _drain(proc: subprocess.Popen[str]) -> None:
    for _ in proc.stdout or ():
        pass


def client(where: str) -> httpx.Client:
    if where.startswith("unix:"):
        return httpx.Client(transport=httpx.HTTPTransport(uds=where[5:]), base_url="http://w", timeout=30)
    return httpx.Client(base_url=where, timeout=30)


def poll(targets: dict[str, tuple[str, str, bool]], stop: threading.Event, out: dict[str, list[float]],
         errors: list[str]) -> None:  # fmt: skip
    clients = {name: client(where) for name, (where, _, _) in targets.items()}
    try:
        while not stop.is_set():
            for name, (_, path, auth) in targets.items():
                headers = {"Authorization": f"Bearer {TOKEN}"} if auth else None
                t0 = time.perf_counter()
                try:
                    r = clients[name].get(path, headers=headers)
                    if r.status_code != 200:
                        errors.append(f"{name}: HTTP {r.status_code}")
                except httpx.HTTPError as exc:
                    errors.append(f"{name}: {type(exc).__name__}")
                out[name].append((time.perf_counter() - t0) * 1000)
            time.sleep(0.02)
    finally:
        for c in clients.values():
            c.close()


def stats(xs: list[float]) -> dict[str, Any]:
    s = sorted(xs)
    if not s:
        return {"n": 0}
    return {"n": len(s), "p50_ms": round(s[len(s) // 2], 2), "p99_ms": round(s[min(len(s) - 1, int(len(s) * 0.99))], 2),
            "max_ms": round(s[-1], 2)}  # fmt: skip


def start_daemon(root: Path, device: str) -> tuple[subprocess.Popen[str], str, str]:
    """A daemon with one managed worker; returns it, its control API URL and the worker's URL."""
    state, watch = root / "state", root / "checkpoints"
    watch.mkdir(parents=True)
    (root / "config.toml").write_text(f"""
[daemon]
state_dir = "{state}"
listen = "127.0.0.1:0"
keep_workers_on_stop = false
[database]
url = "sqlite:///{state / 'hotswap.db'}"
[[sources]]
path = "{watch}"
[[workers]]
name = "local"
launch = "managed"
device = "{device}"
""")
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # keep carried wheels
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    log = (root / "daemon.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli.main", "daemon", "-c", str(root / "config.toml")],
                            stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(root))  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited {proc.returncode}; see {root / 'daemon.log'}")
        try:
            api = json.loads((state / "daemon.json").read_text())["api_url"]
            doc = httpx.get(f"{api}/status", timeout=5).json()
            worker = next((w for w in doc.get("workers", []) if w.get("state") == "RUNNING"), None)
            if worker is not None and worker.get("url"):
                return proc, api, str(worker["url"])
        except (OSError, ValueError, KeyError, httpx.HTTPError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the daemon's managed worker was not RUNNING within 300 s; see {root / 'daemon.log'}")


def stop(proc: subprocess.Popen[str], wait_s: float) -> None:
    proc.terminate()
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def measure(layout: str, model: Path, token: Path, device: str, concurrent: int, idle_s: float) -> dict[str, Any]:
    sock = None
    if layout == "daemon":
        root = Path(tempfile.mkdtemp(prefix="hs-bench-daemon-", dir="/tmp"))
        proc, api, url = start_daemon(root, device)
        targets = {"daemon /health": (api, "/health", False), "daemon /status": (api, "/status", False)}
        try:
            return {"layout": layout, "phases": run_phases(targets, url, concurrent, idle_s)}
        finally:
            stop(proc, 30)
    if layout == "uds":
        d = Path(tempfile.mkdtemp(prefix="hs-bench-", dir="/tmp"))  # 0700
        sock = d / "admin.sock"
    proc, url = start_worker(model, token, device, sock)
    try:
        if sock is not None:
            targets = {"health (uds)": (f"unix:{sock}", "/health", False),
                       "weight_info (uds)": (f"unix:{sock}", "/weight_info", True),
                       "health (tcp)": (url, "/health", False)}  # fmt: skip
        else:
            targets = {"health (tcp)": (url, "/health", False), "weight_info (tcp)": (url, "/weight_info", True)}
        return {"layout": layout, "phases": run_phases(targets, url, concurrent, idle_s)}
    finally:
        stop(proc, 20)
        if sock is not None:
            sock.unlink(missing_ok=True)
            sock.parent.rmdir()


def run_phases(targets: dict[str, tuple[str, str, bool]], url: str, concurrent: int, idle_s: float) -> dict[str, Any]:
    """Poll `targets` while idle, then while the hostile load hits the serving `url`."""
    phases: dict[str, Any] = {}
    for phase in ("idle", "load"):
        out: dict[str, list[float]] = {k: [] for k in targets}
        errors: list[str] = []
        stop = threading.Event()
        t = threading.Thread(target=poll, args=(targets, stop, out, errors))
        t.start()
        load_result = None
        if phase == "idle":
            time.sleep(idle_s)
        else:
            load = subprocess.run([sys.executable, str(REPO / "tests" / "support_hostile.py"), url, str(concurrent)],
                                  capture_output=True, text=True, timeout=600)  # fmt: skip
            load_result = json.loads(load.stdout.strip().splitlines()[-1]) if load.returncode == 0 else load.stderr[-500:]
        stop.set()
        t.join(60)
        phases[phase] = {"latency": {k: stats(v) for k, v in out.items()}, "errors": errors[:20],
                         "n_errors": len(errors), "load": load_result}  # fmt: skip
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrent", type=int, default=200)
    ap.add_argument("--idle-s", type=float, default=2.0)
    ap.add_argument("--layouts", default="uds,tcp,daemon")
    ap.add_argument("--out", default=str(REPO / ".bench-out" / "admin_latency.json"))
    args = ap.parse_args()
    from daemon.tinymodel import make_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="hs-admin-lat-") as t:
        tmp = Path(t)
        make_tiny_checkpoint(tmp / "m", seed=6, tokenizer=True)
        token = tmp / "token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
        results = [measure(layout, tmp / "m", token, args.device, args.concurrent, args.idle_s)
                   for layout in args.layouts.split(",")]  # fmt: skip
    rows = []
    for r in results:
        for phase, p in r["phases"].items():
            for name, s in p["latency"].items():
                rows.append([r["layout"], phase, name, s.get("n"), s.get("p50_ms"), s.get("p99_ms"), s.get("max_ms"),
                             p["n_errors"]])  # fmt: skip
    print_table(f"/health and admin under hostile load ({args.concurrent} concurrent, device {args.device})",
                ["worker", "phase", "route", "n", "p50 ms", "p99 ms", "max ms", "errors"], rows)  # fmt: skip
    for r in results:
        print(f"{r['layout']}: load results {r['phases']['load']['load']}")
    write_json(args.out, {"machine": machine_description(), "device": args.device, "concurrent": args.concurrent,
                          "results": results})  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
