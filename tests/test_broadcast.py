"""The broadcast transport with real processes: a daemon, two reference workers and a trainer
process (`tests/support_broadcast.py`, `daemon.client.BroadcastPush`) in one gloo group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
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
    return subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=timeout)


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
