"""Real faults during rollouts: each leaves every worker RUNNING on one version, with the history
explaining what happened.

The faults are real: SIGKILLed worker and daemon processes, a worker refusing an update, a
checkpoint whose probe generation is not finite, requests failing after a deploy. The daemon's
checks are cut down to manifest/headers/crc32c here so the bad checkpoints reach the workers
(the compat/finite/forward checks would reject them first, as they should in production).
The test-only hold (HOTSWAP_TEST_HOLD_*, read by tests/hooked_daemon.py, which installs it as a
transition observer) only freezes the daemon at an exact transition so the fault can be delivered there.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import DaemonProcess, hotswap_cli, wait_until
from support_rollout import (
    WorkerPool,
    aliases,
    assert_fleet_on,
    build_checkpoint,
    publish_into,
    rollouts,
    spawn_worker,
    start_fleet,
    wait_passes,
    worker_events,
    worker_paths,
    worker_row,
)

from bench.loadgen import LoadGen
from tests.controller.test_health_counts import assert_counts_add_up

pytestmark = pytest.mark.timeout(600)

FEW_CHECKS = {"enabled": ["manifest", "headers", "crc32c"]}
# restart_rollouts = false: a checkpoint of other shapes is refused (the path tested here), not relaunched on
FAST = {"health_window_s": 0.3, "restart_timeout_s": 180.0, "restart_rollouts": False}


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path_factory.mktemp("pool"))
    yield p
    p.close()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'registry.db'}"


def hold(state: str, worker: str, version: str | None, release: Path | None = None) -> dict[str, str]:
    env = {"HOTSWAP_TEST_HOLD_STATE": state, "HOTSWAP_TEST_HOLD_WORKER": worker}
    if version is not None:
        env["HOTSWAP_TEST_HOLD_VERSION"] = version
    if release is not None:
        env["HOTSWAP_TEST_HOLD_RELEASE"] = str(release)
    return env


def rollout_of(d: DaemonProcess, version: str, trigger: str = "new") -> dict[str, Any]:
    (r,) = [r for r in rollouts(d.registry) if r["version"] == version and r["trigger"] == trigger]
    return r


def transitions(d: DaemonProcess, rollout_id: int, worker: str) -> list[tuple[str, str, str]]:
    """(from, to, action-or-step) of one worker's events in one rollout."""
    return [
        (e["from"], e["to"], e["detail"].get("action") or e["detail"].get("step") or "")
        for e in worker_events(d.registry, rollout_id)
        if e["worker"] == worker
    ]


def status_history(d: DaemonProcess, version: str) -> list[str]:
    from sqlalchemy import select

    from daemon.registry.models import Checkpoint, Event

    with d.registry.session() as s:
        return list(s.scalars(select(Event.to_state).join(Checkpoint, Checkpoint.id == Event.checkpoint_id)
                              .where(Checkpoint.version == version, Event.worker.is_(None)).order_by(Event.id)))


FORWARD = [("RUNNING", "DRAINING", ""), ("DRAINING", "UPDATED", ""), ("UPDATED", "RUNNING", "")]


def test_worker_killed_mid_update_comes_back_on_last_good_and_the_version_is_retried(
    tmp_path: Path, sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """Findings 9: a worker SIGKILLed mid-rollout is the fleet's fault, not v1's: the fleet comes
    back whole on v0, v1 stays verified (never rejected), is rolled out again and ends serving."""
    release = tmp_path / "release"
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout=FAST, checks=FEW_CHECKS,
                    hooked=True, env=hold("DRAINING", "w1", "v1", release))  # fmt: skip
    w0, w1 = pool.workers
    publish_into(d.watch_dir, "v1", seed=1)
    wait_until(lambda: w1.info()["state"] == "DRAINING", 120, what="w1 draining for v1")
    old_pid = w1.kill()  # a real crash in the middle of its update
    release.touch()

    wait_until(lambda: len([r for r in rollouts(d.registry) if r["version"] == "v1"]) >= 2, 240, what="v1 retried")
    row = d.wait_status("v1", "deployed", timeout=240)
    assert_fleet_on([w0, w1], "v1")
    assert w1.pid != old_pid, "the restart command relaunched w1"
    first, retry = [r for r in rollouts(d.registry) if r["version"] == "v1"]
    assert first["outcome"] == "failed" and retry["outcome"] == "succeeded"
    assert (first["detail"]["worker"], first["detail"]["step"], first["detail"]["kind"]) == ("w1", "update", "unreachable")
    assert first["detail"]["rolled_back"] == ["w0"] and first["detail"]["unrecovered"] == []
    assert transitions(d, first["id"], "w1") == [
        ("RUNNING", "DRAINING", ""),
        ("DRAINING", "UNHEALTHY", "update"),
        ("UNHEALTHY", "UNHEALTHY", "restore_failed"),
        ("UNHEALTHY", "UNHEALTHY", "restart"),
        ("UNHEALTHY", "RUNNING", "restored"),
    ]
    assert transitions(d, first["id"], "w0") == FORWARD + FORWARD  # to v1, then back to v0
    assert transitions(d, retry["id"], "w0") == FORWARD and transitions(d, retry["id"], "w1") == FORWARD
    assert "rejected" not in status_history(d, "v1"), status_history(d, "v1")
    assert row["status"] == "deployed"
    wait_until(lambda: aliases(d.registry).get("serving") == "v1", 60, what="v1 serving")


def test_a_version_that_crashes_a_worker_every_time_is_rejected_after_max_infra_retries(
    tmp_path: Path, sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """A crash is first taken for the fleet's fault (retried), but not forever: w1 really dies in
    the middle of every update to v1, and after max_infra_retries retries v1 is rejected with the
    reason, while the fleet is whole on v0 again each time."""
    release = tmp_path / "release"
    env = {**hold("DRAINING", "w1", "v1", release), "HOTSWAP_TEST_HOLD_EVERY": "1"}
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout={**FAST, "max_infra_retries": 1}, checks=FEW_CHECKS,
                    hooked=True, env=env)  # fmt: skip
    w0, w1 = pool.workers
    publish_into(d.watch_dir, "v1", seed=1)
    for attempt in (1, 2):  # the rollout, then its one retry
        wait_until(lambda: w1.info()["state"] == "DRAINING", 240, what=f"w1 draining for v1 (attempt {attempt})")
        w1.kill()
        release.with_name(f"{release.name}.{attempt}").touch()
        ended = lambda n=attempt: len([r for r in rollouts(d.registry) if r["version"] == "v1" and r["outcome"]]) >= n  # noqa: E731
        wait_until(ended, 240, what=f"attempt {attempt} to end")
    row = d.wait_status("v1", "rejected", timeout=240)
    assert "gave up after 1 retries" in row["status_message"], row["status_message"]
    tries = [r for r in rollouts(d.registry) if r["version"] == "v1"]
    assert [(r["outcome"], r["detail"]["kind"]) for r in tries] == [("failed", "unreachable")] * 2, tries
    wait_until(lambda: w1.info()["state"] == "RUNNING", 240, what="w1 relaunched")
    assert_fleet_on([w0, w1], "v0")
    assert aliases(d.registry)["serving"] == "v0"


def test_a_worker_that_dies_inside_the_health_window_rolls_the_version_back(
    sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """w1 is SIGKILLed once v1 is deployed, inside a 30 s health window: the window fails on the
    worker that does not answer, w1 is relaunched, the fleet is whole on v0 again, and with no
    retries left v1 is rejected, the reason naming the silent worker."""
    d = start_fleet(daemon_factory, sqlite_url, pool, checks=FEW_CHECKS,
                    rollout={**FAST, "health_window_s": 30.0, "max_infra_retries": 0})  # fmt: skip
    w0, w1 = pool.workers
    publish_into(d.watch_dir, "v1", seed=1)
    d.wait_status("v1", "deployed", timeout=240)
    assert aliases(d.registry).get("last_good") == "v0", "v1's window ended before the worker was killed"
    w1.kill()
    row = d.wait_status("v1", "rejected", timeout=240)
    # "did not answer at the start of" or "stopped answering during": the kill lands at either
    assert re.search(r"worker w1 (did not answer at the start of|stopped answering during) the health window",
                     row["status_message"]), row["status_message"]  # fmt: skip
    assert "gave up after 0 retries" in row["status_message"], row["status_message"]
    (r,) = [r for r in rollouts(d.registry) if r["version"] == "v1"]
    assert r["outcome"] == "rolled_back" and r["detail"]["health_window"].get("ok") is not True, r
    wait_until(lambda: w1.info()["state"] == "RUNNING", 240, what="w1 relaunched")
    assert_fleet_on([w0, w1], "v0")
    # the alias follows the rollback's last worker (within a second here)
    wait_until(lambda: aliases(d.registry)["serving"] == "v0", 60, what=f"serving = v0: {aliases(d.registry)}")
    assert aliases(d.registry)["last_good"] == "v0"


def test_refused_update_leaves_the_fleet_on_the_old_version(
    sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout=FAST, checks=FEW_CHECKS)
    w0, w1 = pool.workers
    publish_into(d.watch_dir, "v1", seed=1, fault="shape")  # other shapes: the worker must refuse
    row = d.wait_status("v1", "rejected", timeout=180)
    assert "HTTP 409" in row["status_message"] and "v0" in row["status_message"]
    assert_fleet_on([w0, w1], "v0")
    r = rollout_of(d, "v1")
    assert (r["outcome"], r["detail"]["kind"], r["detail"]["step"]) == ("failed", "refused", "update")
    assert transitions(d, r["id"], "w0") == [  # refused and kept serving v0: never UNHEALTHY (issue 21)
        ("RUNNING", "DRAINING", ""),
        ("DRAINING", "RUNNING", "refused"),
    ]
    assert transitions(d, r["id"], "w1") == []  # the first failure stops the rollout


IN_PAUSE = {**FAST, "probe_after_resume": False}  # the probe while requests are held, then UPDATED -> RUNNING


def test_a_probe_failing_after_resume_flips_the_worker_back_and_fails_the_rollout(
    sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """The default (issue 41): the worker resumes right after its write and probes serving; the
    NaN version's probe fails, the worker flips itself back to v0 (no restore by the daemon) and the
    rollout fails before w1 is touched."""
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout=FAST, checks=FEW_CHECKS)
    w0, w1 = pool.workers
    publish_into(d.watch_dir, "v1", seed=1, fault="nan")
    row = d.wait_status("v1", "rejected", timeout=180)
    assert "probe after resume failed" in row["status_message"] and "back on v0" in row["status_message"], row
    assert_fleet_on([w0, w1], "v0")
    r = rollout_of(d, "v1")
    assert (r["outcome"], r["detail"]["step"]) == ("failed", "update")
    events = [e for e in worker_events(d.registry, r["id"]) if e["worker"] == "w0"]
    assert [(e["from"], e["to"]) for e in events] == [("RUNNING", "DRAINING"), ("DRAINING", "RUNNING")]
    assert events[-1]["detail"]["action"] == "refused" and events[-1]["detail"]["kept"] == "v0"
    flips = [e for e in w0.info()["events"] if e["event"] == "flipped_back"]
    assert flips and (flips[-1]["version"], flips[-1]["bad"]) == ("v0", "v1")
    assert transitions(d, r["id"], "w1") == []


def test_probe_failure_restores_the_last_good_version(
    sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout=IN_PAUSE, checks=FEW_CHECKS)
    w0, w1 = pool.workers
    publish_into(d.watch_dir, "v1", seed=1, fault="nan")
    row = d.wait_status("v1", "rejected", timeout=180)
    assert "non-finite" in row["status_message"]
    assert_fleet_on([w0, w1], "v0")
    r = rollout_of(d, "v1")
    assert (r["outcome"], r["detail"]["step"]) == ("failed", "post_check")
    events = [e for e in worker_events(d.registry, r["id"]) if e["worker"] == "w0"]
    assert [(e["from"], e["to"]) for e in events] == [
        ("RUNNING", "DRAINING"), ("DRAINING", "UPDATED"), ("UPDATED", "UNHEALTHY"), ("UNHEALTHY", "RUNNING"),
    ]  # fmt: skip
    assert events[-1]["detail"]["restored_to"] == "v0" and "update to v0" in events[-1]["detail"]["how"]


def test_error_rate_spike_after_deploy_rolls_back(
    sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    rollout = {**FAST, "health_window_s": 3.0, "max_error_rate": 0.01}
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout=rollout, checks=FEW_CHECKS)
    w0, w1 = pool.workers
    # Sampled requests whose prompt holds token 200: fine on v0; v1's embedding row for 200 is
    # NaN, so their sampling fails (HTTP 500) while the greedy probe (without 200) passes.
    body = {"prompt": [1, 200, 5], "max_tokens": 2, "temperature": 1.0, "ignore_eos": True}
    with LoadGen([w0.url, w1.url], concurrency=2, body=body, max_seconds=400) as load:
        load.wait_requests(10)
        assert load.stats.errors == []
        publish_into(d.watch_dir, "v1", seed=1, fault="nan-token:200")
        row = d.wait_status("v1", "rejected", timeout=180)
        assert_fleet_on([w0, w1], "v0")
        load.wait_requests(10)  # v0 serves them again
    assert load.stats.errors, "the spike was real: requests failed under v1"
    assert "error rate" in row["status_message"] and "rolled back to v0" in row["status_message"]
    assert_counts_add_up(row["status_message"])  # failed <= total, rate = failed / total (issue 36)
    assert row["rolled_back_at"] is not None and row["deployed_at"] is not None
    r = rollout_of(d, "v1")
    assert r["outcome"] == "rolled_back" and r["detail"]["health_window"]["ok"] is False
    back = rollout_of(d, "v0", trigger="rollback")
    assert back["outcome"] == "succeeded" and back["detail"]["by"] == "health_window"
    paths = worker_paths(d.registry)
    for w in ("w0", "w1"):
        assert paths[(w, "v1")] == [["RUNNING", "DRAINING", "UPDATED", "RUNNING"]]
        assert paths[(w, "v0")] == [["RUNNING", "DRAINING", "UPDATED", "RUNNING"]]  # the rollback
    # serving moves just after the rollback's row is finished (once both workers answer v0): read
    # right after that row, it may still say v1 (seen once in CI), so wait for what follows it
    wait_until(lambda: aliases(d.registry) == {"serving": "v0", "last_good": "v0"}, 30, what="serving back on v0")


def test_one_bad_client_request_in_the_health_window_cannot_roll_back(
    sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """Finding 6: a completion with seed 2**64 during v1's health window is the client's error
    (400, not counted); v1 keeps serving and becomes last good."""
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout={**FAST, "health_window_s": 15.0})
    w0, w1 = pool.workers
    publish_into(d.watch_dir, "v1", seed=1)
    d.wait_status("v1", "deployed", timeout=180)
    assert aliases(d.registry)["last_good"] == "v0", "still inside v1's health window"
    before = w0.info()
    r = httpx.post(f"{w0.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1, "seed": 2**64}, timeout=30)
    assert r.status_code == 400, r.text
    assert "seed" in r.json()["error"]["message"]
    after = w0.info()
    assert after["requests_failed"] == before["requests_failed"], "a request error is not a server fault"
    # answered while the window was still open (it began at deploy, before the request)
    assert aliases(d.registry)["last_good"] == "v0", "the bad request came after v1's health window"
    wait_until(lambda: aliases(d.registry).get("last_good") == "v1", 120, what="v1's health window to pass")
    assert d.row("v1")["status"] == "deployed"
    window = rollout_of(d, "v1")["detail"]["health_window"]
    assert window["ok"] is True and window["workers"]["w0"]["failed"] == 0, window
    assert_fleet_on([w0, w1], "v1")


@pytest.mark.parametrize("state", ["DRAINING", "PAUSED", "UPDATED"])
def test_daemon_sigkilled_mid_rollout_finishes_it_on_restart(
    state: str, sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    mode = "pause" if state == "PAUSED" else "drain"
    begin = "PAUSED" if mode == "pause" else "DRAINING"
    # held in UPDATED: the worker must stay there, so its probe runs inside the pause
    rollout = {**(IN_PAUSE if state == "UPDATED" else FAST), "mode": mode}
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout=rollout, checks=FEW_CHECKS,
                    hooked=True, env=hold(state, "w1", "v1"))  # fmt: skip
    w0, w1 = pool.workers
    publish_into(d.watch_dir, "v1", seed=1)
    wait_until(lambda: w1.info()["state"] == state, 120, what=f"w1 {state}")
    wait_until(lambda: any(e["worker"] == "w1" and e["to"] == state for e in worker_events(d.registry)), 30,
               what=f"the {state} event")  # fmt: skip
    d.kill()  # SIGKILL the daemon with w1 half-way; kill() returns once the process is reaped
    # the hold kept the daemon from sending w1 anything after the event, and the daemon is gone:
    # nothing else moves w1, so its state now is where it stays (no sleep to watch for a move)
    assert w1.info()["state"] == state, "the worker stays where the daemon left it"

    d.env = {}  # restart without the hold
    d.start(timeout=90)
    d.wait_status("v1", "deployed", timeout=180)
    assert_fleet_on([w0, w1], "v1")
    r = rollout_of(d, "v1")
    assert r["outcome"] == "succeeded" and r["detail"]["recovered"] is True
    paths = worker_paths(d.registry)
    assert paths[("w0", "v1")] == [["RUNNING", begin, "UPDATED", "RUNNING"]]
    assert paths[("w1", "v1")] == [["RUNNING", begin, "UPDATED", "RUNNING"]]  # no gap across the crash
    after = [e for e in worker_events(d.registry, r["id"]) if e["worker"] == "w1"][-1]
    assert after["detail"].get("recovered") is True


def test_ten_checkpoints_within_one_second_deploy_only_the_newest(
    sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout=FAST)  # all checks on
    built = [build_checkpoint(d.watch_dir / f".build-s{i}", f"s{i}", seed=i) for i in range(1, 11)]
    t0 = time.monotonic()
    for i, tmp in enumerate(built, start=1):
        os.replace(tmp, d.watch_dir / f"s{i}")
    assert time.monotonic() - t0 < 1.0
    d.wait_status("s10", "deployed", timeout=240)
    assert_fleet_on(pool.workers, "s10")
    for i in range(1, 10):
        row = d.wait_status(f"s{i}", "superseded", timeout=30)
        assert row["superseded_at"] is not None and row["deployed_at"] is None
    deployed = [r["version"] for r in rollouts(d.registry) if r["outcome"] == "succeeded"]
    assert deployed == ["v0", "s10"]


def test_manual_rollback_pin_unpin_through_the_daemon(
    sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout=FAST, checks=FEW_CHECKS)
    cfg = str(d.config_path)
    publish_into(d.watch_dir, "v1", seed=1)
    d.wait_status("v1", "deployed", timeout=180)
    wait_until(lambda: aliases(d.registry).get("last_good") == "v1", 60, what="v1's health window")
    v0_first, v1_first = d.row("v0")["deployed_at"], d.row("v1")["deployed_at"]

    out = hotswap_cli("rollback", "-c", cfg)
    assert out.returncode == 0, out.stderr
    assert "v0 succeeded (from v1)" in out.stdout
    assert_fleet_on(pool.workers, "v0")
    v1 = d.row("v1")
    assert v1["status"] == "retired" and "rolled back by control-token to v0" in v1["status_message"]
    assert v1["rolled_back_at"] is not None
    v0 = d.row("v0")  # the rollback records its own time; the first deploy's stays
    assert v0["deployed_at"] == v0_first and v0["last_deployed_at"] > v1_first

    out = hotswap_cli("pin", "v1", "-c", cfg)
    assert out.returncode == 0, out.stderr
    assert_fleet_on(pool.workers, "v1")
    assert aliases(d.registry)["pinned"] == "v1"
    assert d.row("v1")["deployed_at"] == v1_first
    status = hotswap_cli("status", "-c", cfg, env={"COLUMNS": "200"})
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert any(line.startswith("pinned:      v1") for line in lines), status.stdout  # and what waits for it
    assert "serving:     v1" in lines and "health:      ok" in lines, status.stdout
    for w in pool.workers:  # each worker: its state, weight version, URL and how its last update came
        assert f"worker:      {w.name} RUNNING v1 {w.url} (last update via disk)" in lines, status.stdout
    publish_into(d.watch_dir, "v2", seed=2)
    d.wait_status("v2", "verified", timeout=180)
    # a pinned fleet does not move: v2 reached the rollout queue (its job waits there), and the
    # runner took further passes without deploying it
    wait_until(lambda: d.get("/v1/rollout").json()["pending"] == "v2", 60, 0.1, "v2 queued behind the pin")
    wait_passes(d, "health_poll", 2)
    assert d.row("v2")["status"] == "verified"
    assert_fleet_on(pool.workers, "v1", timeout=5)
    refused = hotswap_cli("rollback", "--to", "v0", "-c", cfg)
    assert refused.returncode == 1 and "pinned to v1: run `hotswap unpin` first" in refused.stderr

    out = hotswap_cli("unpin", "-c", cfg)
    assert out.returncode == 0 and "deploying v2 next" in out.stdout
    d.wait_status("v2", "deployed", timeout=180)
    assert_fleet_on(pool.workers, "v2")

    unknown = hotswap_cli("rollback", "--to", "nope", "-c", cfg)
    assert unknown.returncode == 1 and "unknown version 'nope'" in unknown.stderr
    history = hotswap_cli("history", "-c", cfg, env={"COLUMNS": "300"})
    v1_line = next(line for line in history.stdout.splitlines() if line.startswith("│ v1 "))
    assert "retired" in v1_line and "rolled back 20" in v1_line and "w0=" in v1_line and "w1=" in v1_line

    assert d.stop() == 0
    down = hotswap_cli("rollback", "-c", cfg)
    assert down.returncode == 1 and "the hotswap daemon is not running" in down.stderr


def test_dead_worker_is_marked_by_the_poll_and_restarted_before_the_next_rollout(
    sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout={**FAST, "health_poll_s": 0.5}, checks=FEW_CHECKS)
    w0, w1 = pool.workers
    old_pid = w1.kill()
    # a kill between the poll's admin answer and its serving-port probe is first recorded by the
    # probe ("did not answer /health", also true); the next pass asks the admin API: no answer
    wait_until(lambda: worker_row(d.registry, "w1")["state"] == "UNREACHABLE"
               and "no answer" in (worker_row(d.registry, "w1")["last_error"] or ""), 60, what="the poll to mark w1")  # fmt: skip
    assert "no answer" in worker_row(d.registry, "w1")["last_error"]
    assert worker_row(d.registry, "w0")["state"] == "RUNNING"

    publish_into(d.watch_dir, "v1", seed=1)
    d.wait_status("v1", "deployed", timeout=240)  # the dead worker does not sink the new version
    assert_fleet_on([w0, w1], "v1")
    assert w1.pid != old_pid
    r = rollout_of(d, "v1")
    assert r["outcome"] == "succeeded"
    assert transitions(d, r["id"], "w1") == [
        ("RUNNING", "UNHEALTHY", "preflight"),
        ("UNHEALTHY", "UNHEALTHY", "restore_failed"),
        ("UNHEALTHY", "UNHEALTHY", "restart"),
        ("UNHEALTHY", "RUNNING", "restored"),
        *FORWARD,
    ]
    assert transitions(d, r["id"], "w0") == FORWARD
    wait_until(lambda: worker_row(d.registry, "w1")["state"] == "RUNNING", 30, what="w1 RUNNING in workers")


def test_rollout_waits_for_a_worker_that_cannot_be_restarted(
    sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout={**FAST, "health_poll_s": 0.5}, checks=FEW_CHECKS,
                    worker_extra={"restart_command": ""})  # fmt: skip
    w0, w1 = pool.workers
    w1.kill()
    publish_into(d.watch_dir, "v1", seed=1)
    wait_until(lambda: "not deployed yet" in (d.row("v1")["status_message"] or ""), 120, what="v1 held back")
    row = d.row("v1")
    assert row["status"] == "verified" and "w1" in row["status_message"]
    (first,) = rollouts(d.registry)[1:]
    assert (first["version"], first["outcome"], first["detail"]["kind"]) == ("v1", "failed", "unavailable")
    assert transitions(d, first["id"], "w0") == []  # nothing left RUNNING before the fleet was whole
    assert w0.info()["version"] == "v0"

    spawn_worker(w1.worker_args(str(d.watch_dir / "v0"), "v0"), w1.pidfile, w1.log_file)  # an operator's fix
    d.wait_status("v1", "deployed", timeout=240)
    assert_fleet_on([w0, w1], "v1")
    outcomes = [r["outcome"] for r in rollouts(d.registry) if r["version"] == "v1"]
    assert outcomes == ["failed", "succeeded"]


def test_daemon_sigkilled_in_the_failure_path_undoes_the_rollout_on_restart(
    sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout=IN_PAUSE, checks=FEW_CHECKS,
                    hooked=True, env=hold("UNHEALTHY", "w0", None))  # fmt: skip
    w0, w1 = pool.workers
    publish_into(d.watch_dir, "v1", seed=1, fault="nan")  # w0's post-check (inside the pause) fails
    wait_until(lambda: any(e["worker"] == "w0" and e["to"] == "UNHEALTHY" for e in worker_events(d.registry)), 120,
               what="w0 UNHEALTHY")  # fmt: skip
    d.kill()  # before the failure path restored anything: w0 sits in UPDATED on the bad weights
    info = w0.info()
    assert (info["state"], info["version"]) == ("UPDATED", "v1")

    d.env = {}
    d.start(timeout=90)
    row = d.wait_status("v1", "rejected", timeout=180)
    assert "undone" in row["status_message"]
    assert_fleet_on([w0, w1], "v0")
    r = rollout_of(d, "v1")
    assert r["outcome"] == "failed" and r["detail"]["recovered_to"] == "v0"
    tail = transitions(d, r["id"], "w0")[-2:]
    assert tail[-1] == ("UNHEALTHY", "RUNNING", "restored")
    assert transitions(d, r["id"], "w1") == []


def test_rejected_checkpoints_never_reach_a_worker(
    sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """With every check on, bad checkpoints stop at verify: no rollout, no worker call, v0 serves."""
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout=FAST)
    before = {w.name: w.info()["update_count"] for w in pool.workers}

    publish_into(d.watch_dir, "bad-shape", seed=1, fault="shape")
    publish_into(d.watch_dir, "bad-nan", seed=2, fault="nan")
    tmp = d.watch_dir / ".build-bad-crc"
    build_checkpoint(tmp, "bad-crc", seed=3)
    (weights,) = sorted(tmp.glob("*.safetensors"))
    with open(weights, "r+b") as f:  # one flipped bit after the manifest was written
        f.seek(weights.stat().st_size - 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    os.replace(tmp, d.watch_dir / "bad-crc")

    reasons = {v: d.wait_status(v, "rejected", timeout=120)["status_message"] for v in ("bad-shape", "bad-nan", "bad-crc")}
    assert "mlp" in reasons["bad-shape"] and "restart" in reasons["bad-shape"], reasons
    assert "model.norm.weight" in reasons["bad-nan"], reasons
    assert "model.safetensors" in reasons["bad-crc"] and "crc32c" in reasons["bad-crc"], reasons

    assert [r["version"] for r in rollouts(d.registry)] == ["v0"]
    assert_fleet_on(pool.workers, "v0")
    assert {w.name: w.info()["update_count"] for w in pool.workers} == before
