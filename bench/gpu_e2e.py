"""The whole GPU path end to end: daemon + staging loader + two reference workers under load.

All real processes: the daemon (`python -m daemon.cli daemon -c <generated config>`, SQLite in a
temp state dir, one watched folder), the staging loader (`python -m daemon.cli loader`) when
transport = "ipc", and two reference workers (`python -m daemon.cli worker --device D`) listed
as external `[[workers]]`, behind a round-robin load generator (bench/loadgen.py). Then N
checkpoints in a row: shards written into `<watch>/.stage-V` (ignored by the source), manifest
written by `daemon.manifest.publish`, directory renamed into the watched folder (the commit).
Per version: commit -> `verified` (registry event), -> both workers RUNNING on it (polled
/weight_info), the verify stage per check (`checks` table), each worker's pause window
(`events`: PAUSED -> RUNNING, of which the update call and the worker's own update time)
and the requests that failed meanwhile.

    python -m bench.gpu_e2e --model 1b --device cuda:0 --transports ipc,disk --updates 20 --out DIR
    python -m bench.gpu_e2e --model tiny --device cpu --updates 3          # dry run anywhere

Versions are derived from one written base (bench/e2e_versions.py, `--versions derived`, the
default): every file is still read in full everywhere, but an 8B version costs ~3 s to make
instead of ~18 s. Per version the phases of commit -> fleet (bench/e2e_phases.py) are recorded
and tabled; with `--reject` (default corrupt,nan,incompatible) bad versions are committed under
load in the `--reject-in` transport's fleet and must be rejected before any worker pauses
(bench/e2e_reject.py records which check caught each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import LAYOUTS, Layout, machine_description, write_checkpoint, write_json
from bench.e2e_delta import commit_delta
from bench.e2e_flip import flip_back
from bench.e2e_health import HealthProbe
from bench.e2e_phases import phases
from bench.e2e_reject import reject_one
from bench.e2e_report import print_results, summarise
from bench.e2e_versions import derive
from bench.loadgen import LoadGen

REPO = Path(__file__).resolve().parents[1]
# ~1B parameters (0.88 B, 1.77 GB bf16): big enough for the transfer to matter, small enough for 20 updates
LLAMA_1B = Layout("1b", vocab=32000, hidden=2048, intermediate=5632, layers=16, heads=16, kv_heads=8)
MODELS: dict[str, Layout] = {**LAYOUTS, "1b": LLAMA_1B}
ALL_CHECKS = ["manifest", "headers", "crc32c", "compat", "finite", "headroom", "forward"]


def child_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {k: v for k, v in os.environ.items() if k != "HOTSWAP_CONFIG"}
    return {**env, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    fn: Any, timeout: float, what: str, interval: float = 0.05, procs: list[Proc] | None = None
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            v = fn()
        except (httpx.HTTPError, OSError, ValueError, KeyError, sqlite3.Error):
            v = None
        if v:
            return v
        for p in procs or []:
            if p.popen.poll() is not None:
                raise RuntimeError(
                    f"{p.name} exited with {p.popen.returncode} while waiting for {what}:\n{p.tail()}"
                )
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, name: str, args: list[str], log: Path, cwd: Path) -> Proc:
        with open(log, "wb") as out:
            popen = subprocess.Popen([sys.executable, "-m", "daemon.cli.main", *args], stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(), cwd=cwd)  # fmt: skip
        return cls(name, popen, log)

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


@dataclass
class Run:
    """One transport's fleet: watched folder, registry, processes."""

    args: argparse.Namespace
    transport: str
    work: Path
    layout: Layout
    procs: list[Proc] = field(default_factory=list)
    worker_urls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.watch, self.state = self.work / "checkpoints", self.work / "state"
        self.watch.mkdir(parents=True)
        self.token_file = self.work / "worker.token"
        self.token_file.write_text(secrets.token_hex(16))
        self.token_file.chmod(0o600)
        self.http = httpx.Client(
            headers={"Authorization": f"Bearer {self.token_file.read_text()}"}, timeout=10
        )

    # -- checkpoints ---------------------------------------------------------------------
    def commit(self, version: str, seed: int, prev: Path | None = None) -> tuple[datetime, float, dict[str, float]]:
        """Write shards + manifest outside the watched view, then rename in; returns the commit time.

        With `prev` (and `--versions derived`): derived from that directory (bench/e2e_versions.py)."""
        from daemon.manifest import publish

        stage = self.watch / f".stage-{version}"
        t = time.perf_counter()
        if prev is not None:
            derive(prev, stage, seed=seed, kind="good" if prev.parent == self.watch else "link", version=version)
            t_write, t_publish = time.perf_counter() - t, 0.0  # derive publishes too
        else:
            write_checkpoint(stage, self.layout, shards=self.args.shards, seed=seed, device=self.args.gen_device)
            t_write = time.perf_counter() - t
            publish(stage, version=version)
            t_publish = time.perf_counter() - t - t_write
        t = time.perf_counter()
        os.sync()  # as for delta versions (bench/e2e_delta.py): the writer's write-back is not the daemon's
        t_sync = time.perf_counter() - t
        os.rename(stage, self.watch / version)
        return datetime.now(UTC), time.perf_counter(), {"write_s": t_write, "publish_s": t_publish, "sync_s": t_sync}

    def prune(self, keep: list[str]) -> None:
        """Disk is finite: drop version directories no worker can need (not serving / last good)."""
        for d in self.watch.iterdir():
            if not d.name.startswith(".") and d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)

    # -- processes -----------------------------------------------------------------------
    def start(self) -> None:
        a = self.args
        if self.transport == "ipc":
            self.loader_socket = self.work / "loader.sock"
            dev = ["--device", a.device] if a.device != "cpu" else ["--device", "cpu", "--threads", "2"]
            self.procs.append(Proc.start("loader", ["loader", "--socket", str(self.loader_socket), *dev,
                                                    "--max-versions", "4"], self.work / "loader.log", REPO))  # fmt: skip
        for i in range(2):
            port = free_port()
            self.worker_urls.append(f"http://127.0.0.1:{port}")
            self.procs.append(Proc.start(f"w{i}", ["worker", "--model", str(self.watch / "v0"), "--port", str(port),
                                                   "--token-file", str(self.token_file), "--device", a.device,
                                                   "--version", "v0", *(["--stage-disk", a.stage_disk] if a.stage_disk else [])],
                                                  self.work / f"w{i}.log", REPO))  # fmt: skip
        wait_for(
            lambda: all(v == "v0" for v in self.versions()),
            a.start_timeout,
            "workers RUNNING on v0",
            0.2,
            self.procs,
        )
        if self.transport == "ipc":
            wait_for(self.loader_socket.exists, 60, "loader socket", 0.05, self.procs)
        self.write_config()
        self.procs.append(Proc.start("daemon", ["daemon", "-c", str(self.work / "config.toml")],
                                     self.work / "daemon.log", self.work))  # fmt: skip
        runtime = wait_for(
            lambda: json.loads((self.state / "daemon.json").read_text()), 120, "daemon up", 0.05, self.procs
        )
        self.api = runtime["api_url"]
        wait_for(
            lambda: self.stamps("v0").get("deployed") and self.idle(),
            a.start_timeout,
            "v0 deployed",
            0.1,
            self.procs,
        )

    def write_config(self) -> None:
        a = self.args
        checks = [c for c in ALL_CHECKS if c != "forward" or a.forward_device != "off"]
        lines = [
            "[daemon]", f'state_dir = "{self.state}"', 'listen = "127.0.0.1:0"', 'log_level = "info"',
            "[[sources]]", f'path = "{self.watch}"',
            "[checks]", f"enabled = {json.dumps(checks)}",
            f'forward_device = "{a.forward_device if a.forward_device != "off" else "cpu"}"',
            f'staging_gpu = "{a.device if a.device.startswith("cuda") else "cuda:0"}"',
            "[rollout]", f'transport = "{self.transport}"', f'update_mode = "{a.update_mode}"', 'mode = "pause"',
            f"health_window_s = {a.health_window}", f"max_unavailable = {a.max_unavailable}",
        ]  # fmt: skip
        if self.transport == "ipc":
            lines += ["[loader]", f'socket = "{self.loader_socket}"']
        for i, url in enumerate(self.worker_urls):
            lines += ["[[workers]]", f'name = "w{i}"', f'url = "{url}"', f'token_file = "{self.token_file}"',
                      f'device = "{a.device}"']  # fmt: skip
        (self.work / "config.toml").write_text("\n".join(lines) + "\n")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.http.close()

    # -- observation ---------------------------------------------------------------------
    def versions(self) -> list[str | None]:
        """Each worker's version while it serves (RUNNING), None while it is in an update."""
        infos = [self.http.get(f"{u}/weight_info").json() for u in self.worker_urls]
        return [i.get("version") if i.get("state") == "RUNNING" else None for i in infos]

    def idle(self) -> bool:
        st = self.http.get(f"{self.api}/v1/rollout").json()
        return bool(
            st["ready"]
            and st["current"] is None
            and st["pending"] is None
            and st["last_good"] == st["serving"]
        )

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.state / 'hotswap.db'}?mode=ro", uri=True, timeout=5)

    def stamps(self, version: str) -> dict[str, datetime]:
        with self.db() as c:
            rows = c.execute("SELECT e.to_state, e.at FROM events e JOIN checkpoints k ON k.id = e.checkpoint_id "
                             "WHERE k.version = ? AND e.worker IS NULL", (version,)).fetchall()  # fmt: skip
        return {s: datetime.fromisoformat(at).replace(tzinfo=UTC) for s, at in rows}

    def details(self, version: str) -> dict[str, Any]:
        """Per check durations, status, and each worker's pause window from the `events` table."""
        with self.db() as c:
            status, msg, cid = c.execute("SELECT status, status_message, id FROM checkpoints WHERE version = ?",
                                         (version,)).fetchone()  # fmt: skip
            checks, forward_parts = {}, {}
            for n, d, detail in c.execute("SELECT name, duration_ms, detail FROM checks WHERE checkpoint_id = ?", (cid,)):
                checks[n] = d
                if n == "forward" and detail:  # where the canary's time goes (issue 41), child and steps
                    doc = json.loads(detail) if isinstance(detail, str) else detail
                    forward_parts = {**(doc.get("ms") or {}), **{f"child_{k}": v for k, v in (doc.get("child_ms") or {}).items()}}
            rids = [
                r
                for (r,) in c.execute(
                    "SELECT id FROM rollouts WHERE checkpoint_id = ? AND \"trigger\" = 'new'", (cid,)
                )
            ]
            events = c.execute(
                f"SELECT worker, to_state, at, duration_ms, detail FROM events WHERE worker IS NOT NULL "
                f"AND rollout_id IN ({','.join('?' * len(rids))}) ORDER BY id", rids).fetchall() if rids else []  # fmt: skip
        workers: dict[str, dict[str, Any]] = {}
        for worker, to, at, dur, detail in events:
            w = workers.setdefault(worker, {"path": []})
            w["path"].append(to)
            when = datetime.fromisoformat(at)
            if to == "PAUSED":
                w["paused_at"], w["pause_call_ms"] = when, dur
            elif to == "UPDATED":
                w["update_call_ms"] = dur
                d = json.loads(detail) if detail else {}
                w["worker_update_ms"], w["transport"] = d.get("worker_ms"), d.get("transport")
                if d.get("pause_window_ms") is not None:  # the worker resumed itself: its own window
                    w["worker_pause_window_ms"] = d["pause_window_ms"]
            elif to == "RUNNING" and "paused_at" in w:
                w["post_check_ms"] = dur
                # the daemon's span: pause call start -> RUNNING recorded (after the post-check)
                w["daemon_span_ms"] = (when - w.pop("paused_at")).total_seconds() * 1000 + (w["pause_call_ms"] or 0)
                # the pause window: the worker's (pause asked -> scheduler running again) when it
                # resumed itself, else the daemon's span (the resume call is its last step)
                w["pause_window_ms"] = w.get("worker_pause_window_ms", w["daemon_span_ms"])
        for w in workers.values():
            w.pop("paused_at", None)
        return {"status": status, "status_message": msg, "checks_ms": checks, "forward_parts_ms": forward_parts,
                "workers": workers}  # fmt: skip


def run_transport(args: argparse.Namespace, transport: str, layout: Layout, base: Path | None) -> dict[str, Any]:
    root = Path(args.work_root) if args.work_root else None
    work = Path(tempfile.mkdtemp(prefix=f"hotswap-e2e-{transport}-", dir=root))
    run = Run(args, transport, work, layout)
    samples: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    skipped = ""
    rejections: list[dict[str, Any]] = []
    health: HealthProbe | None = None
    flip: dict[str, Any] = {}
    try:
        run.commit("v0", seed=args.seed, prev=base)
        run.start()
        print(f"[{transport}] fleet up in {time.perf_counter() - t_start:.1f}s", flush=True)
        with LoadGen(run.worker_urls, concurrency=args.clients, max_tokens=args.max_tokens, max_seconds=3600) as load, \
                HealthProbe(run.api) as health:
            load.wait_requests(5, 120)
            prev, prev2, last_full = "v0", "v0", "v0"
            full_prev = run.watch / "v0"  # the newest full version: the next delta's base
            trainer = work / "trainer"  # where a delta version's full files are made (not watched)
            n_full = args.warmup + args.updates
            n_delta = args.delta_updates if transport in args.delta_in.split(",") else 0
            for i in range(1, n_full + n_delta + 1):
                if time.perf_counter() - t_start > args.budget_s:
                    skipped = f"time budget reached after {i - 1} of {n_full + n_delta} versions"
                    break
                version = f"{transport}-{i:02d}" if i <= n_full else f"{transport}-d{i - n_full:02d}"
                before = load.snapshot()
                if i <= n_full:
                    derived_from = run.watch / prev if base is not None else None
                    written, t0, prep = run.commit(version, seed=args.seed + i, prev=derived_from)
                    full_prev = run.watch / version
                    last_full = version  # bad versions are derived from a full one in the watched folder
                else:
                    old_full = full_prev
                    written, t0, prep, full_prev = commit_delta(run.watch, trainer, full_prev, version,
                                                                args.seed + i, args.delta_density)  # fmt: skip
                    if old_full.parent == trainer:
                        shutil.rmtree(old_full, ignore_errors=True)
                fleet = wait_for(lambda v=version: all(x == v for x in run.versions()) and time.perf_counter(),
                                 args.update_timeout, f"{version} on every worker", 0.005, run.procs)  # fmt: skip
                wait_for(lambda v=version: run.stamps(v).get("deployed") and run.idle(), args.update_timeout,
                         f"{version} deployed + health window", 0.05, run.procs)  # fmt: skip
                st, det = run.stamps(version), run.details(version)
                with run.db() as c:
                    det["phases_ms"] = phases(c, version, written, fleet - t0)
                after = load.snapshot()
                sample = {
                    "version": version, "warmup": i <= args.warmup, **prep,
                    "commit_to_verified_s": (st["verified"] - written).total_seconds(),
                    "commit_to_discovered_s": (st["discovered"] - written).total_seconds(),
                    "verified_to_fleet_s": (fleet - t0) - (st["verified"] - written).total_seconds(),
                    "commit_to_fleet_s": fleet - t0,
                    "requests_ok": after["ok"] - before["ok"], "requests_failed": after["failed"] - before["failed"],
                    "retried_503": after["retried_503"] - before["retried_503"], **det,
                }  # fmt: skip
                samples.append(sample)
                pw = [round(w.get("pause_window_ms") or -1, 1) for w in det["workers"].values()]
                print(f"[{transport}] {version}: verified {sample['commit_to_verified_s']:.2f}s, fleet "
                      f"{sample['commit_to_fleet_s']:.2f}s, pause ms {pw}, failed {sample['requests_failed']}", flush=True)  # fmt: skip
                prev2, prev = prev, version
                run.prune([prev2, prev, last_full])
            if transport == args.reject_in:
                for j, kind in enumerate(k for k in args.reject.split(",") if k):
                    r = reject_one(run, load, kind, prev, args.seed + 500 + j, args.update_timeout, source=last_full)
                    rejections.append(r)
                    print(f"[{transport}] bad {kind}: {r['status']} by {r['caught_by']} in {r['commit_to_decision_s']}s, "
                          f"no pause: {r['rejected_before_any_pause']}, failed {r['requests_failed']}", flush=True)  # fmt: skip
                    run.prune([prev2, prev, last_full])
            totals = load.snapshot()
            errors = load.stats.errors[:20]
        health_seen = health.summary()
        print(f"[{transport}] daemon /health during the rollouts: {health_seen}", flush=True)
        if transport == "ipc" and args.flip_back:
            try:
                next(p for p in run.procs if p.name == "daemon").stop()  # it would converge w0 back meanwhile
                flip = flip_back(run.http, run.worker_urls[0], run.loader_socket, full_prev, work,
                                 args.flip_back)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - reported; the rollouts' figures stand
                flip = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{transport}] flip-back after a failed probe (w0): "
                  + ", ".join(f"{m} {flip[m]['flip_back_median_ms']} ms (errors {len(flip[m]['errors'])})"
                              for m in ("copy", "swap") if m in flip)
                  + (f" error: {flip['error']}" if "error" in flip else ""), flush=True)  # fmt: skip
    except Exception as exc:
        tails = {p.name: p.tail(3000) for p in run.procs}
        for name, tail in tails.items():
            print(f"--- {name} log tail ---\n{tail}", file=sys.stderr)
        return {
            "transport": transport,
            "error": f"{type(exc).__name__}: {exc}",
            "samples": samples,
            "rejections": rejections,
            "health": health.summary() if health else {},
            "logs": tails,
        }
    finally:
        run.stop()
        try:
            if args.keep_logs:
                dst = Path(args.out) / f"logs-{transport}"
                dst.mkdir(parents=True, exist_ok=True)
                for p in run.procs:
                    try:
                        shutil.copy(p.log, dst / p.log.name)
                    except OSError as exc:  # a full disk must not keep 16 GB versions for the next step
                        print(f"[{transport}] log {p.log.name} not kept: {exc}", file=sys.stderr)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return {"transport": transport, "samples": samples, "load": totals, "errors": errors, "skipped": skipped,
            "rejections": rejections, "health": health_seen, "flip_back": flip,
            "seconds": time.perf_counter() - t_start}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1b", choices=sorted(MODELS))
    ap.add_argument("--device", default="cuda:0", help="workers' and loader's device: cpu or cuda:N")
    ap.add_argument(
        "--forward-device", default=None, help="forward check device (default: --device); 'off' disables it"
    )
    ap.add_argument("--transports", default="ipc,disk")
    ap.add_argument("--updates", type=int, default=20, help="measured versions per transport")
    ap.add_argument("--warmup", type=int, default=1, help="versions before measuring")
    ap.add_argument("--delta-updates", type=int, default=0,
                    help="after the full versions, this many delta versions (bench/e2e_delta.py)")
    ap.add_argument("--delta-density", type=float, default=0.01, help="share of elements a delta version changes")
    ap.add_argument("--delta-in", default=None, help="the transports whose fleets get them (default: all)")
    ap.add_argument("--update-mode", default="copy", choices=["copy", "swap"],
                    help="ipc: the workers copy the staged bytes (copy) or point at the loader's buffer (swap; "
                         "the loader keeps each served version, so the GPU holds ~3 staged versions more)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--stage-disk", default=None, choices=["auto", "on", "off"],
                    help="the workers' --stage-disk (default: theirs, auto); 'on' reads ahead on the CPU too")
    ap.add_argument("--clients", type=int, default=4, help="concurrent completion clients")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--max-unavailable", type=int, default=1,
                    help="[rollout] max_unavailable: 1 (the default) updates the workers one after another, "
                         "2 both at once (each paused for its own window)")  # fmt: skip
    ap.add_argument("--health-window", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=1e9,
        help="per transport: publish no new version after this many seconds",
    )
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--update-timeout", type=float, default=300)
    ap.add_argument("--work-root", default=None, help="where the watched folders go (default: the temp dir)")
    ap.add_argument("--keep-logs", action="store_true", help="copy every process's log under --out")
    ap.add_argument("--out", default=str(REPO / ".bench-out" / "gpu_e2e"))
    ap.add_argument("--versions", default="derived", choices=["derived", "fresh"],
                    help="derived: one base written, each version derived from the last (bench/e2e_versions.py)")
    ap.add_argument("--reject", default="corrupt,nan,incompatible", help="bad versions to commit ('' for none)")
    ap.add_argument("--flip-back", type=int, default=3,
                    help="ipc: refused updates (probe fails after resume) per mode on w0 at the end; 0: none")
    ap.add_argument("--reject-in", default=None, help="the transport whose fleet gets them (default: the first)")
    args = ap.parse_args(argv)
    args.forward_device = args.forward_device or args.device
    args.gen_device = "cuda" if args.device.startswith("cuda") else "cpu"
    layout = MODELS[args.model]
    transports = args.transports.split(",")
    args.reject_in = args.reject_in or transports[0]
    args.delta_in = args.delta_in or ",".join(transports)

    out = Path(args.out) / f"gpu_e2e-{layout.name}.json"
    results: list[dict[str, Any]] = []
    doc = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {**machine_description(), "python": platform.python_version()},
        "command": "python -m bench.gpu_e2e " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": {"layout": layout.name, "tensors": len(layout.tensors()), "bytes": layout.total_bytes},
        "results": results,
    }
    base: Path | None = None
    if args.versions == "derived":
        base = Path(tempfile.mkdtemp(prefix="hotswap-e2e-base-", dir=args.work_root)) / "base"
        t = time.perf_counter()
        write_checkpoint(base, layout, shards=args.shards, seed=args.seed, device=args.gen_device)
        print(f"base checkpoint written in {time.perf_counter() - t:.1f}s", flush=True)
    try:
        for transport in transports:
            r = run_transport(args, transport, layout, base)
            if "error" not in r:
                r["summary"] = summarise(r)
            results.append(r)
            write_json(out, doc)  # after each transport: a run stopped later keeps what it measured
    finally:
        if base is not None:
            shutil.rmtree(base.parent, ignore_errors=True)
    print_results(args, layout, results)
    write_json(out, doc)
    print(f"wrote {out}")
    bad = [x for r in results for x in r.get("rejections", []) if not x["rejected_before_any_pause"]]
    return 0 if all("error" not in r for r in results) and not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
