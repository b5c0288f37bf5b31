"""The PostgreSQL side of bench/fleet_sim.py: a throw-away database with the fleet seeded, PgBouncer
in transaction mode (Debian's `pgbouncer`, run as the `postgres` user: it refuses root), and a
sampler of server connections, lease holders and transactions.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import make_url

from daemon.registry import Registry
from daemon.registry.models import Alias, Checkpoint, CheckpointLocation, Worker, utcnow


def create_database(server_url: str, name: str) -> str:
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return make_url(server_url).set(database=name).render_as_string(hide_password=False)


def drop_database(server_url: str, name: str) -> None:
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def seed_fleet(
    url: str, hosts: list[str], versions: list[str], folder: Path, copies: int | None = None
) -> None:
    """Migrated, then: `versions[0]` verified, deployed and good, every host serving it; the others
    registered but still `verifying` (no host acts on them) with a copy on every host, so a commit
    (`commit_version`) only has to make one of them good. `copies`: only the first that many
    versions have a copy on every host (the others are fetched: bench/fleet_sim_bytes.py)."""
    reg = Registry(url, "fleet-sim")
    reg.upgrade()
    now = utcnow()
    ids = {}
    with reg.session() as s:
        for step, v in enumerate(versions):
            (folder / v).mkdir(parents=True, exist_ok=True)
            good = step == 0
            c = Checkpoint(version=v, source="local:/sim", uri=f"file:///sim/{v}", step=step,
                           status="deployed" if good else "verifying", verified_at=now if good else None,
                           last_good_at=now if good else None, deployed_at=now if good else None)  # fmt: skip
            s.add(c)
            s.flush()
            ids[v] = c.id
    with reg.session() as s:
        s.execute(insert(Alias), [{"host": h, "name": n, "checkpoint_id": ids[versions[0]], "updated_at": now}
                                  for h in hosts for n in ("serving", "last_good")])  # fmt: skip
        s.execute(insert(Worker), [{"host": h, "name": "w0", "kind": "builtin", "url": f"http://{h}/w0", "device": "cpu",
                                   "state": "RUNNING", "weight_version": versions[0], "updated_at": now}
                                  for h in hosts])  # fmt: skip  # each host's one worker, as its daemon registers it
        s.execute(insert(CheckpointLocation), [{"checkpoint_id": ids[v], "host": h, "local_path": str(folder / v),
                                                "recorded_at": now} for h in hosts for v in versions[:copies]])  # fmt: skip
    reg.close()


def commit_version(url: str, version: str) -> None:
    """The version passed its first host's health window: verified, deployed and `last_good_at` set,
    so it is the fleet target (daemon.fleet.target.newest_good) for every host's next tick."""
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE checkpoints SET status = 'deployed', verified_at = now(), deployed_at = now(), "
                          "last_good_at = now() WHERE version = :v"), {"v": version})  # fmt: skip
    engine.dispose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Bouncer:
    """PgBouncer in transaction mode in front of `server`; at most `pool_size` server connections."""

    def __init__(self, server_url: str, pool_size: int) -> None:
        self.server = make_url(server_url)
        self.pool_size = pool_size
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="fleet-sim-pgbouncer-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        user = self.server.username or "postgres"
        (self.dir / "userlist.txt").write_text(f'"{user}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(f"""[databases]
* = host={self.server.host or "127.0.0.1"} port={self.server.port or 5432}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir / "userlist.txt"}
admin_users = {user}
stats_users = {user}
pool_mode = transaction
default_pool_size = {self.pool_size}
max_db_connections = {self.pool_size}
max_client_conn = 5000
ignore_startup_parameters = extra_float_digits,options
log_connections = 0
log_disconnections = 0
logfile = {self.dir / "pgbouncer.log"}
""")
        args = [exe, str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:  # it refuses root: the postgres user, which writes its log here
            args[1:1] = ["-u", "postgres"]
            for p in (self.dir, *self.dir.iterdir()):
                shutil.chown(p, "postgres")
        # its log goes to stderr too: never a pipe nobody reads (it blocks once 64 KiB are unread)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"pgbouncer did not listen on {self.port}: {self.log_tail()}")

    def url(self, database: str) -> str:
        """The hosts' URL: statements never prepared on the server (transaction mode, PgBouncer 1.18)."""
        return (self.server.set(host="127.0.0.1", port=self.port, database=database)
                .render_as_string(hide_password=False) + "?prepare_threshold=none")  # fmt: skip

    def stats(self, database: str) -> dict[str, int]:
        """`SHOW STATS` totals for `database` (queries and transactions PgBouncer passed to the server)."""
        out = subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.server.username or "postgres",
                              "-d", "pgbouncer", "-AF", "\t", "-c", "SHOW STATS"],
                             capture_output=True, text=True, timeout=10).stdout.splitlines()  # fmt: skip
        if not out:
            return {}
        head = out[0].split("\t")
        for line in out[1:]:
            row = dict(zip(head, line.split("\t"), strict=False))
            if row.get("database") == database:
                return {k: int(v) for k, v in row.items() if k.startswith("total_") and v.isdigit()}
        return {}

    def log_tail(self) -> str:
        p = self.dir / "pgbouncer.log"
        return p.read_text()[-2000:] if p.is_file() else ""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


SAMPLE_EVERY_S = 0.25


@dataclass
class Sample:
    t: float
    server_conns: int  # server connections to the sim's database (the sampler's own excluded)
    server_conns_all: int  # to the whole server, every database (other users' included)
    holders: int  # fleet_leases rows held and not expired
    xacts: int  # pg_stat_database xact_commit + xact_rollback of the sim's database


@dataclass
class Sampler:
    """Every `every_s` on its own direct connection: one statement, so it adds one transaction each."""

    url: str
    database: str
    every_s: float = SAMPLE_EVERY_S
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    SQL = text("""SELECT
  (SELECT count(*) FROM pg_stat_activity WHERE datname = :db AND pid <> pg_backend_pid()),
  (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()),
  (SELECT count(*) FROM fleet_leases WHERE host IS NOT NULL AND expires_at >= now()),
  (SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = :db)""")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        engine = create_engine(self.url, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            while not self._stop.wait(self.every_s):
                a, b, c, d = conn.execute(self.SQL, {"db": self.database}).one()
                self.samples.append(Sample(time.monotonic(), int(a), int(b), int(c), int(d or 0)))
        engine.dispose()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def between(self, t0: float, t1: float) -> list[Sample]:
        return [s for s in self.samples if t0 <= s.t <= t1]


def window(samples: list[Sample], seconds: float) -> dict[str, Any]:
    """Peak and mean server connections, peak holders, transactions per second over a window."""
    if len(samples) < 2:
        return {}
    span = samples[-1].t - samples[0].t
    return {
        "server_conns_peak": max(s.server_conns for s in samples),
        "server_conns_mean": round(sum(s.server_conns for s in samples) / len(samples), 1),
        "server_conns_all_peak": max(s.server_conns_all for s in samples),
        "holders_peak_db": max(s.holders for s in samples),
        # minus the sampler's own transaction per sample
        "xacts_per_s": round((samples[-1].xacts - samples[0].xacts) / span - 1 / SAMPLE_EVERY_S, 1)
        if span
        else None,
        "seconds": round(seconds, 2),
    }
