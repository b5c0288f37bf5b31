"""One-worker outages: a real `hotswap daemon` with one managed reference worker in the default
group (the embedded default's shape), under steady client load (daemon/loadgen.py), /health polled
every 50 ms. Three cases, each in a fresh daemon:

    beside      a restart rollout (vocabulary 256 -> 320) with room for a second worker
    stop_first  the same with `[rollout] restart_overlap = "off"`
    kill        `kill -9` of the healthy worker, `--kills` times (relaunch_reset_s 1 s, so each is a
                crash of a healthy worker, not a crash loop)

Per case: requests sent / failed (a kill -9 loses the requests in flight on that process), the longest stretch with no request answered, and how long
/health said 200 inside that stretch. For kills also what the stretch is made of: kill -> new
process started (detection + relaunch decision), new process -> first answer (the worker's start-up).

    .venv/bin/python -m bench.one_worker --out bench/results/one_worker-2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.loadgen import LoadGen


class Health(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop = url + "/health", threading.Event()
        self.samples: list[tuple[float, int]] = []

    def run(self) -> None:
        with httpx.Client(timeout=5) as c:
            while not self.stop.is_set():
                try:
                    self.samples.append((time.time(), c.get(self.url).status_code))
                except httpx.HTTPError:
                    self.samples.append((time.time(), -1))
                time.sleep(0.05)

    def ok_within(self, a: float, b: float) -> float:
        """Seconds /health said 200 inside [a, b] (between consecutive samples)."""
        inside = [(t, c) for t, c in self.samples if a <= t <= b]
        return float(sum(t2 - t1 for (t1, c1), (t2, _) in zip(inside, inside[1:], strict=False) if c1 == 200))


def silence(load: LoadGen, a: float, b: float) -> tuple[float, float, float]:
    """(seconds, start, end) of the longest stretch of [a, b] with no request answered."""
    times = [a, *sorted(t for _, t, _ in load.stats.answered if a <= t <= b), b]
    gap, start = max((t2 - t1, t1) for t1, t2 in zip(times, times[1:], strict=False))
    return gap, start, start + gap


class Daemon:
    def __init__(self, work: Path, rollout: dict[str, Any]) -> None:
        self.work, self.state, self.watch = work, work / "state", work / "checkpoints"
        self.watch.mkdir(parents=True)
        rows = "\n".join(f"{k} = {json.dumps(v)}" for k, v in rollout.items())
        cfg = work / "config.toml"
        cfg.write_text(f"""[daemon]\nstate_dir = "{self.state}"\nlisten = "127.0.0.1:0"\nkeep_workers_on_stop = false
[database]\nurl = "sqlite:///{work / 'r.db'}"\n[[sources]]\npath = "{self.watch}"\nrescan_interval_s = 1.0
quiet_period_s = 0.3\n[checks]\nenabled = ["manifest", "headers", "crc32c", "compat", "finite"]
[rollout]\nhealth_window_s = 0.5\nhealth_poll_s = 0.5\nrestart_timeout_s = 120.0\n{rows}
[[workers]]\nname = "local"\nlaunch = "managed"\ndevice = "cpu"\n""")
        with open(work / "daemon.log", "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "daemon.cli.main", "daemon", "-c", str(cfg)],
                                         stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        self.api = self._wait(lambda: json.loads((self.state / "daemon.json").read_text())["api_url"])
        self.url = "http://127.0.0.1:" + str(self._wait(lambda: self.runtime()["port"]))
        self._wait(lambda: httpx.get(self.url + "/ready", timeout=5).status_code == 200 or None)
        self._wait(lambda: httpx.get(self.api + "/health", timeout=5).status_code == 200 or None)

    def runtime(self) -> dict[str, Any]:
        return dict(json.loads((self.state / "worker-local.json").read_text()))

    def status(self, version: str) -> str | None:
        out = subprocess.run([sys.executable, "-m", "daemon.cli.main", "history", "--json", "-c",
                              str(self.work / "config.toml")], capture_output=True, text=True).stdout  # fmt: skip
        rows = {r["version"]: r["status"] for r in map(json.loads, out.splitlines()) if r.get("version")}
        return rows.get(version)

    @staticmethod
    def _wait(fn: Any, timeout: float = 180) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                v = fn()
                if v:
                    return v
            except (OSError, ValueError, KeyError, httpx.HTTPError):
                pass
            time.sleep(0.05)
        raise TimeoutError("the daemon or its worker did not come up")

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def restart_rollout(work: Path, overlap: str) -> dict[str, Any]:
    from daemon.manifest import publish
    from daemon.tinymodel import make_tiny_checkpoint

    d = Daemon(work, {"restart_overlap": overlap})
    old_pid = d.runtime()["pid"]
    try:
        load, health = LoadGen([d.url], concurrency=2, max_seconds=600, request_timeout_s=120.0), Health(d.api)
        with load:
            health.start()
            load.wait_requests(20, timeout=60)
            t0 = time.time()
            tmp = d.watch / ".build"
            make_tiny_checkpoint(tmp, seed=5, config_overrides={"vocab_size": 320})
            publish(tmp, version="vocab-320")
            os.replace(tmp, d.watch / "vocab-320")
            d._wait(lambda: d.status("vocab-320") in ("deployed", "rejected") or None, 300)
            load.wait_requests(20, timeout=60)
            t1 = time.time()
            health.stop.set()
        gap, a, b = silence(load, t0, t1)
        born = psutil.Process(d.runtime()["pid"]).create_time()
        return {"old_pid": old_pid, "new_process_started_at_s": round(born - t0, 3), "no_answer_from_s": round(a - t0, 3),
                "latency_max_ms": load.snapshot()["latency_max_ms"],
                "case": f"restart rollout, restart_overlap = {overlap!r}", "status": d.status("vocab-320"),
                "sent": load.stats.sent, "failed": load.stats.failed, "errors": load.stats.errors[:5],
                "versions": dict(load.stats.versions), "longest_no_answer_s": round(gap, 3),
                "health_ok_in_it_s": round(health.ok_within(a, b), 3),
                "health_non_200_samples": sum(c != 200 for t, c in health.samples if t0 <= t <= t1)}  # fmt: skip
    finally:
        d.close()


def kills(work: Path, n: int) -> dict[str, Any]:
    d = Daemon(work, {"relaunch_reset_s": 1.0})
    runs: list[dict[str, Any]] = []
    try:
        load, health = LoadGen([d.url], concurrency=2, max_seconds=900, request_timeout_s=120.0), Health(d.api)
        with load:
            health.start()
            for _ in range(n):
                load.wait_requests(20, timeout=60)
                time.sleep(1.5)  # healthy for more than relaunch_reset_s
                old = d.runtime()["pid"]
                killed = time.time()
                os.kill(old, signal.SIGKILL)
                new = d._wait(lambda old=old: (p := d.runtime()["pid"]) != old and p, 120)
                born = psutil.Process(new).create_time()
                d._wait(lambda: httpx.get(d.url + "/ready", timeout=5).status_code == 200 or None, 120)
                load.wait_requests(10, timeout=60)
                gap, a, b = silence(load, killed - 1, time.time())  # requests in flight on the killed process fail
                first = min((t for _, t, _ in load.stats.answered if t > killed + 0.01), default=None)
                runs.append({"no_answer_s": round(gap, 3), "kill_to_new_process_s": round(born - killed, 3),
                             "new_process_to_first_answer_s": round((first or b) - born, 3),
                             "health_ok_in_it_s": round(health.ok_within(a, b), 3)})  # fmt: skip
            health.stop.set()
        return {"case": "kill -9 of the worker", "sent": load.stats.sent, "failed": load.stats.failed,
                "errors": load.stats.errors[:5], "runs": runs}  # fmt: skip
    finally:
        d.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--kills", type=int, default=5)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="one-worker-") as tmp:
        results.append(restart_rollout(Path(tmp) / "beside", "auto"))
        print(json.dumps(results[-1]), flush=True)
        results.append(restart_rollout(Path(tmp) / "stop-first", "off"))
        print(json.dumps(results[-1]), flush=True)
        results.append(kills(Path(tmp) / "kill", args.kills))
        print(json.dumps(results[-1]), flush=True)
    doc = {"bench": "one_worker", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()}, "results": results}  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
