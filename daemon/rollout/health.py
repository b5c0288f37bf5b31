"""The post-deploy health window: watch each worker's own request counters for a while after a rollout.

Only server faults that the weights can cause count against a version: the worker's
`requests_failed` (it counts 5xx from generation, non-finite outputs included, and never a
request error: a 4xx such as an out-of-range seed is the client's fault) and the daemon's own
greedy probes, one every `health_probe_s`. The error rate of a worker is failed / requests over
the window; it can trip only once the worker saw `min_window_requests` requests (probes
included), so one bad client request cannot veto a version. Above the bound (default 1 %) on any
worker, a probe whose logits are not finite or that another version answered (decisive at once:
the probe is deterministic), or a worker that stops answering, the verdict is "roll back", with a
one-line reason naming the worker and the figures. A worker that stops answering is flagged
`infra`: the service rolls back but treats it like a crashed worker in a rollout (retried,
bounded; see daemon.rollout.attribution).

The counts add up: a worker counts a request when it arrives and its failure when it ends, so
one that was in flight when the window opened may fail inside it; a sample's failures are then
counted as requests too (failed <= requests, always). The daemon's probes are counted beside the
worker's requests in both figures (the reference worker's probe is an admin call, not in its
counters), and a reason shows exactly the figures its rate is: faults / requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from daemon.common import get_logger
from daemon.config import RolloutSettings
from daemon.engines import NonFiniteOutput, WorkerError, WorkerUnreachable
from daemon.rollout.states import WorkerHandle, WorkerSet

log = get_logger(__name__)
T = TypeVar("T")


@dataclass
class WindowVerdict:
    ok: bool
    reason: str | None = None
    aborted: bool = False  # cut short by an operator command; no verdict
    infra: bool = False  # failed because a worker stopped answering: maybe not the weights' fault
    check: str | None = None  # the built-in check that failed: error_rate, greedy_probe, finite_logits
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class _Tally:
    last_total: int
    last_failed: int
    total: int = 0
    failed: int = 0
    probes: int = 0
    probes_failed: int = 0

    def add(self, total: int, failed: int) -> None:
        if total < self.last_total or failed < self.last_failed:
            # The counters went backwards: the worker restarted and counts from zero again.
            self.last_total = self.last_failed = 0
        new_failed = failed - self.last_failed
        # a request in flight when the window opened (counted before it) may fail inside it
        self.total += max(total - self.last_total, new_failed)
        self.failed += new_failed
        self.last_total, self.last_failed = total, failed

    def probed(self, ok: bool) -> None:
        self.probes += 1
        self.probes_failed += not ok

    @property
    def requests(self) -> int:
        return self.total + self.probes

    @property
    def faults(self) -> int:
        return self.failed + self.probes_failed

    @property
    def rate(self) -> float:
        return self.faults / self.requests if self.requests else 0.0

    def counts(self) -> str:
        """The figures the rate is made of, in words: faults of requests, probes included."""
        if not self.probes:
            return f"{self.failed} of {self.total} requests failed"
        return (f"{self.faults} of {self.requests} failed: {self.failed} of {self.total} requests, "
                f"{self.probes_failed} of {self.probes} probes")  # fmt: skip


def _probe(h: WorkerHandle, version: str | None, tally: _Tally) -> tuple[str, str] | None:
    """One greedy probe; the check and reason of a decisive failure (non-finite, another version), else None.
    Any other error counts as one failed request; no answer at all is left to the counters' poll."""
    try:
        served = h.client.probe()
    except NonFiniteOutput as exc:
        tally.probed(False)
        return "finite_logits", str(exc)
    except WorkerUnreachable:
        return None
    except WorkerError as exc:
        log.warning("health_probe_failed", worker=h.name, error=str(exc))
        tally.probed(False)
        return None
    if version is not None and served != version:
        tally.probed(False)
        return "greedy_probe", f"worker {h.name}: probe generation served version {served!r}, expected {version!r}"
    tally.probed(True)
    return None


class HealthWatch:
    """The window as a condition: opened once, then stepped by its owner until it gives a verdict.
    `step()` samples the workers' counters (and probes) when `due` (monotonic) has come, and returns
    None while the window is still open; `should_abort` (an operator command, shutdown) cuts it short."""

    def __init__(self, fleet: WorkerSet, settings: RolloutSettings, should_abort: Callable[[], bool],
                 version: str | None = None) -> None:  # fmt: skip
        self.fleet, self.settings, self.should_abort, self.version = fleet, settings, should_abort, version
        self.tallies: dict[str, _Tally] = {}
        self.unreachable: dict[str, int] = {}
        self.verdict: WindowVerdict | None = None
        for h in fleet:
            try:
                c = h.client.counters()
            except WorkerError as exc:
                self.verdict = WindowVerdict(False, f"worker {h.name} did not answer at the start of the health "
                                             f"window: {exc}", infra=True)  # fmt: skip
                break
            self.tallies[h.name] = _Tally(c.get("requests_total", 0), c.get("requests_failed", 0))
        now = time.monotonic()
        self.deadline = now + settings.health_window_s
        self.next_sample = min(now + settings.health_sample_s, self.deadline)
        self.next_probe = now if settings.health_probe_s > 0 else float("inf")

    @property
    def due(self) -> float:
        """When `step` has something to do next (monotonic)."""
        return self.next_sample if self.verdict is None else 0.0

    def step(self) -> WindowVerdict | None:
        if self.verdict is None:
            self.verdict = self._step()
        return self.verdict

    def _step(self) -> WindowVerdict | None:
        if self.settings.health_window_s <= 0:
            return self._final()  # no window: nothing sampled (a trial of gates alone)
        if self.should_abort():
            return WindowVerdict(True, None, aborted=True, workers=_summary(self.tallies))
        now = time.monotonic()
        if now < self.next_sample:
            return None
        for h in self.fleet:
            try:
                c = h.client.counters()
            except WorkerError as exc:
                self.unreachable[h.name] = self.unreachable.get(h.name, 0) + 1
                if self.unreachable[h.name] >= 2:  # one lost sample is noise; two are an outage
                    return WindowVerdict(
                        False, f"worker {h.name} stopped answering during the health window: {exc}",
                        workers=_summary(self.tallies), infra=True,
                    )  # fmt: skip
                continue
            self.unreachable.pop(h.name, None)
            self.tallies[h.name].add(c.get("requests_total", 0), c.get("requests_failed", 0))
        if time.monotonic() >= self.next_probe:
            self.next_probe = time.monotonic() + self.settings.health_probe_s
            for h in self.fleet:
                decisive = _probe(h, self.version, self.tallies[h.name])
                if decisive is not None:
                    return WindowVerdict(False, f"{decisive[1]} during the health window",
                                         workers=_summary(self.tallies), check=decisive[0])  # fmt: skip
        if time.monotonic() >= self.deadline:
            return self._final()
        self.next_sample = min(time.monotonic() + self.settings.health_sample_s, self.deadline)
        return None

    def _final(self) -> WindowVerdict:
        settings, summary = self.settings, _summary(self.tallies)
        for name, t in self.tallies.items():
            if t.requests >= settings.min_window_requests and t.rate > settings.max_error_rate:
                reason = (f"worker {name} error rate {t.rate:.1%} ({t.counts()}) "
                          f"> {settings.max_error_rate:.1%} over {settings.health_window_s:g} s after deploy")  # fmt: skip
                return WindowVerdict(False, reason, workers=summary, check="error_rate")
        return WindowVerdict(True, None, workers=summary)


class Stepped(Protocol):
    """A window stepped to its verdict: HealthWatch, or a trial of it with gates (daemon.controller.trial)."""

    @property
    def due(self) -> float: ...
    def step(self) -> WindowVerdict | None: ...


def step_until_done(step: Callable[[], T | None], due: Callable[[], float]) -> T:
    """Call `step` until it gives an answer, sleeping until `due()` (monotonic) between calls: a
    window stepped to its verdict in place, where nothing else waits on the thread."""
    while (answer := step()) is None:
        time.sleep(max(0.0, min(due() - time.monotonic(), 1.0)))
    return answer


def watch(
    fleet: WorkerSet, settings: RolloutSettings, should_abort: Callable[[], bool], version: str | None = None
) -> WindowVerdict:
    """Watch the fleet for `health_window_s`; `version` is what the probes must be served by."""
    window = HealthWatch(fleet, settings, should_abort, version)
    return step_until_done(window.step, lambda: window.due)


def _summary(tallies: dict[str, _Tally]) -> dict[str, dict[str, Any]]:
    return {
        n: {"requests": t.total, "failed": t.failed, "probes": t.probes, "probes_failed": t.probes_failed,
            "rate": round(t.rate, 4)}
        for n, t in tallies.items()
    }  # fmt: skip
