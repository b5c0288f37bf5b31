"""Helpers for the rollout tests and benchmark: real worker processes, a load balancer-like load
generator, checkpoint publishing (including deliberately broken checkpoints) and history queries.

Also a tiny CLI, used as the workers' `restart_command` in the fault tests:

    python tests/support_rollout.py relaunch --pidfile F --log F -- <hotswap worker args>

starts `hotswap worker ARGS` detached (its own session), records its pid in F and exits at
once; the daemon then waits for the worker to answer, as it would after `systemctl restart`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from support_wait import (
    free_ports,  # noqa: F401 - used and re-exported
    wait_until,
)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()


# --------------------------------------------------------------------------- processes


def spawn_worker(worker_args: list[str], pidfile: Path, log: Path) -> int:
    """`hotswap worker ARGS` in its own session; pid written to `pidfile` (atomically)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli.main", "worker", *worker_args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=str(REPO),
            start_new_session=True,
        )  # fmt: skip
    tmp = pidfile.with_suffix(".tmp")
    tmp.write_text(str(proc.pid))
    os.replace(tmp, pidfile)
    return proc.pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (exited, not reaped) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@dataclass
class WorkerProc:
    """A real `hotswap worker` process on a loopback port, restartable by the daemon's restart command."""

    name: str
    port: int
    workdir: Path
    token: str = "test-token-0123456789"
    step_delay_ms: float = 0.0

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token_file = self.workdir / f"{self.name}.token"
        self.token_file.write_text(self.token + "\n")
        self.token_file.chmod(0o600)
        self.pidfile = self.workdir / f"{self.name}.pid"
        self.log_file = self.workdir / f"{self.name}.log"
        self.pids: list[int] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def worker_args(self, model: str, version: str | None) -> list[str]:
        args = ["--model", model, "--port", str(self.port), "--token-file", str(self.token_file), "--device", "cpu"]
        if version:
            args += ["--version", version]
        if self.step_delay_ms:
            args += ["--step-delay-ms", str(self.step_delay_ms)]
        return args

    def start(self, model: Path, version: str | None = None, timeout: float = 120.0) -> WorkerProc:
        spawn_worker(self.worker_args(str(model), version), self.pidfile, self.log_file)
        self.wait_running(timeout)
        return self

    def restart_command(self) -> list[str]:
        """The daemon's restart_command for this worker: relaunch on the fallback checkpoint."""
        return [
            sys.executable, str(SCRIPT), "relaunch", "--pidfile", str(self.pidfile), "--log", str(self.log_file),
            "--", *self.worker_args("{path}", "{version}"),
        ]  # fmt: skip

    @property
    def pid(self) -> int | None:
        try:
            return int(self.pidfile.read_text())
        except (OSError, ValueError):
            return None

    def alive(self) -> bool:
        return self.pid is not None and _alive(self.pid)

    def kill(self) -> int:
        """SIGKILL the worker process (a real crash); returns its pid."""
        pid = self.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(pid), 10, what=f"{self.name} (pid {pid}) to die")
        return pid

    def stop(self) -> None:
        pid = self.pid
        if pid is not None and _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)

    def info(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/weight_info", headers={"Authorization": f"Bearer {self.token}"}, timeout=10)
        r.raise_for_status()
        return r.json()

    def wait_running(self, timeout: float = 120.0, version: str | None = None) -> dict[str, Any]:
        def ok() -> dict[str, Any] | None:
            info = self.info()
            if info["state"] == "RUNNING" and (version is None or info["version"] == version):
                return info
            return None

        try:
            return wait_until(ok, timeout, what=f"worker {self.name} RUNNING" + (f" on {version}" if version else ""), interval=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.name} log tail:\n{self.log_tail()}") from None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def spec(self, **extra: Any) -> dict[str, Any]:
        """This worker as a [[workers]] table for the daemon config."""
        return {"name": self.name, "url": self.url, "token_file": str(self.token_file), "device": "cpu",
                "restart_command": self.restart_command(), **extra}  # fmt: skip


class WorkerPool:
    """Two (or more) real workers shared by the tests of one module: starting a worker costs
    seconds (torch, transformers), so each test resets them instead of starting new ones."""

    def __init__(self, root: Path, n: int = 2) -> None:
        self.root = root
        self.workers = [WorkerProc(f"w{i}", port, root / "workers") for i, port in enumerate(free_ports(n))]
        seed_dir = build_checkpoint(root / "pool-seed", "pool-seed", 0)
        for w in self.workers:
            spawn_worker(w.worker_args(str(seed_dir), "pool-seed"), w.pidfile, w.log_file)
        for w in self.workers:
            w.wait_running(240)

    def reset(self, model: Path, version: str) -> list[WorkerProc]:
        """Every worker RUNNING on `model` as `version`, by its admin API (or a fresh process)."""
        for w in self.workers:
            reset_worker(w, model, version)
        for w in self.workers:
            w.wait_running(240, version=version)
        return self.workers

    def close(self) -> None:
        for w in self.workers:
            w.stop()


def reset_worker(w: WorkerProc, model: Path, version: str) -> None:
    info = None
    if w.alive():
        with contextlib.suppress(httpx.HTTPError):
            info = w.info()
    if info is None or info["state"] == "UNHEALTHY":
        w.stop()
        spawn_worker(w.worker_args(str(model), version), w.pidfile, w.log_file)
        return
    headers = {"Authorization": f"Bearer {w.token}"}
    # the same label from another test's folder would be drift to the next daemon (UNCERTAIN, then
    # re-installed by its first rollout): install this folder's copy
    same_copy = info.get("path") and Path(str(info["path"])).resolve() == Path(model).resolve()
    if info["version"] != version or not same_copy:
        r = httpx.post(f"{w.url}/admin/update", headers=headers, timeout=60,
                       json={"version": version, "transport": "disk", "path": str(model)})  # fmt: skip
        r.raise_for_status()
    if info["state"] != "RUNNING" or w.info()["state"] != "RUNNING":
        httpx.post(f"{w.url}/admin/resume", headers=headers, timeout=30).raise_for_status()


def start_fleet(
    daemon_factory: Callable[..., Any],
    db_url: str,
    pool: WorkerPool,
    *,
    rollout: dict[str, Any],
    checks: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    worker_extra: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    hooked: bool = False,
) -> Any:
    """Reset the pool onto a fresh v0, then start the daemon on it (conftest's daemon_factory);
    returns the DaemonProcess once v0 is deployed and its health window has passed.
    `hooked`: start it from tests/hooked_daemon.py (test observers from `env`)."""
    d = daemon_factory(
        db_url,
        checks=checks,
        env=env,
        hooked=hooked,
        extra={"rollout": rollout, "workers": [w.spec(**(worker_extra or {})) for w in pool.workers], **(extra or {})},
        wait=False,
    )
    d.watch_dir.mkdir(parents=True)
    pool.reset(publish_into(d.watch_dir, "v0", seed=0), "v0")
    d.start(timeout=90)
    d.wait_status("v0", "deployed", timeout=180)
    window_s = float(rollout.get("health_window_s", 0.0))
    wait_until(lambda: aliases(d.registry).get("last_good") == "v0", 60 + 2 * window_s, what="v0's health window")
    return d


# --------------------------------------------------------------------------- checkpoints


def build_checkpoint(directory: Path, version: str, seed: int, *, fault: str | None = None) -> Path:
    """A tiny published checkpoint; `fault` makes it deliberately bad in a way checks may miss:

    "shape":        intermediate_size differs -> the worker refuses the update (table mismatch)
    "nan":          every weight of the final norm is NaN -> the probe's logits are not finite
    "nan-token:N":  only token N's embedding row is NaN -> prompts with token N produce NaN
                    logits and sampled requests fail; the greedy probe (without token N) passes
    """
    from daemon.manifest import publish
    from daemon.tinymodel import make_tiny_checkpoint

    overrides = {"intermediate_size": 96} if fault == "shape" else None
    make_tiny_checkpoint(directory, seed=seed, config_overrides=overrides)
    if fault and fault != "shape":
        from safetensors.torch import load_file, save_file

        (weights,) = sorted(directory.glob("*.safetensors"))
        tensors = load_file(str(weights))
        if fault == "nan":
            tensors["model.norm.weight"].fill_(float("nan"))
        elif fault.startswith("nan-token:"):
            tensors["model.embed_tokens.weight"][int(fault.split(":")[1])].fill_(float("nan"))
        else:
            raise ValueError(f"unknown fault {fault!r}")
        save_file(tensors, str(weights), metadata={"format": "pt"})
    publish(directory, version=version)
    return directory


def publish_into(watch_dir: Path, version: str, seed: int, *, fault: str | None = None) -> Path:
    """Build in a hidden folder (ignored by the source), then rename into place: one atomic arrival."""
    tmp = watch_dir / f".build-{version}"
    build_checkpoint(tmp, version, seed, fault=fault)
    final = watch_dir / version
    os.replace(tmp, final)
    return final


# --------------------------------------------------------------------------- load


# --------------------------------------------------------------------------- history


def worker_paths(registry: Any) -> dict[tuple[str, str], list[list[str]]]:
    """{(worker, version): [[state, state, ...] per rollout]} from `events`, in order.

    The version of a rollout's worker path is the rollout checkpoint's version.
    """
    from sqlalchemy import select

    from daemon.registry.models import Checkpoint, Event, Rollout

    out: dict[tuple[str, str], list[list[str]]] = {}
    with registry.session() as s:
        rows = s.execute(
            select(Event.rollout_id, Event.worker, Event.from_state, Event.to_state, Checkpoint.version)
            .join(Rollout, Rollout.id == Event.rollout_id)
            .join(Checkpoint, Checkpoint.id == Rollout.checkpoint_id)
            .where(Event.worker.is_not(None))
            .order_by(Event.id)
        ).all()
    current: dict[tuple[int, str], list[str]] = {}
    for rid, worker, frm, to, version in rows:
        key = (rid, worker)
        if key not in current:
            current[key] = [frm]
            out.setdefault((worker, version), []).append(current[key])
        current[key].append(to)
    return out


def rollouts(registry: Any) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from daemon.registry.models import Checkpoint, Rollout

    with registry.session() as s:
        rows = s.execute(select(Rollout, Checkpoint.version).join(Checkpoint).order_by(Rollout.id)).all()
        return [
            {"id": r.id, "version": v, "trigger": r.trigger, "outcome": r.outcome, "mode": r.mode,
             "transport": r.transport, "detail": r.detail or {}}
            for r, v in rows
        ]


def worker_events(registry: Any, rollout_id: int | None = None) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from daemon.registry.models import Event

    with registry.session() as s:
        q = select(Event).where(Event.worker.is_not(None)).order_by(Event.id)
        if rollout_id is not None:
            q = q.where(Event.rollout_id == rollout_id)
        return [
            {"rollout_id": e.rollout_id, "worker": e.worker, "from": e.from_state, "to": e.to_state,
             "ms": e.duration_ms, "detail": e.detail or {}, "at": e.at}
            for e in s.scalars(q)
        ]  # fmt: skip


def wait_passes(d: Any, loop: str, n: int, timeout: float = 120) -> None:
    """Until the daemon's `loop` ("health_poll" or "supervisor") has finished `n` more passes:
    what a test that must show "nothing happened" waits for, instead of a fixed sleep."""

    def passes() -> int:
        return int(d.get("/v1/rollout").json()["passes"][loop])

    start = passes()
    wait_until(lambda: passes() >= start + n, timeout, what=f"{n} more {loop} passes (from {start})", interval=0.1)


def worker_row(registry: Any, name: str) -> dict[str, Any]:
    from daemon.registry import queries as q

    with registry.session() as s:
        return next(r for r in q.worker_rows(s) if r["worker"] == name)


def aliases(registry: Any) -> dict[str, str]:
    from sqlalchemy import select

    from daemon.registry.models import Alias, Checkpoint

    with registry.session() as s:
        q = select(Alias.name, Checkpoint.version).join(Checkpoint).where(Alias.host == registry.host)  # this host's
        return dict(s.execute(q).all())


def assert_fleet_on(workers: Iterable[WorkerProc], version: str, timeout: float = 60.0) -> None:
    for w in workers:
        w.wait_running(timeout, version=version)


def _relaunch_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="support_rollout.py relaunch")
    p.add_argument("--pidfile", required=True, type=Path)
    p.add_argument("--log", required=True, type=Path)
    p.add_argument("worker_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    worker_args = [a for a in args.worker_args if a != "--"] if args.worker_args[:1] == ["--"] else args.worker_args
    old = None
    with contextlib.suppress(OSError, ValueError):
        old = int(args.pidfile.read_text())
    if old is not None and _alive(old):  # like systemctl restart: stop the old one first
        with contextlib.suppress(ProcessLookupError):
            os.killpg(old, signal.SIGKILL)
        wait_until(lambda: not _alive(old), 10, what=f"old worker {old} to exit")
    pid = spawn_worker(worker_args, args.pidfile, args.log)
    print(json.dumps({"pid": pid}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "relaunch":
        raise SystemExit(_relaunch_main(sys.argv[2:]))
    raise SystemExit("usage: support_rollout.py relaunch --pidfile F --log F -- WORKER_ARGS")
