"""Rollback and restart targets: never onto missing or changed files, never killing a healthy worker.

Finding 7 end to end (real daemon, real workers): with last good's directory deleted, a failed
rollout leaves the current workers serving (no restart, no relaunch loop). Then the managed
worker's relaunch guard, with a real child process standing in for the worker.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import DaemonProcess, hotswap_cli, wait_until
from support_check import expect_of, flip_byte
from support_rollout import (
    WorkerPool,
    aliases,
    assert_fleet_on,
    publish_into,
    rollouts,
    start_fleet,
    wait_passes,
    worker_events,
)

from bench.loadgen import LoadGen
from daemon.config import WorkerSpec
from daemon.formats.checkpoint import tensor_table
from daemon.rollout.managed import ManagedWorker, Restarter, target_problem
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(600)

FEW_CHECKS = {"enabled": ["manifest", "headers", "crc32c"]}
# restart_rollouts = false: a checkpoint of other shapes is refused by the workers, not relaunched on
FAST = {"health_window_s": 0.3, "restart_timeout_s": 60.0, "restart_rollouts": False}


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path_factory.mktemp("pool"))
    yield p
    p.close()


def test_failed_rollout_with_last_good_deleted_leaves_the_workers_serving(
    tmp_path: Path, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = start_fleet(daemon_factory, f"sqlite:///{tmp_path / 'r.db'}", pool, rollout=FAST, checks=FEW_CHECKS)
    w0, w1 = pool.workers
    pids = (w0.pid, w1.pid)
    shutil.rmtree(d.watch_dir / "v0")  # last good's directory is gone
    publish_into(d.watch_dir, "v1", seed=1, fault="shape")  # the workers refuse it
    d.wait_status("v1", "rejected", timeout=240)
    assert_fleet_on([w0, w1], "v0")  # still serving what they had in memory
    assert (w0.pid, w1.pid) == pids, "a healthy worker was restarted"
    (r,) = [r for r in rollouts(d.registry) if r["version"] == "v1"]
    actions = [e["detail"].get("action") for e in worker_events(d.registry, r["id"])]
    assert "restart" not in actions, actions
    assert w0.info()["state"] == "RUNNING" and w1.info()["state"] == "RUNNING"


def test_health_window_rollback_with_last_good_deleted_keeps_the_workers_serving(
    tmp_path: Path, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """Finding 7 as reported: the automatic rollback used to send every worker to the missing
    directory, then restart them onto it in a loop, and record the missing version as serving."""
    rollout = {**FAST, "health_window_s": 3.0, "max_error_rate": 0.01, "min_window_requests": 1}
    d = start_fleet(daemon_factory, f"sqlite:///{tmp_path / 'r.db'}", pool, rollout=rollout, checks=FEW_CHECKS)
    w0, w1 = pool.workers
    body = {"prompt": [1, 200, 5], "max_tokens": 2, "temperature": 1.0, "ignore_eos": True}
    with LoadGen([w0.url, w1.url], concurrency=2, body=body, max_seconds=400) as load:
        load.wait_requests(5)
        shutil.rmtree(d.watch_dir / "v0")
        publish_into(d.watch_dir, "v1", seed=1, fault="nan-token:200")  # fails its health window
        wait_until(lambda: "no earlier version" in ((d.row("v1") or {}).get("status_message") or ""), 240,
                   what="the health window verdict")  # fmt: skip
        pids = (w0.pid, w1.pid)
        wait_passes(d, "health_poll", 3)  # a restart loop, if any, starts from the poll
    assert_fleet_on([w0, w1], "v1")  # nothing usable to go back to: the workers keep serving
    assert (w0.pid, w1.pid) == pids, "a worker was restarted"
    assert aliases(d.registry)["serving"] == "v1"
    for r in rollouts(d.registry):
        actions = [e["detail"].get("action") for e in worker_events(d.registry, r["id"])]
        assert "restart" not in actions, (r, actions)


def test_rollback_to_a_version_changed_since_verify_is_refused_and_the_fleet_keeps_serving(
    tmp_path: Path, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """Finding 2 through the daemon: `hotswap rollback --to v0` after a byte of v0 was flipped
    (the daemon sends v0's verified per-file digests; every worker refuses the changed bytes)."""
    d = start_fleet(daemon_factory, f"sqlite:///{tmp_path / 'r.db'}", pool, rollout=FAST, checks=FEW_CHECKS)
    publish_into(d.watch_dir, "v1", seed=1)
    d.wait_status("v1", "deployed", timeout=180)
    wait_until(lambda: aliases(d.registry).get("last_good") == "v1", 60, what="v1's health window")
    on_v1 = [w.info()["digest"] for w in pool.workers]
    table, _ = tensor_table(d.watch_dir / "v0")
    loc = table["lm_head.weight"]
    flip_byte(loc.file, loc.entry.start + loc.entry.nbytes // 3)
    out = hotswap_cli("rollback", "--to", "v0", "-c", str(d.config_path))
    assert out.returncode != 0 or "failed" in out.stdout, out.stdout + out.stderr
    assert_fleet_on(pool.workers, "v1")
    assert [w.info()["digest"] for w in pool.workers] == on_v1
    (r,) = [r for r in rollouts(d.registry) if r["version"] == "v0" and r["trigger"] == "rollback"]
    assert r["outcome"] == "failed" and "does not match the verified" in str(r["detail"]), r


@pytest.fixture
def child(tmp_path: Path) -> Iterator[ManagedWorker]:
    """A ManagedWorker whose child is a real, healthy process (a sleeper standing in for it)."""
    m = ManagedWorker(WorkerSpec(name="m0", launch="managed", port=1), tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    m._proc, m.pid, m.model, m.version = proc, proc.pid, str(tmp_path / "gone"), "v0"
    yield m
    proc.kill()
    proc.wait(10)


def test_relaunch_never_stops_a_live_child_for_missing_or_changed_files(child: ManagedWorker, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="is missing"):
        child.relaunch(str(tmp_path / "nowhere"), "v9")
    assert child.alive()
    good = make_tiny_checkpoint(tmp_path / "v1", seed=1)
    expect = expect_of(good)
    table, _ = tensor_table(good)
    loc = next(iter(table.values()))
    flip_byte(loc.file, loc.entry.start)
    assert "changed since it was verified" in (target_problem(str(good), expect) or "")
    with pytest.raises(RuntimeError, match="changed since it was verified"):
        child.relaunch(str(good), "v1", expect)
    assert child.alive()
    # no version to go to: the restarter leaves the running child alone
    out = Restarter().restart(child.spec, child.url, child, None)
    assert out["issued"] is False and "left as it is" in out["error"] and child.alive()


def test_target_problem_accepts_matching_files(tmp_path: Path) -> None:
    good = make_tiny_checkpoint(tmp_path / "v1", seed=1)
    assert target_problem(str(good), expect_of(good)) is None
    assert target_problem(str(good), expect_of(good, "sha256")) is None
    assert target_problem(str(good), expect_of(good, crc_only=True)) is None
    assert target_problem(str(good), None) is None
