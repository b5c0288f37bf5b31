"""The health poll's bound: every worker is looked at in a thread of its own, and a pass waits at
most `request_timeout_s` for all of them together, so one hung worker never holds the poll.

A SIGSTOPped worker held the poll job on its /weight_info: APScheduler skipped the next passes
("maximum number of running instances reached") and `/health` said ok for about 30 s while every
request failed. Now:

    a worker whose admin API does not answer (its call failed or timed out, or the pass's
    bound passed first) is UNREACHABLE at once (its `workers` row and
    the state the problem probe reads), and its call is left to finish on its own: while it
    hangs no second call is sent, each pass counts one more miss
    a managed worker that misses HUNG_POLLS passes in a row is killed (SIGKILL works on a stopped
    process); the supervisor relaunches it on the port the daemon holds, so connections that
    arrive meanwhile wait in the listen backlog instead of being refused
    a pass the scheduler skipped because the previous one still ran is counted
    (`hotswap_health_polls_skipped_total`); SKIPPED_BOUND in a row is the problem
    `health_poll_skipped`

The serving port is probed as a client would (a new connection and `GET /health` on the
worker's serving URL): a worker whose admin API answers while its serving port does not (a
listener flooded full) serves nobody and is UNREACHABLE, with that reason.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import httpx
from prometheus_client.core import CounterMetricFamily

from daemon.common import WARNING, Problem, get_logger
from daemon.engines import WeightInfo, WorkerError
from daemon.registry import Journal
from daemon.rollout import WorkerDriver, WorkerHandle, WorkerState, parse_state

log = get_logger(__name__)

HUNG_POLLS = 3  # passes in a row a managed worker may miss before it is killed and relaunched
SKIPPED_BOUND = 3  # passes skipped in a row before that is a problem


def serving_port_problem(url: str, timeout_s: float) -> str | None:
    """Why the serving URL does not answer `GET /health` as a client would see it, or None."""
    if not url.startswith(("http://", "https://")):
        return None  # a Unix socket serves no outside client: nothing to probe
    try:
        r = httpx.get(url + "/health", timeout=timeout_s, headers={"Connection": "close"})
    except httpx.HTTPError as exc:
        return f"its serving port {url} did not answer /health within {timeout_s:g} s ({type(exc).__name__}: {exc})"
    if r.status_code >= 500:
        return f"its serving port {url} answered /health with {r.status_code}"
    return None


class Unanswered(Exception):
    """A worker's admin API did not answer its poll (already recorded UNREACHABLE): one miss."""


class BoundedPoll:
    """One pass over the fleet, bounded as a whole (`run`), and the count of passes skipped."""

    def __init__(self, journal: Journal, bound_s: Callable[[], float]) -> None:
        self.journal = journal
        self.bound_s = bound_s
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future[bool]] = {}
        self.missed: dict[str, int] = {}  # worker -> passes missed in a row
        self.skipped = 0  # passes the scheduler skipped (total)
        self.skipped_in_row = 0
        self.killed = 0  # hung managed workers killed (each relaunched by the supervisor)
        self._lock = threading.Lock()

    def run(self, handles: Iterable[WorkerHandle], one: Callable[[WorkerHandle], bool]) -> dict[str, bool]:
        """`one(h)` for every worker at once; what each returned, for those that answered in time."""
        self.skipped_in_row = 0
        handles = list(handles)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(len(handles), 1), thread_name_prefix="health-poll")
        bound = self.bound_s()
        deadline = time.monotonic() + bound
        running: list[tuple[WorkerHandle, Future[bool]]] = []
        for h in handles:
            prev = self._inflight.get(h.name)
            if prev is None or prev.done():
                prev = self._pool.submit(one, h)
            running.append((h, prev))
        out: dict[str, bool] = {}
        for h, fut in running:
            try:
                out[h.name] = fut.result(timeout=max(deadline - time.monotonic(), 0.0))
            except FutureTimeout:
                self._inflight[h.name] = fut
                self._missed(h, bound, f"did not answer its health poll within {bound:g} s")
                continue
            except Unanswered as exc:
                self._inflight.pop(h.name, None)
                self._missed(h, bound, str(exc), recorded=True)
                continue
            except Exception:
                log.exception("health_poll_failed", worker=h.name)
            self._inflight.pop(h.name, None)
            self.missed[h.name] = 0
        return out

    def _missed(self, h: WorkerHandle, bound: float, why: str, recorded: bool = False) -> None:
        n = self.missed.get(h.name, 0) + 1
        self.missed[h.name] = n
        log.warning("health_poll_missed", worker=h.name, missed=n, bound_s=bound, error=why)
        if not recorded:
            self.journal.observe(h.name, state="UNREACHABLE", weight_version=None, error=f"{why} ({n} in a row)")
            h.observed(None)
        m = h.managed
        if m is not None and n >= HUNG_POLLS and m.alive():
            m.kill(f"killed after it missed {n} health polls in a row (hung: each waited {bound:g} s)")
            self.killed += 1
            self.missed[h.name] = 0

    def skip(self) -> None:
        """The scheduler skipped a pass: the previous one still ran."""
        with self._lock:
            self.skipped += 1
            self.skipped_in_row += 1

    def problems(self) -> list[Problem]:
        if self.skipped_in_row < SKIPPED_BOUND:
            return []
        return [Problem("health_poll_skipped", "worker-health",
                        f"{self.skipped_in_row} health polls in a row were skipped: the previous pass still ran", WARNING)]  # fmt: skip

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class PollCollector:
    """`hotswap_health_polls_skipped_total` and `hotswap_hung_workers_killed_total` at scrape time."""

    def __init__(self, poll: BoundedPoll) -> None:
        self.poll = poll

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("hotswap_health_polls_skipped",
                                  "Health poll passes skipped because the previous one still ran", value=self.poll.skipped)  # fmt: skip
        yield CounterMetricFamily("hotswap_hung_workers_killed",
                                  "Managed workers killed after missing health polls in a row", value=self.poll.killed)  # fmt: skip


def back_in_rotation(driver: WorkerDriver, h: WorkerHandle, info: WeightInfo | None = None) -> WeightInfo | None:
    """A worker that reports DRAINING or PAUSED while nothing moves it (a rollout that died on an
    error, a daemon restarted mid-step) is resumed: its weights are whole (an update that fails
    mid-write reports UNHEALTHY), and out of rotation it serves nobody. Its report, None when it
    does not answer."""
    try:
        info = info or h.client.weight_info()
        if parse_state(info.state) not in (WorkerState.DRAINING, WorkerState.PAUSED):
            return info
        log.warning("worker_resumed", worker=h.name, was=info.state, version=info.version,
                    reason="left out of rotation with no rollout moving it")  # fmt: skip
        h.client.resume()
        info = h.client.weight_info()
    except WorkerError as exc:
        log.warning("worker_resume_failed", worker=h.name, error=str(exc))
        return None
    driver.observed(h, parse_state(info.state), None, version=info.version, why="back in rotation")
    return info
