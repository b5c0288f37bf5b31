"""The broadcast transport with real processes: a daemon, two reference workers and a trainer
process (`tests/support_broadcast.py`, `daemon.client.broadcast.BroadcastPush`) in one gloo group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.support_rollout import (
    REPO,
    WorkerPool,
    aliases,
    build_checkpoint,
    publish_into,
    rollouts,
    start_fleet,
    worker_events,
)

pytestmark = pytest.mark.timeout(600)
TRAINER = REPO / "tests" / "support_broadcast.py"
PROMPTS = [[1, 2, 3, 4], [200, 17, 5]]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path_factory.mktemp("pool"))
    yield p
    p.close()


@pytest.fixture
def fleet(tmp_path: Path, pool: WorkerPool, daemon_factory: Callable[..., Any]) -> Any:
    return start_fleet(daemon_factory, f"sqlite:///{tmp_path / 'registry.db'}", pool,
                       rollout={"mode": "pause", "health_window_s": 0.3})  # fmt: skip


def trainer(d: Any, weights: Path, version: str, out: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(TRAINER), "--state-dir", str(d.state_dir), "--weights", str(weights),
           "--version", version, "--out", str(out), *extra]  # fmt: skip
    run = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=timeout)
    if out.exists():  # what each push answered, for the assertion messages that print stdout
        run.stdout += f"\n{out.name}: {out.read_text()}"
    return run


def greedy(w: Any, prompt: list[int]) -> list[int]:
    r = httpx.post(f"{w.url}/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["choices"][0]["token_ids"]
    return tokens


def outputs(pool: WorkerPool) -> list[list[list[int]]]:
    return [[greedy(w, p) for p in PROMPTS] for w in pool.workers]


def checkpoint_row(d: Any, version: str) -> dict[str, Any]:
    from sqlalchemy import text

    with d.registry.engine.connect() as c:
        row = c.execute(text("SELECT * FROM checkpoints WHERE version = :v"), {"v": version}).mappings().one()
        return dict(row)


def test_a_broadcast_update_serves_exactly_what_a_disk_update_of_the_same_weights_serves(
    tmp_path: Path, pool: WorkerPool, fleet: Any
) -> None:
    d = fleet
    before = outputs(pool)
    weights = build_checkpoint(tmp_path / "w5", "w5", seed=5)
    run = trainer(d, weights, "bc-5", tmp_path / "out.json")
    assert run.returncode == 0, run.stdout + run.stderr
    (doc,) = json.loads((tmp_path / "out.json").read_text())
    assert doc["ok"], doc
    result = doc["result"]
    assert result["outcome"] == "succeeded"
    assert [w["ok"] for w in result["workers"]] == [True, True]
    broadcast = outputs(pool)
    assert broadcast != before
    for w in pool.workers:
        info = w.info()
        assert (info["version"], info["state"], info["transport"]) == ("bc-5", "RUNNING", "broadcast")
        assert info["digest"] == result["digest"]
    row = checkpoint_row(d, "bc-5")
    assert (row["source"], row["status"], row["digest"]) == ("broadcast", "deployed", result["digest"])
    assert row["digest"].startswith("broadcast-blake3:")
    assert aliases(d.registry)["serving"] == "bc-5"
    (rollout,) = [r for r in rollouts(d.registry) if r["id"] == result["rollout_id"]]
    assert (rollout["transport"], rollout["outcome"]) == ("broadcast", "succeeded")
    moves = {(e["worker"], e["to"]) for e in worker_events(d.registry, result["rollout_id"])}
    assert {(w.name, s) for w in pool.workers for s in ("PAUSED", "UPDATED", "RUNNING")} <= moves

    # the same weights from disk, through the ordinary pipeline
    publish_into(d.watch_dir, "disk-5", seed=5)
    d.wait_status("disk-5", "deployed", timeout=180)
    assert outputs(pool) == broadcast
    # the first worker kept the broadcast version on disk: an operator rollback re-installs it from there
    assert Path(row["local_path"], "model.safetensors").is_file()


def snapshot(pool: WorkerPool) -> list[tuple[str, str | None, int, str]]:
    return [(i["version"], i["digest"], i["update_count"], i["storage_id"]) for i in (w.info() for w in pool.workers)]


def test_a_wrong_table_is_refused_before_any_write(tmp_path: Path, pool: WorkerPool, fleet: Any) -> None:
    d = fleet
    before, served = snapshot(pool), outputs(pool)
    weights = build_checkpoint(tmp_path / "wide", "wide", seed=3, fault="shape")  # intermediate_size differs
    run = trainer(d, weights, "bc-wide", tmp_path / "out.json")
    assert run.returncode == 0, run.stdout + run.stderr
    (doc,) = json.loads((tmp_path / "out.json").read_text())
    assert not doc["ok"]
    result = doc["result"]
    assert result["outcome"] == "failed"
    errors = [w.get("error", "") for w in result["workers"]]
    assert all("shape" in e and "live" in e for e in errors), errors
    # nothing was written: same version, digest, update count and storage; same outputs
    assert snapshot(pool) == before
    assert outputs(pool) == served
    assert [w.info()["state"] for w in pool.workers] == ["RUNNING", "RUNNING"]
    assert checkpoint_row(d, "bc-wide")["status"] == "rejected"
    (rollout,) = [r for r in rollouts(d.registry) if r["id"] == result["rollout_id"]]
    assert rollout["outcome"] == "failed"
    assert aliases(d.registry)["serving"] == "v0"


def test_a_trainer_killed_mid_broadcast_leaves_every_worker_on_last_good(
    tmp_path: Path, pool: WorkerPool, fleet: Any
) -> None:
    d = fleet
    before, served = snapshot(pool), outputs(pool)
    weights = build_checkpoint(tmp_path / "w7", "w7", seed=7)
    timeout_s = 10.0
    run = trainer(d, weights, "bc-killed", tmp_path / "out.json", "--bucket-bytes", "8192",
                  "--kill-after-buckets", "3", "--timeout-s", str(timeout_s))  # fmt: skip
    assert run.returncode == -9, run.stdout + run.stderr
    session = next(line.split()[1] for line in run.stdout.splitlines() if line.startswith("session "))
    token = (d.state_dir / "control.token").read_text().strip()
    r = httpx.get(f"{d.api_url}/v1/broadcast/{session}", params={"wait_s": timeout_s * 3 + 30},
                  headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s * 3 + 60)  # fmt: skip
    assert r.status_code == 200, r.text  # the session ended (no hang) ...
    result = r.json()
    assert result["outcome"] == "failed"
    assert [w["restored_to"] for w in result["workers"]] == ["v0", "v0"]
    # ... with both workers serving the last good version, as before
    assert [w.info()["state"] for w in pool.workers] == ["RUNNING", "RUNNING"]
    assert [s[:2] for s in snapshot(pool)] == [s[:2] for s in before]
    assert outputs(pool) == served
    assert checkpoint_row(d, "bc-killed")["status"] == "rejected"
    assert aliases(d.registry)["last_good"] == "v0"


def test_twenty_broadcasts_in_a_row_leak_no_memory_or_descriptors(tmp_path: Path, pool: WorkerPool, fleet: Any) -> None:
    d = fleet
    procs = [psutil.Process(w.pid) for w in pool.workers]

    def usage() -> list[tuple[int, int, int]]:
        return [(p.memory_info().rss, p.num_fds(), p.num_threads()) for p in procs]

    weights = build_checkpoint(tmp_path / "w9", "w9", seed=9)
    run = trainer(d, weights, "warm", tmp_path / "warm.json", "--count", "3")  # first sessions allocate once
    assert run.returncode == 0, run.stdout + run.stderr
    warm = json.loads((tmp_path / "warm.json").read_text())
    assert all(doc["ok"] for doc in warm), [doc.get("error") or doc.get("result") for doc in warm if not doc["ok"]]
    start = usage()
    run = trainer(d, weights, "loop", tmp_path / "loop.json", "--count", "20", timeout=500)
    assert run.returncode == 0, run.stdout + run.stderr
    docs = json.loads((tmp_path / "loop.json").read_text())
    assert [doc["ok"] for doc in docs] == [True] * 20, [doc.get("error") for doc in docs if not doc["ok"]]
    end = usage()
    for (rss0, fds0, th0), (rss1, fds1, th1), w in zip(start, end, pool.workers, strict=True):
        assert fds1 <= fds0 + 2, f"{w.name}: {fds0} -> {fds1} open descriptors"
        assert th1 <= th0 + 2, f"{w.name}: {th0} -> {th1} threads"
        assert rss1 - rss0 < 8 << 20, f"{w.name}: RSS grew {(rss1 - rss0) / 2**20:.1f} MiB over 20 broadcasts"
        assert w.info()["version"] == "loop-20"
    print("usage before/after 20 broadcasts:", start, end)


def test_a_worker_killed_mid_broadcast_ends_with_every_worker_on_last_good(
    tmp_path: Path, pool: WorkerPool, fleet: Any
) -> None:
    d = fleet
    served = outputs(pool)
    weights = build_checkpoint(tmp_path / "w8", "w8", seed=8)
    victim = pool.workers[1]
    run = trainer(d, weights, "bc-worker-died", tmp_path / "out.json", "--bucket-bytes", "8192",
                  "--kill-after-buckets", "3", "--kill-pid", str(victim.pid), "--timeout-s", "10")  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (doc,) = json.loads((tmp_path / "out.json").read_text())
    assert not doc["ok"]
    result = doc["result"]
    assert result["outcome"] == "failed"
    assert [w["restored_to"] for w in result["workers"]] == ["v0", "v0"]  # the dead one restarted on v0
    for w in pool.workers:
        info = w.wait_running(60, version="v0")
        assert info["version"] == "v0"
    assert outputs(pool) == served
    assert checkpoint_row(d, "bc-worker-died")["status"] == "rejected"
