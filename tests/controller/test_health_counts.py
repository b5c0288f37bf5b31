"""A health window's reason has counts that add up: failed <= requests, the rate is failed /
requests, and the daemon's probes are in both figures or in neither (issue 36, item 12).

Found with real processes (`96 of 95 requests failed`): a request in flight when the window
opened is counted by the worker before the window and fails inside it. The fake worker here
replays exactly those counters; tests/test_rollout_faults.py checks the same on a real rollback.
"""

from __future__ import annotations

import re

import pytest
from fake_worker import FakeWorkerClient

from daemon.config import RolloutSettings, WorkerSpec
from daemon.rollout import health
from daemon.rollout.states import WorkerHandle, WorkerSet

pytestmark = pytest.mark.quick

FIGURES = re.compile(r"error rate (?P<rate>[\d.]+)% \((?P<failed>\d+) of (?P<total>\d+)(?: requests)? failed")


def assert_counts_add_up(reason: str) -> tuple[int, int]:
    """The (failed, total) a rollback reason states; they add up, and the rate is their ratio."""
    m = FIGURES.search(reason)
    assert m is not None, reason
    failed, total = int(m["failed"]), int(m["total"])
    assert failed <= total, reason
    assert abs(float(m["rate"]) - 100 * failed / total) < 0.05, reason
    parts = re.search(r"failed: (\d+) of (\d+) requests, (\d+) of (\d+) probes", reason)
    if parts is not None:  # probes counted: in both figures
        rf, rt, pf, pt = map(int, parts.groups())
        assert (rf + pf, rt + pt) == (failed, total) and rf <= rt and pf <= pt, reason
    return failed, total


def _fleet(*fakes: FakeWorkerClient) -> WorkerSet:
    return WorkerSet([WorkerHandle(WorkerSpec(name=f.name, url=f"http://fake/{f.name}"), f, f"http://fake/{f.name}")
                  for f in fakes])  # fmt: skip


def _during(fn: object) -> object:
    done: list[bool] = []

    def abort() -> bool:
        if not done:
            done.append(True)
            fn()  # type: ignore[operator]
        return False

    return abort


def test_requests_in_flight_at_the_start_that_fail_inside_the_window_add_up() -> None:
    w0 = FakeWorkerClient("w0", version="v1")
    w0.traffic(95)  # before the window: 95 requests arrived (some still in flight)
    settings = RolloutSettings(health_window_s=0.05, health_sample_s=0.01, health_probe_s=0, max_error_rate=0.01)
    # inside the window: 95 more arrive, and 96 end failed (one had arrived before the window)
    verdict = health.watch(_fleet(w0), settings, _during(lambda: w0.traffic(95, failed=96)), "v1")  # type: ignore[arg-type]
    assert not verdict.ok and verdict.reason is not None
    assert assert_counts_add_up(verdict.reason) == (96, 96)
    assert verdict.workers["w0"]["failed"] <= verdict.workers["w0"]["requests"]


def test_probes_are_in_both_figures_of_the_reason() -> None:
    w0 = FakeWorkerClient("w0", version="v1")
    settings = RolloutSettings(health_window_s=0.2, health_sample_s=0.01, health_probe_s=0.01, max_error_rate=0.01)
    verdict = health.watch(_fleet(w0), settings, _during(lambda: w0.traffic(141, failed=141)), "v1")  # type: ignore[arg-type]
    assert not verdict.ok and verdict.reason is not None
    failed, total = assert_counts_add_up(verdict.reason)
    doc = verdict.workers["w0"]
    assert doc["probes"] >= 1 and "probes" in verdict.reason
    assert (failed, total) == (doc["failed"] + doc["probes_failed"], doc["requests"] + doc["probes"])
    assert doc["rate"] == round(failed / total, 4)
