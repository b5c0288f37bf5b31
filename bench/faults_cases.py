"""The faults of the matrix (issue 21): each injects one fault into a running rig and undoes it.

A case returns what the matrix needs besides the watch's figures: the problem kinds /health
should show, the versions published during the fault (they must end up recorded), a note.
Mid-update faults are injected when the worker itself reports DRAINING or PAUSED (polled on
its admin API every 5 ms), i.e. inside the daemon's update of it: a drained worker is kept there
by a long request of the harness in flight; a paused one (a lone worker) by the rig's hold (HELD,
bench/faults_rig.py). A drained worker is hit once the harness's request is the only one left in
it (`in_flight` 1): the load's requests that the drain was still finishing would die with the
process whatever the control plane does, so the failed-request count measures what happens after
the fault (where the load is sent, what answers it), not what a SIGKILL takes with it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

from bench.faults_pg import PgCluster
from bench.faults_rig import Rig, wait_for

_seeds = count(100)
# the versions a rig built with hold=HELD holds inside their update (a lone worker's pause)
HELD = ("k-held", "s-held", "d-held")


@dataclass
class Outcome:
    expect: tuple[str, ...] = ()  # problem kinds /health should show
    published: tuple[str, ...] = ()  # versions that must end up recorded
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _version(prefix: str) -> str:
    return f"{prefix}-{int(time.time() * 1000) % 10**8}"


def long_request(rig: Rig, name: str) -> None:
    """A long completion on `name`, in the background: a drain waits for it, so the worker
    reports DRAINING long enough to be caught there (tiny updates take milliseconds)."""
    import threading

    import httpx

    url = rig.worker_urls()[rig.names.index(name)] + "/v1/completions"
    body = {"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True}
    threading.Thread(target=lambda: httpx.post(url, json=body, timeout=120), daemon=True).start()
    time.sleep(0.2)


def until_mid_update(rig: Rig, name: str, timeout: float = 120) -> str:
    def mid() -> str | None:
        info = rig.weight_info(name, timeout=1.0)
        state = info.get("state")
        if state == "DRAINING" and info.get("in_flight", 0) > 1:
            return None  # the drain still finishes a request of the load beside the harness's own
        return str(state) if state in ("DRAINING", "PAUSED") else None

    return str(wait_for(mid, timeout, f"{name} inside an update", 0.005))


def into_update(rig: Rig, prefix: str) -> str:
    """Publish a version and return it once the first worker is inside its update: held there by
    the rig (its version in HELD), else by a long request its drain waits for."""
    held = next((v for v in HELD if v.startswith(f"{prefix}-") and v in rig.hold), None)
    v = held or _version(prefix)
    if held is None:
        long_request(rig, rig.names[0])
    rig.publish(v, next(_seeds))
    until_mid_update(rig, rig.names[0])
    return v


def let_go(rig: Rig, v: str) -> None:
    if v in rig.hold:
        rig.release(v)


def refused_rollback(rig: Rig) -> Outcome:
    """A retired, once-verified version with a byte flipped; `hotswap rollback --to` it."""
    old = _version("old")
    rig.publish(old, next(_seeds))
    rig.wait_settled(old)
    new = _version("new")
    rig.publish(new, next(_seeds))
    rig.wait_settled(new)
    shard = next((rig.watch_dir / old).glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    r = rig.cli("rollback", "--to", old, "--timeout", "120")
    return Outcome(expect=("rollout_failed",), note=f"rollback rc {r.returncode}: {(r.stdout + r.stderr).strip()[-160:]}")


def last_good_deleted(rig: Rig) -> Outcome:
    """The version before the serving one (what `hotswap rollback` goes to) deleted, then rollback."""
    a, b = _version("a"), _version("b")
    for v in (a, b):
        rig.publish(v, next(_seeds))
        rig.wait_settled(v)
    shutil.rmtree(rig.watch_dir / a)
    r = rig.cli("rollback", "--timeout", "120")
    return Outcome(note=f"rollback rc {r.returncode}: {(r.stdout + r.stderr).strip()[-160:]}")


def worker_sigkill(rig: Rig) -> Outcome:
    v = into_update(rig, "k")
    os.kill(rig.worker_pid(rig.names[0]), signal.SIGKILL)
    let_go(rig, v)
    return Outcome(expect=("no_worker_serving", "worker_out_of_rotation", "rollout_failed") if len(rig.names) == 1
                   else (), published=(v,))  # fmt: skip


def worker_sigstop(rig: Rig, hold_s: float = 20.0) -> Outcome:
    v = into_update(rig, "s")
    pid = rig.worker_pid(rig.names[0])
    os.kill(pid, signal.SIGSTOP)
    let_go(rig, v)  # the daemon's update call now waits on a stopped worker
    time.sleep(hold_s)
    os.kill(pid, signal.SIGCONT)
    return Outcome(expect=("no_worker_serving",) if len(rig.names) == 1 else (), published=(v,),
                   note=f"SIGCONT after {hold_s:.0f} s")  # fmt: skip


def daemon_sigkill(rig: Rig) -> Outcome:
    v = into_update(rig, "d")
    rig.kill()
    let_go(rig, v)  # the next daemon process passes the hold
    rig.start()
    return Outcome(published=(v,), note="restarted at once")


def sqlite_read_only(rig: Rig, hold_s: float = 15.0) -> Outcome:
    """chattr +i on the database and its WAL (root ignores file modes), a checkpoint meanwhile."""
    db = Path(rig.db_url.removeprefix("sqlite:///"))
    files = [p for p in (db, db.with_name(db.name + "-wal")) if p.exists()]
    for p in files:
        subprocess.run(["chattr", "+i", str(p)], check=True)
    v = _version("ro")
    try:
        rig.publish(v, next(_seeds))
        time.sleep(hold_s)
    finally:
        for p in files:
            subprocess.run(["chattr", "-i", str(p)], check=True)
    return Outcome(expect=("database_unwritable",), published=(v,), note=f"read-only for {hold_s:.0f} s")


def state_disk_full(rig: Rig, hold_s: float = 15.0) -> Outcome:
    """The rig's state directory is a small tmpfs: fill it, publish a checkpoint, free it."""
    fill = rig.state / "fill"
    subprocess.run(["dd", "if=/dev/zero", f"of={fill}", "bs=1M"], capture_output=True)
    v = _version("full")
    try:
        rig.publish(v, next(_seeds))
        time.sleep(hold_s)
    finally:
        fill.unlink(missing_ok=True)
    return Outcome(expect=("state_disk_full",), published=(v,), note=f"full for {hold_s:.0f} s")


def pg_stopped(pg: PgCluster, mid_rollout: bool, hold_s: float = 15.0) -> Callable[[Rig], Outcome]:
    def case(rig: Rig) -> Outcome:
        v = _version("pg")
        if mid_rollout:
            long_request(rig, rig.names[0])
            rig.publish(v, next(_seeds))
            until_mid_update(rig, rig.names[0])
        pg.stop()
        try:
            time.sleep(hold_s)
        finally:
            pg.start()
        return Outcome(expect=("database_unreachable", "database_unwritable"), published=(v,) if mid_rollout else (),
                       note=f"PostgreSQL down {hold_s:.0f} s")  # fmt: skip

    return case


def migrations_together(pg: PgCluster, root: Path, n: int = 5, rounds: int = 3) -> dict[str, Any]:
    """`hotswap db upgrade` started n at a time on a fresh database, `rounds` times."""
    import sys

    from bench.faults_rig import REPO, toml

    results = []
    for i in range(rounds):
        url = pg.create_database(f"mig{i}_{int(time.time())}")
        cfg = root / f"mig{i}.toml"
        cfg.write_text(toml({"daemon": {"state_dir": str(root / f"mig{i}")}, "database": {"url": url}}))
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        procs = [subprocess.Popen([sys.executable, "-m", "daemon.cli.main", "db", "upgrade", "-c", str(cfg)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(n)]  # fmt: skip
        outs = [(p.wait(300), p.stdout.read() if p.stdout else "") for p in procs]
        results.append(sum(rc == 0 for rc, _ in outs))
        for rc, out in outs:
            if rc:
                print(f"db upgrade failed: {out.strip()[-300:]}")
    return {"runs": n, "rounds": rounds, "succeeded_per_round": results}


class Loader:
    """`hotswap loader` on the rig's socket (the operator runs it beside the daemon)."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.proc: subprocess.Popen[bytes] | None = None
        self.socket = rig.root / "loader.sock"

    def start(self) -> Loader:
        import sys

        self.socket.unlink(missing_ok=True)
        shm = self.rig.root / "shm"
        shm.mkdir(exist_ok=True)
        with open(self.rig.root / "loader.log", "ab") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", "daemon.cli.main", "loader", "--socket", str(self.socket),
                                          "--device", "cpu", "--shm-dir", str(shm)], env=self.rig.env,
                                         stdout=logf, stderr=subprocess.STDOUT)  # fmt: skip
        wait_for(self.socket.exists, 60, "the loader's socket", 0.1)
        return self

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _open_rollout(rig: Rig) -> bool:
    from sqlalchemy import text

    with rig.engine().connect() as c:
        return bool(c.execute(text("SELECT count(*) FROM rollouts WHERE outcome IS NULL")).scalar())


def loader_killed(loader: Loader) -> Callable[[Rig], Outcome]:
    """The loader stopped (SIGSTOP) so the daemon's stage call waits in it, then SIGKILLed there;
    started again 10 s later. The version must not be rejected."""

    def case(rig: Rig) -> Outcome:
        v = _version("ipc")
        loader.signal(signal.SIGSTOP)
        rig.publish(v, next(_seeds))
        wait_for(lambda: _open_rollout(rig), 120, "the rollout staging in the loader", 0.05)
        time.sleep(0.5)
        loader.stop()  # SIGKILL ends a stopped process too: it never answers the stage call
        time.sleep(10)
        loader.start()
        return Outcome(expect=("rollout_failed",), published=(v,), note="SIGKILL while staging; loader back after 10 s")

    return case


def s3_down_mid_download(moto: Any, upload: Callable[[str, int], None]) -> Callable[[Rig], Outcome]:
    """The moto endpoint killed while the daemon fetches a checkpoint; back 10 s later (moto
    keeps nothing: the checkpoint is uploaded again, as a trainer's retry would)."""

    def case(rig: Rig) -> Outcome:
        from sqlalchemy import text

        v, seed = _version("s3"), next(_seeds)
        upload(v, seed)

        def fetching() -> bool:
            with rig.engine().connect() as c:
                return bool(c.execute(text("SELECT status FROM checkpoints WHERE version = :v"), {"v": v}).scalar()
                            == "fetching")

        wait_for(fetching, 120, f"{v} fetching", 0.02)
        moto.stop()
        time.sleep(10)
        moto.start()
        moto.client().create_bucket(Bucket="ckpts")
        upload(v, seed)
        return Outcome(expect=("source_failing",), published=(v,), note="endpoint down 10 s mid-download")

    return case


def s3_credentials_missing(moto: Any) -> Callable[[Rig], Outcome]:
    """The daemon restarted without credentials (SIGKILL: its workers keep serving), then with them."""

    def case(rig: Rig) -> Outcome:
        creds = {k: rig.env.pop(k) for k in list(rig.env) if k.startswith("AWS_")}
        rig.env["AWS_SHARED_CREDENTIALS_FILE"] = "/nonexistent"
        rig.kill()
        rig.start()
        try:
            wait_for(lambda: "source_failing" in str(rig.health()[1]), 60, "source_failing in /health", 0.2)
        finally:
            rig.env.update(creds)
            rig.kill()
            rig.start()
        return Outcome(expect=("source_failing",), note="daemon restarted without, then with credentials")

    return case
