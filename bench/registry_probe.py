"""One measurement of bench/registry_scale.py, in its own process (so a query that never ends is
killed from outside, and every start-up is a cold one):

    python -m bench.registry_probe --url URL --config FILE --what NAME [--repeat 3]

prints one JSON line per run: {"what": NAME, "s": seconds} (imports are done before the clock
starts). NAME is a CLI command ("history -n 20", "status", "status --fleet", "show"), a query of
QUERIES, "metrics" (one /metrics scrape of the registry series), "start" (build_daemon + start
until the rollout service is ready, two in-process fake workers answering as the registry says
they serve), "rollout writes" (the registry calls one successful rollout makes, in order) or
"fleet mark" (`daemon.fleet.target.fleet_mark`, the one statement each fleet host sends per poll).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import text

from bench.registry_fill import HOST, WORKERS, version_name

# (name, SQL): the queries README/docs show, each with a filter, and the filters their columns invite.
# :v is a version ten from the newest (retired, with a rollout), :r its rollout.
QUERIES: tuple[tuple[str, str], ...] = (
    ("version_history newest 10 (docs)", "SELECT version, status, status_message, discovered_at, verified_at "
                                         "FROM version_history ORDER BY checkpoint_id DESC LIMIT 10"),
    ("version_history newest 20, every column", "SELECT * FROM version_history ORDER BY checkpoint_id DESC LIMIT 20"),
    ("version_history WHERE status = 'rejected', every row (not a docs query since 2026-12-03)",
     "SELECT version, status_message FROM version_history WHERE status = 'rejected'"),
    ("version_history WHERE status = 'rejected' newest 20 (docs)",
     "SELECT version, status_message FROM version_history WHERE status = 'rejected' ORDER BY checkpoint_id DESC LIMIT 20"),
    ("count(*) version_history WHERE status = 'rejected' (docs)",
     "SELECT count(*) FROM version_history WHERE status = 'rejected'"),
    ("version_history WHERE version = :v", "SELECT * FROM version_history WHERE version = :v"),
    ("version_history WHERE status = 'verified' (waiting)", "SELECT * FROM version_history WHERE status = 'verified'"),
    ("worker_versions (docs)", "SELECT * FROM worker_versions"),
    ("worker_versions WHERE host = 'bench-0'", "SELECT * FROM worker_versions WHERE host = 'bench-0'"),
    ("worker_updates WHERE version = :v", "SELECT * FROM worker_updates WHERE version = :v"),
    ("worker_updates WHERE rollout_id = :r", "SELECT * FROM worker_updates WHERE rollout_id = :r"),
    ("fleet_versions (docs)", "SELECT host, serving, target, lag, updating_to, workers_running || '/' || workers AS up, "
                              "behind_reason FROM fleet_versions ORDER BY lag DESC, host"),
    ("fleet_versions WHERE host = 'bench-2'", "SELECT * FROM fleet_versions WHERE host = 'bench-2'"),
)  # fmt: skip
CLI = {"history -n 20": ["history", "-n", "20"], "status": ["status"], "status --fleet": ["status", "--fleet"]}


class BenchWorker:
    """A worker that answers at once, serving what the registry says (kind "bench")."""

    VERSIONS: dict[str, tuple[str | None, str | None]] = {}

    def __init__(self, name: str) -> None:
        from daemon.engines.base import Capabilities

        self.name = name
        self.capabilities = Capabilities(pause_modes=("keep",), can_drain=True, transports=("disk",),
                                         restores_itself=True, atomic_updates=True, reports_in_flight=True)  # fmt: skip
        self.version, self.digest = self.VERSIONS.get(name, (None, None))

    def weight_info(self) -> Any:
        from daemon.engines.base import WeightInfo

        return WeightInfo(self.version, self.digest, "RUNNING", tensors=291, bytes=16_060_000_000, device="cuda:0")

    def health(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def probe(self) -> str:
        return self.version or ""

    def counters(self) -> dict[str, int]:
        return {"requests_total": 0, "requests_failed": 0}

    def drain(self, timeout_s: float) -> None: ...
    def pause(self, mode: str = "keep") -> None: ...
    def resume(self) -> None: ...
    def close(self) -> None: ...


def connect(name: str, url: str, *, token_file: str | None, timeouts: Any) -> BenchWorker:
    return BenchWorker(name)


def _cli(argv: list[str], config: str) -> Callable[[], None]:
    from daemon.cli.main import main

    def run() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            code = main([*argv, "-c", config])
        assert code == 0, f"hotswap {' '.join(argv)} exited {code}"

    return run


def _query(url: str, sql: str) -> Callable[[], None]:
    from daemon.registry import Registry

    reg = Registry(url, host=HOST)
    with reg.engine.connect() as c:
        rid = c.execute(text("SELECT MAX(id) FROM checkpoints WHERE version LIKE 'step-%'")).scalar_one()
        v = c.execute(text("SELECT version FROM checkpoints WHERE id = :i"), {"i": rid - 10}).scalar_one()
        r = c.execute(text("SELECT MAX(id) FROM rollouts WHERE checkpoint_id = :i"), {"i": rid - 10}).scalar()
    params = {k: val for k, val in (("v", v), ("r", r)) if f":{k}" in sql}

    def run() -> None:
        with reg.engine.connect() as c:
            c.execute(text(sql), params).all()

    return run


def _metrics(url: str) -> Callable[[], None]:
    from daemon.api.registry_metrics import RegistryCollector
    from daemon.registry import Registry

    collector = RegistryCollector(Registry(url, host=HOST))
    return lambda: None if list(collector.collect()) else None


def _start(url: str, config: str) -> Callable[[], None]:
    from daemon.config import load_config
    from daemon.engines import WORKER_KINDS
    from daemon.registry import Registry
    from daemon.service import build_daemon

    WORKER_KINDS["bench"] = "bench.registry_probe:connect"
    reg = Registry(url, host=HOST)
    with reg.engine.connect() as c:  # each worker serves the host's serving version (nothing when empty)
        serving = c.execute(text("SELECT c.version, c.digest FROM aliases a JOIN checkpoints c ON c.id = a.checkpoint_id "
                                 "WHERE a.host = :h AND a.name = 'serving'"), {"h": HOST}).first()  # fmt: skip
        c.execute(text("UPDATE workers SET weight_version = :v, state = 'RUNNING' WHERE host = :h"),
                  {"v": serving[0] if serving else None, "h": HOST})  # fmt: skip
        c.commit()
        rollouts = c.execute(text("SELECT COUNT(*) FROM rollouts")).scalar_one()
    # the class `connect` makes them from: this file runs as __main__, the daemon imports it by name
    from bench.registry_probe import BenchWorker as Imported

    Imported.VERSIONS.update({w: (serving[0], serving[1]) if serving else (None, None) for w in WORKERS})
    reg.close()
    cfg = load_config(config)

    sql = _sql_clock()

    def run() -> None:
        sql.clear()
        cpu0 = time.process_time()  # this process's CPU, every thread: what the start did, not what it waited for
        t0 = time.perf_counter()
        d = build_daemon(cfg)
        try:
            d.start()
            assert d.rollout is not None and d.rollout.wait_ready(120), "start-up did not finish"
            RESULT["s"] = time.perf_counter() - t0
            RESULT["cpu_s"] = time.process_time() - cpu0
            RESULT["sql_s"] = sum(sql)  # every thread's statements until then (wall time: waits included)
            RESULT["sql_max_s"] = max(sql, default=0.0)
        finally:
            d.stop()
        with d.registry.engine.connect() as c:  # a start at rest rolls nothing out
            assert c.execute(text("SELECT COUNT(*) FROM rollouts")).scalar_one() == rollouts, "start-up rolled out"

    return run


def _sql_clock() -> list[float]:
    """Seconds of every SQL statement any engine runs from now on (the database's share of a start)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    spent: list[float] = []

    @event.listens_for(Engine, "before_cursor_execute")
    def _before(conn: Any, *_: Any) -> None:
        conn.info.setdefault("bench_t0", []).append(time.perf_counter())

    @event.listens_for(Engine, "after_cursor_execute")
    def _after(conn: Any, *_: Any) -> None:
        spent.append(time.perf_counter() - conn.info["bench_t0"].pop())

    return spent


def _rollout_writes(url: str) -> Callable[[], None]:
    """What `decisions.deploy_new` + `engine.deploy` + `mark_serving` + the health window write and
    read in the registry for one version reaching 2 workers, in their order (the workers' own time left out)."""
    from daemon.registry import Registry, status
    from daemon.registry.journal import Journal
    from daemon.registry.status import CheckpointStatus as C
    from daemon.registry.status import RolloutOutcome, RolloutTrigger

    reg = Registry(url, host=HOST)
    j = Journal(reg)

    def run() -> None:
        with reg.session() as s:  # registered and verified before the clock starts
            c = status.create(s, version=f"bench-{time.time_ns()}", source="bench", uri="file:///bench",
                              local_path="/data/ckpt/bench", commit_signal="manifest")  # fmt: skip
            assert c is not None
            status.move(s, c, C.VERIFYING)
            status.move(s, c, C.VERIFIED)
            cid = c.id
        t0 = time.perf_counter()
        j.newer_in_verification(cid)
        fresh = j.checkpoint(cid)
        serving = j.alias("serving")
        j.alias("last_good")
        assert fresh is not None
        rid = j.start_rollout(cid, trigger=RolloutTrigger.NEW, transport="disk", mode="drain",
                              detail={"version": fresh.version, "workers": list(WORKERS)})  # fmt: skip
        for w in WORKERS:
            for frm, to, ms in (("RUNNING", "DRAINING", 0.0), ("DRAINING", "UPDATED", 420.0), ("UPDATED", "RUNNING", 160.0)):
                j.transition(rollout_id=rid, worker=w, from_state=frm, to_state=to, duration_ms=ms,
                             weight_version=fresh.version if to == "UPDATED" else None)  # fmt: skip
        j.finish_rollout(rid, RolloutOutcome.SUCCEEDED, {"moved": list(WORKERS)})
        j.set_alias("serving", cid)
        j.checkpoint(cid)
        j.move_status(cid, C.DEPLOYED, f"rollout {rid}")
        if serving is not None:
            j.checkpoint(serving.id)
            j.move_status(serving.id, C.RETIRED, f"replaced by {fresh.version}")
        j.alias("last_good")
        j.amend_rollout(rid, detail={"health_window": {"ok": True}})
        j.set_alias("last_good", cid)
        RESULT["s"] = time.perf_counter() - t0
        if serving is not None:  # back as it was (the history keeps the extra version, retired)
            j.set_alias("serving", serving.id)
            j.set_alias("last_good", serving.id)
            if (old := j.checkpoint(serving.id)) is not None and old.status != C.DEPLOYED:
                j.move_status(serving.id, C.DEPLOYED, "bench: back after the measured rollout")
            j.move_status(cid, C.RETIRED, "bench: measured rollout")

    return run


RESULT: dict[str, float] = {}


def probe(what: str, url: str, config: str) -> Callable[[], None]:
    if what in CLI:
        return _cli(CLI[what], config)
    if what == "show":
        from daemon.registry import Registry

        reg = Registry(url, host=HOST)
        with reg.engine.connect() as c:
            n = c.execute(text("SELECT MAX(id) FROM checkpoints WHERE version LIKE 'step-%'")).scalar_one()
        return _cli(["show", version_name(n - 10)], config)
    if what == "metrics":
        return _metrics(url)
    if what == "start":
        return _start(url, config)
    if what == "rollout writes":
        return _rollout_writes(url)
    if what == "fleet mark":
        return _fleet_mark(url)
    return _query(url, dict(QUERIES)[what])


def _fleet_mark(url: str) -> Callable[[], None]:
    from daemon.fleet.target import fleet_mark
    from daemon.registry import Registry

    reg = Registry(url, host=HOST)
    fleet_mark(reg)  # the pool's first connection, before the clock

    def run() -> None:
        fleet_mark(reg)

    return run


def write_config(path: Path, url: str, workdir: Path, workers: bool = False) -> Path:
    """A probe's config: this registry, host bench-0, an empty watched folder; with `workers` (start
    only: the CLI refuses a kind it does not know) the two bench workers."""
    (workdir / "watch").mkdir(parents=True, exist_ok=True)
    listed = WORKERS if workers else ()
    workers_toml = "".join(f'[[workers]]\nname = "{w}"\nkind = "bench"\nurl = "http://127.0.0.1:9/{w}"\n\n' for w in listed)
    path.write_text(f'[daemon]\nstate_dir = "{workdir / "state"}"\nlisten = "127.0.0.1:0"\nlog_level = "warning"\n\n'
                    f'[database]\nurl = "{url}"\n\n[fleet]\nhost = "{HOST}"\n\n'
                    f'[[sources]]\ntype = "local"\npath = "{workdir / "watch"}"\n\n{workers_toml}'
                    '[rollout]\nhealth_poll_s = 3600\n\n'
                    '[checks]\nenabled = ["manifest", "headers", "crc32c", "compat", "finite", "headroom"]\n')  # fmt: skip
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--what", required=True)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory():
        run = probe(args.what, args.url, args.config)
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            run()
            took = RESULT.pop("s", time.perf_counter() - t0)
            sql = {k: round(RESULT.pop(k), 4) for k in ("cpu_s", "sql_s", "sql_max_s") if k in RESULT}
            print(json.dumps({"what": args.what, "s": round(took, 4), **sql}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
