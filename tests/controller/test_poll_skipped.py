"""Health polls never pile up silently (issue 37, "Hung workers"): a pass APScheduler skips because
the previous one still runs is counted (`hotswap_health_polls_skipped_total`), and SKIPPED_BOUND
in a row is the problem `health_poll_skipped`; the next pass that runs clears it.

A real BackgroundScheduler runs a "worker-health" job that is held (as a poll stuck on a stopped
worker was), with the rollout service's own listener method wired as the service wires it.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from apscheduler.events import EVENT_JOB_MAX_INSTANCES
from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client import CollectorRegistry, generate_latest
from support_wait import wait_until

from daemon.controller.poll import SKIPPED_BOUND, BoundedPoll, PollCollector
from daemon.controller.service import RolloutService

pytestmark = pytest.mark.quick


def test_skipped_polls_are_counted_and_past_the_bound_a_problem_until_a_pass_runs() -> None:
    poll = BoundedPoll(journal=None, bound_s=lambda: 1.0)  # type: ignore[arg-type]  # no worker is polled here
    service = SimpleNamespace(poller=poll)
    registry = CollectorRegistry()
    registry.register(PollCollector(poll))
    release, entered = threading.Event(), threading.Event()

    def held_pass() -> None:
        entered.set()
        release.wait(30)

    scheduler = BackgroundScheduler()
    scheduler.add_job(held_pass, "interval", seconds=0.05, id="worker-health", max_instances=1, coalesce=True,
                      next_run_time=datetime.now(UTC))  # fmt: skip
    scheduler.add_listener(lambda e: RolloutService._poll_skipped(service, e), EVENT_JOB_MAX_INSTANCES)  # type: ignore[arg-type]
    scheduler.start()
    try:
        assert entered.wait(10), "the first pass did not start"
        wait_until(lambda: poll.skipped_in_row >= SKIPPED_BOUND, 10, 0.02, "skipped passes counted")
        (problem,) = poll.problems()
        assert problem.kind == "health_poll_skipped" and "in a row were skipped" in problem.reason
        metrics = generate_latest(registry).decode()
        assert f"hotswap_health_polls_skipped_total {float(poll.skipped)}" in metrics, metrics
        assert poll.skipped >= SKIPPED_BOUND
    finally:
        release.set()
        scheduler.shutdown(wait=True)
    assert poll.run([], lambda h: True) == {}  # a pass that runs: the run of skips is over
    assert poll.problems() == [] and poll.skipped >= SKIPPED_BOUND  # the total stays
