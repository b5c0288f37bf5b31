"""Fill a registry with years of realistic history, fast: the data behind bench/registry_scale.py.

    fill(url, n)   the schema by the daemon's own migrations (Registry.upgrade), then n versions:

- one version every 5 minutes, the newest at 2026-12-03 00:00 UTC (100,000: a year of online RL);
- statuses as a long run leaves them: ~85 % retired (verified, rolled out to 2 workers, replaced),
  6 % rejected by a check, 2 % rejected by the health window after deploy (rollout
  `rolled_back`, a `rolled_back` event), 5 % superseded, 2 % duplicate; the newest serving;
- per version 3 `checkpoint_files` rows, a `checks` row per check run (7 when it passed them
  all), one rollout when it was deployed, the status events the daemon writes (discovered ->
  verifying -> verified -> deployed -> retired) plus 3 worker transitions per worker and rollout
  (~10 events), and this host's `checkpoint_locations` row;
- (`make_folders`: the newest versions' folders with their files, sparse; registry_scale makes 60)
- 5 hosts (`bench-0` did every rollout; `bench-1` serves the newest too, `bench-2` one behind
  and waiting, `bench-3` pinned 50 versions back, `bench-4` just joined and serves nothing yet),
  2 workers each, their aliases.

Rows go in with COPY (PostgreSQL) or executemany (SQLite) in large transactions, with the
secondary indexes dropped during the load and built again after it (the same DDL, read back
from the database), then ANALYZE: nothing goes through the daemon's per-row code.
"""

from __future__ import annotations

import json
import random
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from daemon.registry import Registry

HOST = "bench-0"
OTHER_HOSTS = ("bench-1", "bench-2", "bench-3")
NEW_HOST = "bench-4"  # joined the fleet just now: workers registered, nothing served yet
WORKERS = ("w0", "w1")
NEWEST = datetime(2026, 12, 3, tzinfo=UTC).timestamp()
EVERY_S = 300.0
CHUNK = 20_000  # versions per batch of rows
SOURCE = "local:/data/ckpt"
CHECKS = (("manifest", 2.1, '{"files": 3, "signed": true}'), ("headers", 1.3, '{"tensors": 291}'),
          ("crc32c", 610.0, '{"bytes": 16060000000, "threads": 2}'), ("compat", 4.8, '{"tensors": 291}'),
          ("finite", 930.0, '{"tensors": 291}'), ("headroom", 0.2, '{"need_bytes": 24090000000}'),
          ("forward", 2480.0, '{"prompts": 3, "top1": 1.0}'))  # fmt: skip
FILES = (("config.json", 712), ("model-00001-of-00002.safetensors", 9_960_000_000),
         ("model-00002-of-00002.safetensors", 6_100_000_000))  # each version's, as checkpoint_files lists them
REJECTIONS = ((2, "crc32c: model-00001-of-00002.safetensors: crc32c 1a2b3c4d does not match the manifest's 8f3a21c0 "
                  "(file corrupted)"),
              (4, "finite: model.layers.7.mlp.down_proj.weight has 12 NaN"),
              (6, "forward: logits not finite on prompt 2"))  # fmt: skip
TABLES = {  # table -> columns, in the order the generator writes them
    "checkpoints": ("id", "version", "source", "uri", "local_path", "commit_signal", "step", "parent", "digest",
                    "total_bytes", "tensor_count", "status", "status_message", "discovered_at", "verified_at",
                    "deployed_at", "last_deployed_at", "last_good_at"),
    "checkpoint_files": ("id", "checkpoint_id", "path", "bytes", "crc32c", "hash_alg", "hash"),
    "checks": ("id", "checkpoint_id", "name", "ok", "deferred", "status", "detail", "started_at", "duration_ms"),
    "rollouts": ("id", "checkpoint_id", "host", "trigger", "transport", "mode", "started_at", "finished_at",
                 "outcome", "detail"),
    "events": ("id", "at", "host", "rollout_id", "checkpoint_id", "worker", "from_state", "to_state", "duration_ms",
               "detail"),
    "checkpoint_locations": ("checkpoint_id", "host", "local_path", "recorded_at"),
}  # fmt: skip


@dataclass
class Dialect:
    ts: Callable[[float], str]
    true: Any
    false: Any


def _sqlite_ts(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}"


def _pg_ts(t: float) -> str:
    return _sqlite_ts(t) + "+00"


def make_folders(root: Path, first: int, last: int) -> None:
    """The folders of versions first..last with their files at the recorded sizes (sparse: no disk
    used), so what a daemon checks before it offers a version (stat, sizes) finds them whole."""
    for i in range(max(1, first), last + 1):
        folder = root / version_name(i)
        folder.mkdir(parents=True, exist_ok=True)
        for name, size in FILES:
            with open(folder / name, "ab") as f:
                f.truncate(size)


def version_name(i: int) -> str:
    return f"step-{i * 100}"


def serving_index(n: int, host: str) -> int:
    """The version index each host serves (and has as last_good)."""
    return {"bench-2": n - 1, "bench-3": n - 50}.get(host, n)


def _fate(rng: random.Random, i: int, n: int) -> str:
    if i in (n, n - 1, n - 50):
        return "retired"  # served somewhere now: deployed cleanly
    r = rng.random()
    return ("rejected" if r < 0.06 else "rolled_back" if r < 0.08 else "superseded" if r < 0.13
            else "duplicate" if r < 0.15 else "retired")  # fmt: skip


def generate(n: int, d: Dialect, root: str, seed: int = 28) -> Iterator[dict[str, list[tuple[Any, ...]]]]:
    """Rows for versions 1..n, CHUNK versions at a time."""
    rng = random.Random(seed)
    ids = {"checkpoint_files": 0, "checks": 0, "rollouts": 0, "events": 0}

    def next_id(table: str) -> int:
        ids[table] += 1
        return ids[table]

    for lo in range(1, n + 1, CHUNK):
        rows: dict[str, list[tuple[Any, ...]]] = {t: [] for t in TABLES}
        for i in range(lo, min(lo + CHUNK, n + 1)):
            _version(i, n, rng, d, root, rows, next_id)
        yield rows


def _version(i: int, n: int, rng: random.Random, d: Dialect, root: str, rows: dict[str, list[tuple[Any, ...]]],
             next_id: Callable[[str], int]) -> None:  # fmt: skip
    fate = _fate(rng, i, n)
    v, t = version_name(i), NEWEST - (n - i) * EVERY_S
    path = f"{root}/{v}"
    verified = fate in ("retired", "rolled_back", "superseded")
    deployed = fate in ("retired", "rolled_back")
    reason: str | None = None
    checks: tuple[tuple[str, float, str], ...] = CHECKS
    if fate == "rejected":
        k, reason = REJECTIONS[rng.randrange(len(REJECTIONS))]
        checks = CHECKS[: k + 1]
    elif fate == "duplicate":
        checks, reason = CHECKS[:3], f"same content as {version_name(max(1, i - 1))}"
    elif fate == "rolled_back":
        reason = "health window: w1 failed 4.2 % of 120 requests (bound 1 %); rolled back to last good"
    elif fate == "superseded":
        reason = f"superseded by {version_name(i + 1)} before it was deployed"
    serving = i in (n, n - 1, n - 50)  # a version some host serves is never retired
    status = {"retired": "deployed" if serving else "retired", "rolled_back": "rejected"}.get(fate, fate)
    ev = rows["events"]

    def event(at: float, frm: str | None, to: str, *, cid: int | None = i, rid: int | None = None,
              worker: str | None = None, ms: float | None = None, detail: str | None = None) -> None:  # fmt: skip
        ev.append((next_id("events"), d.ts(at), HOST, rid, cid, worker, frm, to, ms, detail))

    event(t, None, "discovered", detail=f'{{"source": "{SOURCE}", "signal": "manifest"}}')
    event(t + 1, "discovered", "verifying")
    started = t + 1.5
    for name, ms, detail in checks:
        ok = not (reason and fate == "rejected" and name == checks[-1][0])
        rows["checks"].append((next_id("checks"), i, name, d.true if ok else d.false, d.false, "pass" if ok else "fail",
                               detail, d.ts(started), ms * (0.8 + 0.4 * rng.random())))  # fmt: skip
        started += ms / 1000
    if not verified:
        event(started, "verifying", fate, ms=(started - t) * 1000, detail=json.dumps({"message": reason}))
    else:
        event(started, "verifying", "verified", ms=(started - t) * 1000)
    if deployed:
        rid = next_id("rollouts")
        at = started + 1
        for w in WORKERS:
            event(at, "RUNNING", "DRAINING", cid=None, rid=rid, worker=w, ms=0.0)
            event(at + 0.5, "DRAINING", "UPDATED", cid=None, rid=rid, worker=w, ms=400 + 100 * rng.random())
            event(at + 0.7, "UPDATED", "RUNNING", cid=None, rid=rid, worker=w, ms=150 + 50 * rng.random())
            at += 1.5
        event(at, "verified", "deployed")
        outcome = "succeeded"
        if fate == "rolled_back":
            outcome = "rolled_back"
            event(at + 3, None, "rolled_back", rid=rid, detail='{"by": "health_window"}')
            event(at + 3.1, "deployed", "rejected", detail=json.dumps({"message": reason}))
        elif not serving:
            event(t + EVERY_S + 45, "deployed", "retired", detail='{"message": "replaced"}')
        rows["rollouts"].append((rid, i, HOST, "new", "disk", "copy", d.ts(started + 1), d.ts(at), outcome,
                                 '{"workers": 2}'))  # fmt: skip
    elif fate == "superseded":
        event(t + EVERY_S, "verified", "superseded", detail=json.dumps({"message": reason}))
    vt = d.ts(started) if verified else None
    dt = d.ts(started + 4) if deployed else None
    good = d.ts(started + 10) if fate == "retired" else None
    rows["checkpoints"].append((i, v, SOURCE, f"file://{path}", path, "manifest", i * 100, version_name(i - 1) if i > 1
                                else None, f"blake3:{rng.getrandbits(256):064x}", 16060000000, 291, status, reason,
                                d.ts(t), vt, dt, dt, good))  # fmt: skip
    for name, size in FILES:
        rows["checkpoint_files"].append((next_id("checkpoint_files"), i, name, size, f"{rng.getrandbits(32):08x}",
                                         "blake3", f"{rng.getrandbits(256):064x}"))  # fmt: skip
    rows["checkpoint_locations"].append((i, HOST, path, d.ts(t)))


def _small_rows(n: int, d: Dialect, root: str) -> dict[str, list[tuple[Any, ...]]]:
    """Hosts, workers, aliases and the one host's reason for being behind."""
    now = d.ts(NEWEST + 60)
    out: dict[str, list[tuple[Any, ...]]] = {"workers": [], "aliases": [], "checkpoint_locations": [],
                                             "fleet_host_reasons": []}  # fmt: skip
    wid = 0
    for host in (HOST, *OTHER_HOSTS, NEW_HOST):
        k = serving_index(n, host)
        for w in WORKERS:
            wid += 1
            out["workers"].append((wid, host, w, "builtin", f"http://{host}:{8100 + wid}", "cuda:0", "RUNNING",
                                   None if host == NEW_HOST else version_name(k), None, now))  # fmt: skip
        if host == NEW_HOST:
            continue
        names = ("serving", "last_good", "pinned") if host == "bench-3" else ("serving", "last_good")
        out["aliases"] += [(host, name, k, now) for name in names]
        if host != HOST:
            out["checkpoint_locations"].append((k, host, f"{root}/{version_name(k)}", now))
    out["fleet_host_reasons"].append(("bench-2", version_name(n), "waiting", f"bench-2 serves {version_name(n - 1)}, "
                                      f"not the fleet target {version_name(n)}: waiting for a lease", now, now))  # fmt: skip
    return out


SMALL_COLUMNS = {
    "workers": ("id", "host", "name", "kind", "url", "device", "state", "weight_version", "last_error", "updated_at"),
    "aliases": ("host", "name", "checkpoint_id", "updated_at"),
    "checkpoint_locations": TABLES["checkpoint_locations"],
    "fleet_host_reasons": ("host", "target", "cause", "reason", "since", "updated_at"),
}


# migration 0012's counts of checkpoints by status, when the schema has them: the load bypassed its triggers
RECOUNT = ("UPDATE checkpoint_status_counts SET n = (SELECT COUNT(*) FROM checkpoints c "
           "WHERE c.status = checkpoint_status_counts.status)")  # fmt: skip


def _has_counts(run: Callable[[str], Any], sqlite: bool = False) -> bool:
    found = run("SELECT name FROM sqlite_master WHERE name = 'checkpoint_status_counts'" if sqlite
                else "SELECT to_regclass('checkpoint_status_counts')").fetchone()  # fmt: skip
    return found is not None and found[0] is not None


def fill(url: str, n: int, root: str = "/data/ckpt", log: Callable[[str], None] = print) -> dict[str, Any]:
    """Migrate `url` (empty) to the daemon's head and load `n` versions whose directories are
    `<root>/<version>` (none is made); returns counts and seconds."""
    t0 = time.perf_counter()
    reg = Registry(url, host=HOST)
    reg.upgrade()
    reg.close()
    sqlite = make_url(url).get_backend_name() == "sqlite"
    counts = (_fill_sqlite if sqlite else _fill_postgres)(url, n, root, log)
    return {"versions": n, "rows": counts, "fill_s": round(time.perf_counter() - t0, 1)}


def _fill_sqlite(url: str, n: int, root: str, log: Callable[[str], None]) -> dict[str, int]:
    db = sqlite3.connect(make_url(url).database or "", isolation_level=None)
    db.execute("PRAGMA journal_mode=OFF")
    db.execute("PRAGMA synchronous=OFF")
    db.execute("PRAGMA cache_size=-1000000")
    indexes = db.execute("SELECT type, name, sql FROM sqlite_master WHERE type IN ('index', 'trigger') "
                         "AND sql IS NOT NULL").fetchall()  # fmt: skip
    for kind, name, _ in indexes:
        db.execute(f'DROP {kind.upper()} "{name}"')
    counts: dict[str, int] = {}

    def load(table: str, cols: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
        db.executemany(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", rows)
        counts[table] = counts.get(table, 0) + len(rows)

    d = Dialect(_sqlite_ts, 1, 0)
    db.execute("BEGIN")
    for rows in generate(n, d, root):
        for table, cols in TABLES.items():
            load(table, cols, rows[table])
        log(f"  sqlite: {counts['checkpoints']:,} versions")
    for table, small in _small_rows(n, d, root).items():
        load(table, SMALL_COLUMNS[table], small)
    db.execute("COMMIT")
    for kind, name, sql in indexes:
        log(f"  sqlite: {kind} {name}")
        db.execute(sql)
    if _has_counts(db.execute, sqlite=True):
        db.execute(RECOUNT)
    db.execute("ANALYZE")
    db.execute("PRAGMA journal_mode=WAL")
    db.close()
    return counts


def _fill_postgres(url: str, n: int, root: str, log: Callable[[str], None]) -> dict[str, int]:
    engine = create_engine(url)
    counts: dict[str, int] = {}
    with engine.begin() as conn:
        conn.execute(text("SET session_replication_role = replica"))  # no FK triggers during the load
        conn.execute(text("SET maintenance_work_mem = '512MB'"))
        indexes = conn.execute(text(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' AND indexname NOT IN "
            "(SELECT conname FROM pg_constraint)")).all()  # fmt: skip
        for name, _ in indexes:
            conn.execute(text(f'DROP INDEX "{name}"'))
        cur = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]

        def load(table: str, cols: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
            with cur.copy(f"COPY {table} ({', '.join(cols)}) FROM STDIN") as copy:
                copy.write("".join("\t".join("\\N" if v is None else str(v) for v in r) + "\n" for r in rows))
            counts[table] = counts.get(table, 0) + len(rows)

        d = Dialect(_pg_ts, "t", "f")
        for rows in generate(n, d, root):
            for table, cols in TABLES.items():
                load(table, cols, rows[table])
            log(f"  postgresql: {counts['checkpoints']:,} versions")
        for table, small in _small_rows(n, d, root).items():
            load(table, SMALL_COLUMNS[table], small)
        for name, sql in indexes:
            log(f"  postgresql: index {name}")
            conn.execute(text(sql))
        if _has_counts(lambda q: conn.execute(text(q))):  # COPY ran without triggers (replica role)
            conn.execute(text(RECOUNT))
        for table in ("checkpoints", "checkpoint_files", "checks", "rollouts", "events", "workers"):
            conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT MAX(id) FROM {table}))"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))
    engine.dispose()
    return counts
