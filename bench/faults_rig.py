"""One fault-matrix subject: a real `hotswap daemon` with its managed workers, a watch folder, a database.

    rig = Rig(root, workers=2, db_url=None, transport="disk").start()
    rig.publish("v2", seed=2); rig.wait_settled("v2")
    before = rig.snapshot(); ...; rig.consistency(); rig.lost(before)
    rig.stop()

`workers=0` is the embedded default's fleet (daemon.config.default_workers: one managed worker
named local, every key left at its default, so the mode is drain and the planner pauses it).
The rig reads the workers' admin API itself (their runtime files and token files in the state
directory) to see what each worker really holds, and the registry directly (SQL) to compare it
before and after a fault.

`hold=("v-a", ...)`: the daemon runs through tests/hooked_daemon.py (the daemon's one seam,
`run_daemon(config, observers)`), which holds the rollout engine right after it records a worker
PAUSED on one of those versions until `rig.release(version)`. A lone worker is paused for the
milliseconds a tiny update takes, too short to deliver a fault inside it; the hold stands in for
a large model's update and lasts until the fault is delivered.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
from sqlalchemy import create_engine, text

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")
# A model that takes a noticeable moment to hash and copy (~60 MB of float32 weights), so a
# fault can be injected while an update is in flight; tiny otherwise (CPU, 2 cores).
MODEL: dict[str, Any] = {}  # the daemon seeds itself with the tiny model: every version must be compatible with it


def wait_for(fn: Callable[[], T], timeout: float, what: str, every: float = 0.05) -> T:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
        except Exception as exc:  # noqa: BLE001 - keep polling
            last = exc
        time.sleep(every)
    raise TimeoutError(f"{what} not within {timeout:.0f} s" + (f" (last error: {last})" if last else ""))


def toml(sections: dict[str, Any]) -> str:
    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):  # an inline table (a push source's hmac_keys)
            return "{" + ", ".join(f"{json.dumps(str(k))} = {val(x)}" for k, x in v.items()) + "}"
        return json.dumps(str(v))

    out = []
    for name, body in sections.items():
        for table in body if isinstance(body, list) else [body]:
            out.append(f"[[{name}]]" if isinstance(body, list) else f"[{name}]")
            out += [f"{k} = {val(v)}" for k, v in table.items()]
            out.append("")
    return "\n".join(out)


class Rig:
    def __init__(self, root: Path, *, workers: int = 2, db_url: str | None = None, transport: str = "disk",
                 sources: list[dict[str, Any]] | None = None, rollout: dict[str, Any] | None = None,
                 state_dir: Path | None = None, env: dict[str, str] | None = None,
                 checks: dict[str, Any] | None = None, hold: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.root = root
        self.hold = hold
        self.state = state_dir or root / "state"
        self.watch_dir = root / "checkpoints"
        self.store = root / "store"  # checkpoints are written here, then moved into the watch folder
        for d in (self.watch_dir, self.store):
            d.mkdir(parents=True, exist_ok=True)
        self.db_url = db_url or f"sqlite:///{self.state / 'hotswap.db'}"
        self.names = [f"w{i}" for i in range(workers)] if workers else ["local"]
        sections: dict[str, Any] = {
            "daemon": {"state_dir": str(self.state), "listen": "127.0.0.1:0", "keep_workers_on_stop": False},
            "database": {"url": self.db_url},
            "sources": sources or [{"path": str(self.watch_dir), "rescan_interval_s": 2.0}],
            "rollout": {"transport": transport, "health_window_s": 1.0, **(rollout or {})},
        }
        if checks:
            sections["checks"] = checks
        if workers:
            sections["workers"] = [{"name": n, "launch": "managed", "device": "cpu"} for n in self.names]
        else:  # what the embedded default runs (daemon.config.default_workers): every other key its default
            sections["workers"] = [{"name": "local", "launch": "managed"}]
        if transport == "ipc":
            sections["loader"] = {"socket": str(root / "loader.sock")}
        self.config = root / "config.toml"
        self.config.write_text(toml(sections))
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                    **(env or {})}  # fmt: skip
        self.env.pop("HOTSWAP_CONFIG", None)
        if hold:
            self.env.update(HOTSWAP_TEST_HOLD_STATE="PAUSED", HOTSWAP_TEST_HOLD_VERSION=",".join(hold),
                            HOTSWAP_TEST_HOLD_RELEASE=str(root / "RELEASE"))  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.api_url = ""
        self._engine: Any = None
        self.seeds: dict[str, int] = {}
        self.publisher: Callable[[str, int], None] | None = None  # another source than the watch folder

    # -- the daemon ----------------------------------------------------------------------------
    def start(self, timeout: float = 240) -> Rig:
        (self.state / "daemon.json").unlink(missing_ok=True)
        entry = "tests.hooked_daemon" if self.hold else "daemon.cli.main"
        with open(self.root / "daemon.log", "ab") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", entry, "daemon", "-c", str(self.config)],
                                         cwd=self.root, env=self.env, stdout=logf, stderr=subprocess.STDOUT)  # fmt: skip

        def started() -> str | None:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.log_tail()}")
            doc = json.loads((self.state / "daemon.json").read_text())
            return str(doc["api_url"]) if doc.get("pid") == self.proc.pid else None

        self.api_url = str(wait_for(started, timeout, "daemon.json", 0.1))
        wait_for(lambda: self.rollout().get("ready"), timeout, "rollout ready", 0.2)
        return self

    def release(self, version: str) -> None:
        """End the hold of `version` (and let any later daemon process pass it at once). Several
        held versions have a release file each (tests/hooked_daemon.py), one has RELEASE."""
        (self.root / ("RELEASE" if len(self.hold) < 2 else f"RELEASE.{version}")).touch()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        for name in self.names:  # a worker left behind by a killed daemon
            pid = self.worker_doc(name).get("pid")
            if pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)
        if self._engine is not None:
            self._engine.dispose()

    def log_tail(self, n: int = 3000) -> str:
        try:
            return (self.root / "daemon.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "daemon.cli.main", *args, "-c", str(self.config)],
                              cwd=self.root, env=self.env, capture_output=True, text=True, timeout=timeout)  # fmt: skip

    def rollout(self) -> dict[str, Any]:
        """The runner's in-memory view (GET /v1/rollout): ready, current job, serving, worker states."""
        r = httpx.get(self.api_url + "/v1/rollout", timeout=10)
        return dict(r.json())

    def health(self) -> tuple[int, dict[str, Any]]:
        r = httpx.get(self.api_url + "/health", timeout=10)
        return r.status_code, dict(r.json())

    # -- the workers ---------------------------------------------------------------------------
    def worker_doc(self, name: str) -> dict[str, Any]:
        try:
            return dict(json.loads((self.state / f"worker-{name}.json").read_text()))
        except (OSError, ValueError):
            return {}

    def worker_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.worker_doc(n)['port']}" for n in self.names]

    def worker_pid(self, name: str) -> int:
        return int(self.worker_doc(name)["pid"])

    def weight_info(self, name: str, timeout: float = 3.0) -> dict[str, Any]:
        doc = self.worker_doc(name)
        token = (self.state / f"worker-{name}.token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        if doc.get("admin_socket"):
            with httpx.Client(transport=httpx.HTTPTransport(uds=doc["admin_socket"]), timeout=timeout) as c:
                return dict(c.get("http://w/weight_info", headers=headers).json())
        return dict(httpx.get(f"http://127.0.0.1:{doc['port']}/weight_info", headers=headers, timeout=timeout).json())

    # -- checkpoints ---------------------------------------------------------------------------
    def make(self, version: str, seed: int) -> Path:
        """Write and publish a checkpoint in the store (not yet seen by the daemon)."""
        from daemon.manifest import publish
        from daemon.tinymodel import make_tiny_checkpoint

        d = self.store / version
        make_tiny_checkpoint(d, seed=seed, config_overrides=MODEL)
        publish(d, version=version)
        self.seeds[version] = seed
        return d

    def publish(self, version: str, seed: int) -> Path:
        if self.publisher is not None:
            self.publisher(version, seed)
            return self.store / version
        d = self.make(version, seed)
        dest = self.watch_dir / version
        d.rename(dest)
        return dest

    def serving(self) -> str | None:
        with self.engine().connect() as c:
            v = c.execute(text("SELECT c.version FROM aliases a JOIN checkpoints c ON c.id = a.checkpoint_id "
                               "WHERE a.name = 'serving'")).scalar()  # fmt: skip
            return str(v) if v is not None else None

    def versions(self) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for n in self.names:
            try:
                info = self.weight_info(n)
                out[n] = info.get("version") if info.get("state") == "RUNNING" else f"{info.get('state')}"
            except (httpx.HTTPError, KeyError, OSError, ValueError):
                out[n] = None
        return out

    def settled(self, version: str | None = None) -> bool:
        """Every worker RUNNING on the serving alias (on `version` when given), the daemon idle."""
        serving = self.serving()
        if serving is None or (version is not None and serving != version):
            return False
        if any(v != serving for v in self.versions().values()):
            return False
        st = self.rollout()
        return st.get("current") is None and all(w.get("state") == "RUNNING" for w in st.get("workers", []))

    def wait_settled(self, version: str | None = None, timeout: float = 240) -> None:
        wait_for(lambda: self.settled(version), timeout, f"every worker RUNNING on {version or 'serving'}", 0.25)

    # -- the registry --------------------------------------------------------------------------
    def engine(self) -> Any:
        if self._engine is None:
            self._engine = create_engine(self.db_url, pool_pre_ping=True)
        return self._engine

    def snapshot(self) -> dict[str, Any]:
        with self.engine().connect() as c:
            ckpts = {r[0]: r[1] for r in c.execute(text("SELECT version, status FROM checkpoints"))}
            events = {int(r[0]) for r in c.execute(text("SELECT id FROM events"))}
            rollouts = {int(r[0]) for r in c.execute(text("SELECT id FROM rollouts"))}
        return {"checkpoints": ckpts, "events": events, "rollouts": rollouts}

    def consistency(self) -> dict[str, Any]:
        """The serving alias against what every worker reports, and the workers table against both."""
        serving = self.serving()
        reported = self.versions()
        with self.engine().connect() as c:
            rows = {r[0]: (r[1], r[2]) for r in c.execute(text("SELECT name, state, weight_version FROM workers"))}
        recorded_ok = all(rows.get(n) == ("RUNNING", serving) for n in self.names)
        return {"serving": serving, "reported": reported, "recorded": {k: list(v) for k, v in rows.items()},
                "consistent": all(v == serving for v in reported.values()) and recorded_ok}  # fmt: skip

    def lost(self, before: dict[str, Any], expect_versions: tuple[str, ...] = ()) -> list[str]:
        """What the registry had before a fault and lacks now, and checkpoints published during
        it that were never recorded."""
        after = self.snapshot()
        out = [f"checkpoint {v}" for v in before["checkpoints"] if v not in after["checkpoints"]]
        out += [f"{len(before['events'] - after['events'])} events"] if before["events"] - after["events"] else []
        out += [f"rollout {r}" for r in sorted(before["rollouts"] - after["rollouts"])]
        out += [f"checkpoint {v} never recorded" for v in expect_versions if v not in after["checkpoints"]]
        return out
