"""The fault matrix of issue 21: a real daemon with managed workers under load, one fault at a time.

    python -m bench.fault_matrix [--only NAME,...] [--out bench/results/fault_matrix.json]

Rigs (bench/faults_rig.py): `two` (two managed reference workers, SQLite in the state folder),
`default` (the embedded default: one managed worker; its mid-update faults are delivered while
the engine holds it paused, see faults_rig's `hold`), `tmpfs` (two workers, the state folder on
a 64 MB tmpfs), `pg` (two workers on a throw-away PostgreSQL 15 cluster, bench/faults_pg.py),
`ipc` (two workers, the loader beside the daemon), `s3` (two workers, checkpoints from moto).
Each fault (bench/faults_cases.py) runs under the watch (bench/faults_watch.py): a steady load
on the workers' serving ports, each worker's serving truth, /health at 10 Hz. Per fault: requests
failed, seconds with no worker serving, seconds of that while /health said ok, seconds until
/health listed the problem, whether the registry ended consistent (the serving alias = what every
worker reports = the workers table) once every version published during the fault is done with
(RESTING), and what the registry lost. Prints a table, writes JSON. Runs as root (tmpfs, chattr,
the PostgreSQL cluster run as the postgres user).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import faults_cases as fc
from bench.common import machine_description, print_table, write_json
from bench.faults_pg import PgCluster
from bench.faults_rig import Rig, wait_for
from bench.faults_watch import Watch

Case = Callable[[Rig], fc.Outcome]
# where a version published during a fault may end: the registry's figures are taken once each is there
RESTING = ("deployed", "retired", "superseded", "rejected", "duplicate", "deferred")
COLUMNS = ["rig", "fault", "failed req", "no worker s", "outage while ok s", "visible after s", "consistent",
           "lost", "note"]  # fmt: skip


def run_case(rig_name: str, rig: Rig, name: str, case: Case, settle_s: float = 240) -> dict[str, Any]:
    rig.wait_settled(timeout=240)
    before = rig.snapshot()
    watch = Watch(lambda: rig.api_url, rig.worker_urls()).start()
    time.sleep(1.0)  # the watch sees the fleet serving before the fault
    failed0 = watch.failed()
    t0 = time.monotonic()
    row: dict[str, Any] = {"rig": rig_name, "fault": name}
    try:
        out = case(rig)

        def shown() -> bool:  # /health listed one of the expected problems since the fault began
            return any(k in out.expect for ts, _, kinds in list(watch.health_seen) if ts >= t0 for k in kinds)

        def at_rest() -> bool:  # every published version recorded and done with, the fleet on the serving one
            ckpts = rig.snapshot()["checkpoints"]
            return all(ckpts.get(v) in RESTING for v in out.published) and rig.settled()

        if out.expect:
            with contextlib.suppress(TimeoutError):  # "never" in the table if it does not come
                wait_for(shown, 60, f"/health listing one of {out.expect}", 0.2)
        try:
            wait_for(at_rest, settle_s, "the fleet settled with every published version done with", 0.5)
            settled = True
        except TimeoutError:
            settled = False
        time.sleep(1.0)
        t1 = time.monotonic()
        row.update(watch.figures(t0, t1, out.expect), failed=watch.failed() - failed0, load_errors=watch.errors()[:5],
                   settled=settled, settle_s=round(t1 - t0, 1), note=out.note, expect=list(out.expect))  # fmt: skip
        row.update(rig.consistency())
        row["lost"] = rig.lost(before, out.published)
    except Exception as exc:  # noqa: BLE001 - one fault's harness error must not end the matrix
        row.update(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:], log=rig.log_tail(2000))
    finally:
        watch.stop()
    print(f"{rig_name}/{name}: {({k: v for k, v in row.items() if k not in ('trace', 'log')})}", flush=True)
    return row


def table_row(r: dict[str, Any]) -> list[Any]:
    if "error" in r:
        return [r["rig"], r["fault"], "-", "-", "-", "-", "-", "-", f"harness error: {r['error'][:80]}"]
    vis = "-" if not r.get("expect") and r.get("visible_after_s") is None else (r.get("visible_after_s") or "never")
    return [r["rig"], r["fault"], r["failed"], r["no_worker_s"], r["outage_while_ok_s"], vis,
            "yes" if r.get("consistent") and r.get("settled") else "NO", ", ".join(r["lost"]) or "nothing",
            r.get("note", "")[:70]]  # fmt: skip


def with_rig(rows: list[dict[str, Any]], rig_name: str, make: Callable[[], Rig], cases: list[tuple[str, Case]],
             only: set[str]) -> None:  # fmt: skip
    cases = [(n, c) for n, c in cases if not only or n in only]
    if not cases:
        return
    rig = make()
    try:
        rig.start()
        rig.publish("seed-v1", 1)
        rig.wait_settled("seed-v1")
        for name, case in cases:
            rows.append(run_case(rig_name, rig, name, case))
    except Exception as exc:  # noqa: BLE001
        rows.append({"rig": rig_name, "fault": "(start)", "error": f"{type(exc).__name__}: {exc}", "log": rig.log_tail()})
    finally:
        rig.stop()


def ipc_rig(rows: list[dict[str, Any]], root: Path, only: set[str]) -> None:
    """Two workers on the ipc transport (shared host memory on CPU), the loader run beside the daemon;
    verify reads the files itself (checks.stage_device = off) so only the rollout stages in the loader."""
    root.mkdir(parents=True)
    rig = Rig(root, workers=2, transport="ipc", checks={"stage_device": "off"})
    loader = fc.Loader(rig).start()
    try:
        with_rig(rows, "ipc", lambda: rig, [("loader_killed_mid_stage", fc.loader_killed(loader))], only)
    finally:
        loader.stop()


def s3_rig(rows: list[dict[str, Any]], root: Path, only: set[str]) -> None:
    """Two workers, the checkpoints in S3 (a moto server on loopback, `moto_server` from the venv)."""
    import sys

    import boto3

    root.mkdir(parents=True)
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    moto = Moto(sys.executable)
    moto.start()
    moto.client().create_bucket(Bucket="ckpts")
    source = {"type": "s3", "bucket": "ckpts", "prefix": "run/", "endpoint_url": moto.url, "name": "bucket",
              "poll_interval_s": 1.0, "cache_dir": str(root / "s3cache")}  # fmt: skip
    rig = Rig(root, workers=2, sources=[source], env=creds)

    def upload(version: str, seed: int) -> None:
        d = rig.store / version
        if not d.is_dir():
            rig.make(version, seed)
        s3 = moto.client()
        files = sorted(d.iterdir(), key=lambda p: p.name == "hotswap-manifest.json")  # the manifest last
        for f in files:
            s3.upload_file(str(f), "ckpts", f"run/{version}/{f.name}")

    rig.publisher = upload
    try:
        with_rig(rows, "s3", lambda: rig, [("s3_down_mid_download", fc.s3_down_mid_download(moto, upload)),
                                           ("s3_credentials_missing", fc.s3_credentials_missing(moto))], only)  # fmt: skip
    finally:
        moto.stop()
    del boto3


class Moto:
    """moto's S3 server on a fixed loopback port (restarted on the same one; it keeps nothing)."""

    def __init__(self, python: str) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import socket

        self.proc = subprocess.Popen([self.python, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip

        def up() -> bool:
            socket.create_connection(("127.0.0.1", self.port), 0.2).close()
            return True

        wait_for(up, 30, "moto", 0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing",
                            aws_secret_access_key="testing-secret", region_name="us-east-1")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", default="", help="comma-separated fault names")
    ap.add_argument("--rigs", default="two,default,tmpfs,pg,ipc,s3", help="comma-separated rigs")
    ap.add_argument("--out", default="bench/results/fault_matrix.json")
    args = ap.parse_args()
    only = {s for s in args.only.split(",") if s}
    rigs = set(args.rigs.split(","))
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hs-faults-") as tmp:
        root = Path(tmp)
        common: list[tuple[str, Case]] = [("refused_rollback", fc.refused_rollback),
                                          ("last_good_deleted", fc.last_good_deleted),
                                          ("worker_sigkill_mid_update", fc.worker_sigkill),
                                          ("worker_sigstop_mid_update", fc.worker_sigstop),
                                          ("daemon_sigkill_mid_rollout", fc.daemon_sigkill)]  # fmt: skip
        if "two" in rigs:
            with_rig(rows, "two", lambda: Rig(root / "two", workers=2),
                     [*common, ("sqlite_read_only", fc.sqlite_read_only)], only)  # fmt: skip
        if "default" in rigs:
            with_rig(rows, "default", lambda: Rig(root / "default", workers=0, hold=fc.HELD), common, only)
        if "tmpfs" in rigs:
            state = root / "tmpfs" / "state"
            state.mkdir(parents=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(state)], check=True)
            try:
                with_rig(rows, "tmpfs", lambda: Rig(root / "tmpfs", workers=2, state_dir=state),
                         [("state_disk_full", fc.state_disk_full)], only)  # fmt: skip
            finally:
                subprocess.run(["umount", "-l", str(state)], check=False)
        if "pg" in rigs:
            pg = PgCluster(Path(tempfile.mkdtemp(prefix="hs-pg-", dir="/tmp")), port=55433).init()
            pg.start()
            try:
                if not only or "migrations_together" in only:
                    extra["migrations_together"] = fc.migrations_together(pg, root)
                    print(f"migrations_together: {extra['migrations_together']}", flush=True)
                url = pg.create_database("hotswap_faults")
                with_rig(rows, "pg", lambda: Rig(root / "pg", workers=2, db_url=url),
                         [("pg_stopped_idle", fc.pg_stopped(pg, False)),
                          ("pg_stopped_mid_rollout", fc.pg_stopped(pg, True))], only)  # fmt: skip
            finally:
                pg.destroy()
        if "ipc" in rigs:
            ipc_rig(rows, root / "ipc", only)
        if "s3" in rigs:
            s3_rig(rows, root / "s3", only)
    print_table("fault matrix (issue 21)", COLUMNS, [table_row(r) for r in rows])
    if "migrations_together" in extra:
        m = extra["migrations_together"]
        print(f"db upgrade x{m['runs']} together on a fresh PostgreSQL database: {m['succeeded_per_round']} succeeded")
    write_json(args.out, {"machine": machine_description(), "rows": rows, **extra})


if __name__ == "__main__":
    main()
