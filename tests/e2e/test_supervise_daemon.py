"""Managed worker supervision with real processes (issue 16): a real daemon, its real managed
reference worker on a tiny model, real files deleted and changed under it.

- The serving version's directory is deleted (and the version before it changed on disk), then
  the worker dies: the failure is in `workers.last_error` with the last lines of the worker's log
  within 10 s, and the daemon relaunches it on the newest good version still present and intact,
  which becomes `serving`.
- A worker that can never start is relaunched with growing delays (never faster than the
  recorded schedule) and stays UNHEALTHY with its log's last lines, shown by /health and status.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import DaemonProcess, hotswap_cli, wait_until
from sqlalchemy import select
from support_check import flip_byte
from support_managed import managed_daemon
from support_rollout import aliases, publish_into, wait_passes, worker_events, worker_row

from daemon.formats.checkpoint import tensor_table
from daemon.registry.models import Event

pytestmark = pytest.mark.timeout(600)

REPORT_S = 10.0  # the bound: a launch failure is reported within 10 s


@pytest.fixture
def managed(tmp_path: Path) -> Iterator[Any]:
    """Start a daemon with one managed worker; `start(**worker_keys, rollout=...)` returns it."""
    state = tmp_path / "state"
    started: list[DaemonProcess] = []

    def start(rollout: dict[str, Any] | None = None, **worker: Any) -> DaemonProcess:
        return managed_daemon(tmp_path, started, rollout, **worker)

    yield start
    for d in started:
        d.close()
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        os.kill(json.loads((state / "worker-local.json").read_text())["pid"], signal.SIGKILL)


def runtime(d: DaemonProcess) -> dict[str, Any]:
    return json.loads((d.state_dir / "worker-local.json").read_text())


def served(d: DaemonProcess) -> str | None:
    """The version the worker itself says it serves (its public /v1/models)."""
    r = httpx.get(f"http://127.0.0.1:{runtime(d)['port']}/v1/models", timeout=5)
    return r.json()["data"][0]["metadata"]["weight_version"] if r.status_code == 200 else None


def supervisor_events(d: DaemonProcess, action: str) -> list[dict[str, Any]]:
    return [e for e in worker_events(d.registry) if e["worker"] == "local" and e["detail"].get("action") == action]


def test_missing_serving_checkpoint_is_reported_and_the_worker_falls_back_to_a_present_good_version(
    managed: Any,
) -> None:
    d: DaemonProcess = managed()
    d.wait_status("tiny-seed", "deployed", timeout=60)
    wait_until(lambda: served(d) == "tiny-seed", 180, what="the worker serving the seed")
    for i, version in enumerate(("v1", "v2"), start=1):
        publish_into(d.watch_dir, version, seed=i)
        wait_until(lambda v=version: aliases(d.registry).get("last_good") == v, 180, what=f"{version} deployed")
    assert served(d) == "v2"
    # worker-local.json says what it serves now (launched on the seed, updated in place since)
    doc = runtime(d)
    assert (doc["version"], doc["launched_version"]) == ("v2", "tiny-seed"), doc
    # on this host: v2 (serving) is gone, v1 has a changed byte (same size), the seed is intact
    shutil.rmtree(d.watch_dir / "v2")
    table, _ = tensor_table(d.watch_dir / "v1")
    loc = table["lm_head.weight"]
    flip_byte(loc.file, loc.entry.start + loc.entry.nbytes // 2)
    log_file = d.state_dir / "logs" / "worker-local.log"
    before = runtime(d)["pid"]
    os.kill(before, signal.SIGKILL)  # the worker dies; the next launch must not be onto v2 (or v1)

    # a healthy worker's crash is relaunched at once (no backoff), so the failure line is followed by
    # the fallback's at once too: the failure is read from its event. It died while serving: a crash,
    # not a failed launch (issue 36: no worker_launch_failed)
    (failed,) = wait_until(lambda: supervisor_events(d, "crashed") or None, REPORT_S, interval=0.02,
                           what="the crash recorded")  # fmt: skip
    assert failed["to"] == "UNHEALTHY" and failed["detail"]["exit_code"] == -9 and failed["detail"]["log_tail"]
    assert failed["detail"]["retry_in_s"] == 0, failed["detail"]
    assert "while serving" in failed["detail"]["cause"], failed
    tail = failed["detail"]["log_tail"].splitlines()
    assert 1 <= len(tail) <= 20 and set(tail) <= set(log_file.read_text().splitlines()), tail
    assert not supervisor_events(d, "launch_failed")
    kinds = {p["kind"] for p in d.get("/health").json().get("problems", [])}
    assert "worker_launch_failed" not in kinds, kinds

    # the relaunch skips both unusable versions, says why (the failure and its log lines kept under it)
    row = wait_until(lambda: (r := worker_row(d.registry, "local"))["last_error"].startswith("v2 cannot be launched")
                     and r, 30, interval=0.02, what="the fallback in workers.last_error")  # fmt: skip
    assert "launching tiny-seed" in row["last_error"] and "after: the worker process was killed by signal 9" \
        in row["last_error"] and f"--- last lines of {log_file} ---" in row["last_error"], row["last_error"]
    wait_until(lambda: served(d) == "tiny-seed" and runtime(d)["pid"] != before, 180, what="the fallback serving")
    (fallback,) = supervisor_events(d, "fallback")
    skipped = fallback["detail"]["skipped"]
    assert fallback["detail"]["wanted"] == "v2" and fallback["detail"]["using"] == "tiny-seed", fallback
    assert "is missing" in skipped["v2"] and "changed since it was verified" in skipped["v1"], skipped
    wait_until(lambda: aliases(d.registry).get("serving") == "tiny-seed", 60, what="serving = what the worker serves")
    assert aliases(d.registry)["last_good"] == "tiny-seed"
    wait_until(lambda: worker_row(d.registry, "local")["state"] == "RUNNING", 60, what="RUNNING")
    assert d.get("/health").status_code == 200
    assert "fell back" in (d.row("tiny-seed") or {}).get("status_message", ""), d.row("tiny-seed")
    r = httpx.post(f"http://127.0.0.1:{runtime(d)['port']}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                   timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["weight_version"] == "tiny-seed", r.text
    assert len(supervisor_events(d, "crashed")) == 1  # one failure, one relaunch: no loop
    assert not supervisor_events(d, "launch_failed")
    assert runtime(d)["version"] == "tiny-seed"


def test_a_crash_is_worker_crashed_and_an_adopted_worker_is_not_reported_not_ready(managed: Any) -> None:
    """kill -9 of a serving worker: the problem is `worker_crashed` (a warning; the outage itself
    is no_worker_serving), never `worker_launch_failed`. A daemon started beside a healthy worker
    it adopts logs it healthy, never `managed_worker_not_ready` at error level first."""
    d: DaemonProcess = managed()
    wait_until(lambda: served(d) == "tiny-seed", 180, what="the worker serving the seed")
    wait_until(lambda: "managed_worker_healthy" in d.log(), 60, what="the launch seen healthy")
    pid = runtime(d)["pid"]
    os.kill(pid, signal.SIGKILL)
    problems = wait_until(lambda: {p["kind"]: p for p in d.get("/health").json().get("problems", [])
                                   if p["kind"] in ("worker_crashed", "worker_launch_failed")} or None,
                          REPORT_S, interval=0.02, what="the crash as a problem")  # fmt: skip
    assert set(problems) == {"worker_crashed"}, problems
    assert problems["worker_crashed"]["severity"] == "warning" and "killed by signal 9" in problems["worker_crashed"]["reason"]
    wait_until(lambda: served(d) == "tiny-seed" and runtime(d)["pid"] != pid, 180, what="the relaunch")
    wait_until(lambda: d.get("/health").status_code == 200, 60, what="healthy again")
    # the daemon dies; its worker lives on and the next daemon adopts it
    pid = runtime(d)["pid"]
    d.kill()
    d.launch()
    d.wait_started(90)
    wait_until(lambda: "managed_worker_healthy" in d.log().split("managed_worker_adopted", 1)[-1], 60,
               what="the adopted worker logged healthy")  # fmt: skip
    after = d.log().split("managed_worker_adopted", 1)[-1]
    assert runtime(d)["pid"] == pid
    assert "managed_worker_not_ready" not in after, after[-3000:]


def test_a_worker_that_can_never_start_backs_off_and_stays_unhealthy_with_its_log_tail(
    managed: Any, tmp_path: Path
) -> None:
    broken = tmp_path / "not-a-checkpoint"
    broken.mkdir()  # a directory, so it is launched; the worker refuses it (no config.json)
    d: DaemonProcess = managed(rollout={"relaunch_backoff_s": 0.5, "relaunch_backoff_max_s": 4.0},
                               model=str(broken))  # fmt: skip
    failures = wait_until(lambda: f if len(f := supervisor_events(d, "launch_failed")) >= 6 else None, 240,
                          what="six failed launches")  # fmt: skip
    delays = [e["detail"]["retry_in_s"] for e in failures]
    assert delays[:6] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0], delays
    # never relaunched faster than the schedule: each launch came at least its delay after the failure before
    with d.registry.session() as s:
        at = [e.at for e in s.scalars(select(Event).where(Event.worker == "local").order_by(Event.id))
              if (e.detail or {}).get("action") == "launch_failed"]  # fmt: skip
    gaps = [(b - a).total_seconds() for a, b in zip(at, at[1:], strict=False)]
    assert all(g >= delay for g, delay in zip(gaps, delays, strict=False)), (gaps, delays)
    row = worker_row(d.registry, "local")
    assert row["state"] == "UNHEALTHY", row
    first, *tail = row["last_error"].splitlines()
    assert "exited with status" in first, first
    assert any("no config.json" in line for line in tail), row["last_error"]
    health = d.get("/health")
    assert health.status_code == 503 and "worker local" in health.json()["error"], health.text
    out = hotswap_cli("status", "-c", str(d.config_path))
    assert "UNHEALTHY" in out.stdout and "error:" in out.stdout and "exited with status" in out.stdout, out.stdout
    assert d.alive()


def test_worker_dying_at_launch_on_changed_files_falls_back_and_nothing_usable_is_unhealthy_without_a_loop(
    managed: Any,
) -> None:
    """The issue's case at start-up: the daemon launches its worker on the serving version, whose
    bytes changed on disk; the worker refuses them and exits. Then no intact version at all."""
    d: DaemonProcess = managed()
    d.wait_status("tiny-seed", "deployed", timeout=60)
    publish_into(d.watch_dir, "v1", seed=1)
    wait_until(lambda: aliases(d.registry).get("last_good") == "v1", 180, what="v1 deployed")
    assert d.stop() == 0  # keep_workers_on_stop = false: the worker goes too
    table, _ = tensor_table(d.watch_dir / "v1")
    loc = table["lm_head.weight"]
    flip_byte(loc.file, loc.entry.start + loc.entry.nbytes // 2)  # same size: only the worker's check sees it
    d.start(timeout=90)
    row = wait_until(lambda: (r := worker_row(d.registry, "local"))["state"] == "UNHEALTHY"
                     and "exited with status" in (r["last_error"] or "") and r, REPORT_S + 60, interval=0.05,
                     what="the launch failure in workers.last_error")  # fmt: skip
    first, *tail = row["last_error"].splitlines()
    assert "relaunch in 1 s" in first and tail[0].startswith("--- last lines of "), row["last_error"]
    assert any("does not match the verified" in line for line in tail[1:]), row["last_error"]  # the worker's own words
    wait_until(lambda: served(d) == "tiny-seed", 180, what="the fallback serving")
    (fallback,) = supervisor_events(d, "fallback")
    assert fallback["detail"]["wanted"] == "v1" and "changed since it was verified" in fallback["detail"]["skipped"]["v1"]
    wait_until(lambda: aliases(d.registry).get("serving") == "tiny-seed", 60, what="serving = the seed")

    # nothing intact left on this host: UNHEALTHY with the reason, and nothing is launched
    assert d.stop() == 0
    shutil.rmtree(d.state_dir / "seed")
    d.start(timeout=90)
    row = wait_until(lambda: (r := worker_row(d.registry, "local"))["state"] == "UNHEALTHY"
                     and "no version can be launched" in (r["last_error"] or "") and r, REPORT_S,
                     what="no launch target")  # fmt: skip
    assert "tiny-seed: its directory" in row["last_error"] and "v1:" in row["last_error"], row["last_error"]
    health = d.get("/health")
    assert health.status_code == 503 and "no version can be launched" in health.json()["error"], health.text
    pid, failed = runtime(d)["pid"], len(supervisor_events(d, "launch_failed"))
    wait_passes(d, "supervisor", 24)  # 6 s of its ticks, past its 1 s relaunch back-off several times
    assert len(supervisor_events(d, "no_launch_target")) == 1, supervisor_events(d, "no_launch_target")
    assert runtime(d)["pid"] == pid and len(supervisor_events(d, "launch_failed")) == failed
