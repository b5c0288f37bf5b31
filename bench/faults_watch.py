"""What the fault matrix measures while a fault runs: the serving truth, the daemon's /health, a load.

    watch = Watch(api_url, worker_urls); watch.start()
    ... inject a fault, recover ...
    figures = watch.figures(t0, t1)       # per-fault numbers over [t0, t1]

The serving truth comes from the workers' own serving answers: one prober thread per worker
sends a one-token completion every 0.1 s (0.01 s after a failed one). A worker *serves* at a moment when a request sent then
is answered 200 within `STALL_S` (a client's patience: a pause shorter than that is not an
outage): from the sending of such a request on, or from the answer of one held longer; it stops
serving at an answer that is not 200 or at the moment a request has waited `STALL_S` without an
answer. `/health` is
sampled at 10 Hz; a sample says what /health said at some moment between its request and its
answer, so /health counts as ok at a moment only when the last sample answered before it and
the first sample sent after it both said ok (a sample sent before a fault and answered after it
may have been computed before it: it vouches for neither side). The load (bench.loadgen,
as a load balancer: skips workers whose /ready is not 200, retries a 503 on the next) counts
failed requests.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.loadgen import LoadGen

STALL_S = 2.0  # a request unanswered this long: the worker does not serve
PROBE_EVERY_S = 0.1
# after a failed probe the next goes sooner: the end of an outage is known only at a probe, and a
# 0.1 s gap after the last failure counted as "outage while /health ok" whenever /health turned ok
# inside it (2026-12-06, default/worker_sigstop_mid_update: 0.06 s, /health ok 41 ms after the failure)
PROBE_AFTER_FAILURE_S = 0.01
HEALTH_EVERY_S = 0.1


@dataclass
class Track:
    """A boolean signal over time: (monotonic time, value) changes, in order."""

    points: list[tuple[float, bool]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, t: float, value: bool) -> None:
        with self.lock:
            if not self.points or self.points[-1][1] != value:
                self.points.append((t, value))

    def at(self, t: float) -> bool:
        with self.lock:
            i = bisect.bisect_right([p[0] for p in self.points], t) - 1
            return self.points[i][1] if i >= 0 else False


class Prober(threading.Thread):
    """One worker's serving truth (see the module docstring)."""

    def __init__(self, url: str, stop: threading.Event) -> None:
        super().__init__(daemon=True, name=f"probe {url}")
        self.url, self.stop_event = url, stop
        self.up = Track()
        self.versions: dict[str, int] = {}
        self.last_version: str | None = None
        self.requests: list[tuple[float, float, bool]] = []  # (sent, answered or failed, 200)
        self._inflight_since: float | None = None

    def run(self) -> None:
        body = {"prompt": [1, 2, 3], "max_tokens": 1, "ignore_eos": True}
        with httpx.Client(timeout=httpx.Timeout(60.0, connect=STALL_S)) as c:
            while not self.stop_event.is_set():
                t0 = time.monotonic()
                self._inflight_since = t0
                try:
                    r = c.post(self.url + "/v1/completions", json=body)
                    ok = r.status_code == 200
                    if ok:
                        v = str(r.json().get("weight_version"))
                        self.versions[v] = self.versions.get(v, 0) + 1
                        self.last_version = v
                except httpx.HTTPError:
                    ok = False
                self._inflight_since = None
                answered = time.monotonic()
                self.requests.append((t0, answered, ok))
                # answered within patience: a client sending at t0 was served (the answer only
                # tells it later); held longer: serving again from the answer
                self.up.set(t0 if ok and answered - t0 < STALL_S else answered, ok)
                time.sleep(max(0.0, PROBE_EVERY_S - (time.monotonic() - t0)) if ok else PROBE_AFTER_FAILURE_S)

    def stalled(self) -> None:
        """Called by the watch's clock: a request unanswered for STALL_S means not serving."""
        since = self._inflight_since
        if since is not None and time.monotonic() - since > STALL_S:
            self.up.set(since + STALL_S, False)


class Watch:
    def __init__(self, api_url: Callable[[], str], worker_urls: list[str], load: bool = True) -> None:
        self.api_url = api_url  # read on every sample: a daemon restarted mid-fault listens elsewhere
        self.stop_event = threading.Event()
        self.probers = [Prober(u, self.stop_event) for u in worker_urls]
        self.health_seen: list[tuple[float, bool, list[str]]] = []  # (t answered, ok, problem kinds)
        self.health_sent: list[float] = []  # when each of those requests was sent
        self.load = LoadGen(worker_urls, concurrency=1, max_requests=10**7, max_seconds=3600,
                            request_timeout_s=30.0) if load else None  # fmt: skip
        self._threads = [threading.Thread(target=self._health_loop, daemon=True),
                         threading.Thread(target=self._clock, daemon=True)]  # fmt: skip

    def start(self) -> Watch:
        for p in self.probers:
            p.start()
        for t in self._threads:
            t.start()
        if self.load is not None:
            self.load.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        if self.load is not None:
            self.load.stop()

    def failed(self) -> int:
        return self.load.stats.failed if self.load is not None else 0

    def errors(self) -> list[str]:
        """The load's failed requests, one line each (when, worker, what)."""
        return list(self.load.stats.errors) if self.load is not None else []

    def _clock(self) -> None:
        while not self.stop_event.wait(0.05):
            for p in self.probers:
                p.stalled()

    def _health_loop(self) -> None:
        with httpx.Client(timeout=1.0) as c:
            while not self.stop_event.is_set():
                t0 = time.monotonic()
                kinds: list[str] = []
                try:
                    r = c.get(self.api_url() + "/health")
                    doc = r.json()
                    ok = r.status_code == 200 and bool(doc.get("ok"))
                    kinds = [str(p.get("kind")) for p in doc.get("problems") or []]
                except (httpx.HTTPError, ValueError):
                    ok = False
                t = time.monotonic()
                self.health_sent.append(t0)
                self.health_seen.append((t, ok, kinds))
                time.sleep(max(0.0, HEALTH_EVERY_S - (t - t0)))

    # -- the figures -------------------------------------------------------------------------
    def serving(self, t: float) -> bool:
        return any(p.up.at(t) for p in self.probers)

    def _health_ok_around(self, t: float, answered: list[float], sent: list[float]) -> bool:
        """Ok at `t` only when the last sample answered by `t` and the first one sent from `t` on said ok."""
        seen = self.health_seen
        i = bisect.bisect_right(answered, t)
        before = seen[i - 1][1] if i > 0 else False
        j = bisect.bisect_left(sent, t)
        after = seen[j][1] if j < len(sent) else before
        return before and after

    def figures(self, t0: float, t1: float, expect: tuple[str, ...] = ()) -> dict[str, Any]:
        """Over [t0, t1]: seconds with no worker serving, seconds of that while /health said ok,
        seconds from t0 until /health listed a problem (one of `expect` when given)."""
        step = 0.01
        down = down_ok = 0.0
        n = min(len(self.health_seen), len(self.health_sent))
        answered, sent = [s[0] for s in self.health_seen[:n]], self.health_sent[:n]
        spans: list[list[float]] = []  # [from, to] s after t0 of each outage while /health said ok
        t = t0
        while t < t1:
            if not self.serving(t):
                down += step
                if self._health_ok_around(t, answered, sent):
                    down_ok += step
                    if spans and abs(spans[-1][1] - (t - t0)) < step / 2:
                        spans[-1][1] = round(t - t0 + step, 3)
                    else:
                        spans.append([round(t - t0, 3), round(t - t0 + step, 3)])
            t += step
        visible = None
        for ts, ok, kinds in self.health_seen:
            if ts < t0 or ts > t1:
                continue
            if (expect and any(k in expect for k in kinds)) or (not expect and (kinds or not ok)):
                visible = round(ts - t0, 2)
                break
        kinds_seen = sorted({k for ts, _, ks in self.health_seen if t0 <= ts <= t1 for k in ks})
        return {"no_worker_s": round(down, 2), "outage_while_ok_s": round(down_ok, 2), "outage_while_ok_at": spans,
                "outage_while_ok_seen": [self._around(t0, a, b) for a, b in spans],
                "visible_after_s": visible, "problems_seen": kinds_seen}  # fmt: skip

    def _around(self, t0: float, a: float, b: float) -> dict[str, Any]:
        """What was seen around one outage-while-ok span (s after t0): the probes' requests
        (sent, answered, 200) and the /health samples (sent, answered, ok), for the reader to judge."""
        r = lambda t: round(t - t0, 3)  # noqa: E731

        def near(sent: float, answered: float, before: float, after: float) -> bool:
            return answered >= t0 + a - before and sent <= t0 + b + after

        probes = [[r(s), r(e), ok] for p in self.probers for s, e, ok in list(p.requests) if near(s, e, 2.5, 0.5)]
        health = [[r(s), r(h[0]), h[1]] for s, h in zip(self.health_sent, self.health_seen, strict=False)
                  if near(s, h[0], 0.3, 0.3)]  # fmt: skip
        return {"span": [a, b], "probes": probes, "health": health}
