"""The post-deploy health window: watch each worker's own request counters for a while after a rollout.

The error rate of a worker is (requests_failed delta) / (requests_total delta)
over the window, from the counters in its `/weight_info`. Above the bound
(default 1 % over 5 s) on any worker, or a worker that stops answering, the
verdict is "roll back", with a one-line reason naming the worker and the figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from daemon.adapters.base import WorkerError
from daemon.config import RolloutSettings
from daemon.logging import get_logger
from daemon.rollout.states import Fleet

log = get_logger(__name__)


@dataclass
class WindowVerdict:
    ok: bool
    reason: str | None = None
    aborted: bool = False  # cut short by an operator command; no verdict
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class _Tally:
    last_total: int
    last_failed: int
    total: int = 0
    failed: int = 0

    def add(self, total: int, failed: int) -> None:
        if total < self.last_total or failed < self.last_failed:
            # The counters went backwards: the worker restarted and counts from zero again.
            self.last_total = self.last_failed = 0
        self.total += total - self.last_total
        self.failed += failed - self.last_failed
        self.last_total, self.last_failed = total, failed

    @property
    def rate(self) -> float:
        return self.failed / self.total if self.total else 0.0


def watch(fleet: Fleet, settings: RolloutSettings, should_abort: Callable[[], bool]) -> WindowVerdict:
    window = settings.health_window_s
    tallies: dict[str, _Tally] = {}
    for h in fleet:
        try:
            c = h.client.counters()
        except WorkerError as exc:
            return WindowVerdict(False, f"worker {h.name} did not answer at the start of the health window: {exc}")
        tallies[h.name] = _Tally(c.get("requests_total", 0), c.get("requests_failed", 0))
    deadline = time.monotonic() + window
    unreachable: dict[str, int] = {}
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        if should_abort():
            return WindowVerdict(True, None, aborted=True, workers=_summary(tallies))
        time.sleep(min(settings.health_sample_s, remaining))
        for h in fleet:
            try:
                c = h.client.counters()
            except WorkerError as exc:
                unreachable[h.name] = unreachable.get(h.name, 0) + 1
                if unreachable[h.name] >= 2:  # one lost sample is noise; two are an outage
                    return WindowVerdict(
                        False, f"worker {h.name} stopped answering during the health window: {exc}", workers=_summary(tallies)
                    )
                continue
            unreachable.pop(h.name, None)
            tallies[h.name].add(c.get("requests_total", 0), c.get("requests_failed", 0))
    summary = _summary(tallies)
    for name, t in tallies.items():
        if t.total >= settings.min_window_requests and t.rate > settings.max_error_rate:
            reason = (
                f"worker {name} error rate {t.rate:.1%} ({t.failed} of {t.total} requests failed) "
                f"> {settings.max_error_rate:.1%} over {window:g} s after deploy"
            )
            return WindowVerdict(False, reason, workers=summary)
    return WindowVerdict(True, None, workers=summary)


def _summary(tallies: dict[str, _Tally]) -> dict[str, dict[str, Any]]:
    return {n: {"requests": t.total, "failed": t.failed, "rate": round(t.rate, 4)} for n, t in tallies.items()}
