"""Prometheus series read from the registry database at scrape time, and from worker transitions.

Scrape-time (`RegistryCollector`; the database is the truth, so a restarted daemon reports the
same totals): rollouts by trigger and outcome, rollbacks by what triggered them, health-window
trips, gate measurements by gate and verdict (daemon.gates), each worker's state and version
(info-style gauges), the serving/last good/pinned versions, and the time of the last failure.

Event-time (`RolloutMetrics`, a transition observer on the engine's thread): each worker's pause
window (left RUNNING -> back to RUNNING) and update time (left RUNNING -> UPDATED) per
transport, and the bytes of the versions that reached workers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from daemon.registry import Alias, Checkpoint, Event, GateRun, Registry, Rollout, Worker
from daemon.rollout import Transition, WorkerState

WINDOW_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
AWAY = (WorkerState.DRAINING, WorkerState.PAUSED)


class RegistryCollector(Collector):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Any]:
        try:
            yield from self._collect()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the database blinked
            return

    def _collect(self) -> Iterator[Any]:
        rollouts = CounterMetricFamily("hotswap_rollouts", "Finished rollouts by trigger and outcome",
                                       labels=["trigger", "outcome"])  # fmt: skip
        rollbacks = CounterMetricFamily("hotswap_rollbacks", "Rollbacks by what triggered them", labels=["by"])
        trips = CounterMetricFamily("hotswap_health_window_trips", "Deploys rolled back by the health window")
        state = GaugeMetricFamily("hotswap_worker_state", "1 for each worker's current state",
                                  labels=["worker", "state"])  # fmt: skip
        version = GaugeMetricFamily("hotswap_worker_version_info", "1 for the weight version each worker reports",
                                    labels=["worker", "version"])  # fmt: skip
        alias = GaugeMetricFamily("hotswap_alias_info", "1 for the version behind serving, last_good and pinned",
                                  labels=["alias", "version"])  # fmt: skip
        last_error = GaugeMetricFamily("hotswap_last_failure_timestamp_seconds",
                                       "Unix time of the last rejected checkpoint or failed or rolled back rollout (0: none)")  # fmt: skip
        last_deploy = GaugeMetricFamily("hotswap_last_deploy_timestamp_seconds",
                                        "Unix time the last successful rollout on this host finished (0: none)")  # fmt: skip
        gates = CounterMetricFamily("hotswap_gate_runs", "Gate measurements on this host by gate and verdict "
                                    "(passed, failed, inconclusive, error: could not run)", labels=["gate", "verdict"])  # fmt: skip
        here = self._registry.host  # on a fleet's shared database: this host's rows only
        with self._registry.session() as s:
            for gate, verdict, n in s.execute(select(GateRun.gate, GateRun.verdict, func.count())
                                              .where(GateRun.host == here).group_by(GateRun.gate, GateRun.verdict)):  # fmt: skip
                gates.add_metric([gate, verdict], n)
            for trigger, outcome, n in s.execute(
                select(Rollout.trigger, Rollout.outcome, func.count()).where(Rollout.outcome.is_not(None),
                                                                             Rollout.host == here)
                .group_by(Rollout.trigger, Rollout.outcome)
            ):
                rollouts.add_metric([trigger, outcome or ""], n)
            by: dict[str, int] = {}
            for (detail,) in s.execute(select(Rollout.detail).where(Rollout.trigger == "rollback", Rollout.host == here)):
                key = str((detail or {}).get("by") or "manual")
                by[key] = by.get(key, 0) + 1
            for key, n in sorted(by.items()):
                rollbacks.add_metric([key], n)
            trips.add_metric([], by.get("health_window", 0))
            for name, st, ver in s.execute(select(Worker.name, Worker.state, Worker.weight_version).where(Worker.host == here)):
                state.add_metric([name, st], 1)
                version.add_metric([name, ver or ""], 1)
            for name, ver in s.execute(select(Alias.name, Checkpoint.version).join(Checkpoint).where(Alias.host == here)):
                alias.add_metric([name, ver], 1)
            failed_at = s.scalar(select(func.max(Rollout.finished_at))
                                 .where(Rollout.outcome.in_(("failed", "rolled_back")), Rollout.host == here))  # fmt: skip
            rejected_at = s.scalar(select(func.max(Event.at)).where(Event.to_state == "rejected"))  # any host's verdict
            times = [t.timestamp() for t in (failed_at, rejected_at) if t is not None]
            last_error.add_metric([], max(times) if times else 0.0)
            deployed_at = s.scalar(select(func.max(Rollout.finished_at))
                                   .where(Rollout.outcome == "succeeded", Rollout.host == here))  # fmt: skip
            last_deploy.add_metric([], deployed_at.timestamp() if deployed_at is not None else 0.0)
        yield from (rollouts, rollbacks, trips, gates, state, version, alias, last_error, last_deploy)


class RolloutMetrics:
    """A `TransitionObserver`: pause windows, update times and bytes, per transport."""

    def __init__(self, registry: CollectorRegistry, transport: Callable[[], str],
                 version_bytes: Callable[[str], int | None]) -> None:  # fmt: skip
        self._transport = transport
        self._version_bytes = version_bytes
        self._left: dict[str, float] = {}  # worker -> when it left RUNNING
        self._lock = threading.Lock()
        self.pause_window = Histogram("hotswap_pause_window_seconds",
                                      "A worker out of RUNNING for an update (drained or paused), per transport",
                                      ["transport"], buckets=WINDOW_BUCKETS, registry=registry)  # fmt: skip
        self.update = Histogram("hotswap_update_seconds", "A worker's update: left RUNNING until UPDATED",
                                ["transport"], buckets=WINDOW_BUCKETS, registry=registry)  # fmt: skip
        self.bytes = Counter("hotswap_update_bytes", "Checkpoint bytes that reached a worker, per transport",
                             ["transport"], registry=registry)  # fmt: skip

    def __call__(self, t: Transition) -> None:
        now = time.monotonic()
        transport = self._transport()
        with self._lock:
            if t.from_state is WorkerState.RUNNING and t.to_state in AWAY:
                self._left[t.worker] = now
                return
            left = self._left.get(t.worker)
            if t.to_state is WorkerState.UPDATED and left is not None:
                self.update.labels(transport=transport).observe(now - left)
                size = self._version_bytes(t.version) if t.version else None
                if size:
                    self.bytes.labels(transport=transport).inc(size)
            elif t.to_state is WorkerState.RUNNING and left is not None:
                self.pause_window.labels(transport=transport).observe(now - left)
                del self._left[t.worker]
            elif t.to_state in (WorkerState.UNHEALTHY, WorkerState.UNCERTAIN):
                self._left.pop(t.worker, None)


def version_bytes(registry: Registry) -> Callable[[str], int | None]:
    def lookup(version: str) -> int | None:
        with registry.session() as s:
            return s.scalar(select(Checkpoint.total_bytes).where(Checkpoint.version == version))

    return lookup

