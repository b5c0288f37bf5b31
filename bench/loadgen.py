"""A load-balancer-like load generator, shared by the end-to-end tests and benchmarks.

Client threads send short completions round-robin across workers. Before each request a
client skips workers whose last `/ready` answer (polled every 50 ms; or another readiness URL per worker) was not 200, as a load
balancer's health check would; a request a worker answers 503 (it started draining meanwhile)
is retried on the next worker, like nginx `proxy_next_upstream http_503`, and counted in
`retried_503`. When no worker answered ready (on a busy host a readiness probe can time out) a
request still goes out, to each in turn; a connection error from one that was not ready is tried on
the next too (`retried_unready`). Anything else is a failed request: another status, a connection
error or timeout from a worker that was ready, 503 on every worker, or a 200 whose body is not a
completion (not a JSON object with a non-empty `choices` list). Bounded in time (and optionally in
request count); loopback only.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

MAX_KEPT_ERRORS = 1000


@dataclass
class LoadStats:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    retried_503: int = 0
    retried_unready: int = 0  # a connection error from a worker not ready, tried on the next
    errors: list[str] = field(default_factory=list)  # the first MAX_KEPT_ERRORS failures, one line each
    versions: Counter[str] = field(default_factory=Counter)  # weight_version of each success
    latencies: list[float] = field(default_factory=list)  # seconds per successful request
    answered: list[tuple[float, float, str]] = field(default_factory=list)  # (sent, answered) Unix times, version

    def longest_silence(self, start: float, end: float) -> float:
        """The longest stretch of [start, end] (Unix times) in which no request was answered."""
        times = sorted(t for _, t, _ in self.answered if start <= t <= end)
        edges = [start, *times, end]
        return max(b - a for a, b in zip(edges, edges[1:], strict=False))


def completion(r: httpx.Response) -> dict[str, Any] | None:
    """The body of a 200 when it is a completion (a JSON object with a non-empty `choices` list)."""
    try:
        doc = r.json()
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("choices"), list) and doc["choices"] else None


class LoadGen:
    def __init__(
        self,
        urls: list[str],
        *,
        concurrency: int = 2,
        max_requests: int | None = None,
        max_seconds: float = 600.0,
        max_tokens: int = 3,
        body: dict[str, Any] | None = None,
        request_timeout_s: float = 120.0,
        headers: dict[str, str] | None = None,
        ready_urls: dict[str, str] | None = None,
    ) -> None:
        """`ready_urls`: where each worker's readiness is read, when not `{url}/ready` (a vLLM has
        none: the daemon's `GET /v1/workers/{name}/ready` says it, as a load balancer would be told).
        `max_requests`: stop sending after that many (None: `max_seconds` alone bounds the load; a
        fixed count ran out in a test whose rollouts were slow on a busy host)."""
        self.urls = urls
        self.ready_urls = {u: (ready_urls or {}).get(u, f"{u}/ready") for u in urls}
        self.headers = dict(headers or {})  # e.g. an engine's bearer token, sent with every completion
        self.concurrency = concurrency
        self.max_requests = max_requests
        self.max_seconds = max_seconds
        self.body = body or {"prompt": [1, 3, 5, 7], "max_tokens": max_tokens, "ignore_eos": True}
        self.request_timeout_s = request_timeout_s
        self.stats = LoadStats()
        self._ready = dict.fromkeys(urls, True)
        self._rr = 0
        self._deadline = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> LoadGen:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._deadline = time.monotonic() + self.max_seconds
        self._threads = [threading.Thread(target=self._health_loop, daemon=True)]
        self._threads += [threading.Thread(target=self._loop, daemon=True) for _ in range(self.concurrency)]
        for t in self._threads:
            t.start()

    def stop(self) -> LoadStats:
        self._stop.set()
        for t in self._threads:
            t.join(self.request_timeout_s + 5)
        return self.stats

    def wait_requests(self, n: int, timeout: float = 60.0) -> None:
        """Block until `n` more requests have succeeded; an error naming why as soon as no request
        can come any more (the load stopped sending), or past `timeout`."""
        start, deadline = self.stats.ok, time.monotonic() + timeout
        while self.stats.ok < start + n:
            if not any(t.is_alive() for t in self._threads[1:]) and self.stats.ok < start + n:
                raise RuntimeError(f"load: stopped sending after {self.stats.sent} requests ({self._why_stopped()}); "
                                   f"{self.stats.ok - start} of {n} more succeeded")  # fmt: skip
            if time.monotonic() > deadline:
                raise TimeoutError(f"load: fewer than {n} successful requests in {timeout:g}s "
                                   f"({self.stats.sent} sent in all); errors {self.stats.errors[:3]}")  # fmt: skip
            time.sleep(0.02)

    def _why_stopped(self) -> str:
        if self._stop.is_set():
            return "stopped"
        if self.max_requests is not None and self.stats.sent >= self.max_requests:
            return f"max_requests {self.max_requests} reached"
        return f"max_seconds {self.max_seconds:g} passed"

    def snapshot(self) -> dict[str, Any]:
        """Counters and latency percentiles so far (benchmarks diff two snapshots)."""
        with self._lock:
            s = self.stats
            lat = sorted(s.latencies)
            return {
                "ok": s.ok, "failed": s.failed, "retried_503": s.retried_503, "retried_unready": s.retried_unready,
                "latency_p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
                "latency_p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else None,
                "latency_max_ms": 1000 * lat[-1] if lat else None,
                "versions_served": dict(s.versions),
            }  # fmt: skip

    def _health_loop(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.is_set():
                for url in self.urls:
                    try:
                        self._ready[url] = client.get(self.ready_urls[url]).status_code == 200
                    except httpx.HTTPError:
                        self._ready[url] = False
                time.sleep(0.05)

    def _order(self) -> list[str]:
        with self._lock:
            self._rr += 1
            order = [self.urls[(self._rr + i) % len(self.urls)] for i in range(len(self.urls))]
        ready = [u for u in order if self._ready.get(u)]
        return ready + [u for u in order if u not in ready]  # unready ones last, never none

    def _loop(self) -> None:
        with httpx.Client(timeout=self.request_timeout_s, headers=self.headers) as client:
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                with self._lock:
                    if self.max_requests is not None and self.stats.sent >= self.max_requests:
                        return
                    self.stats.sent += 1
                self._one(client)

    def _one(self, client: httpx.Client) -> None:
        t0, sent_at = time.perf_counter(), time.time()
        last = ""
        for attempt, url in enumerate(self._order()):
            ready = bool(self._ready.get(url))
            try:
                r = client.post(f"{url}/v1/completions", json=self.body)
            except httpx.HTTPError as exc:
                last = f"{url}: {type(exc).__name__}: {exc}"
                if not ready and attempt + 1 < len(self.urls):
                    # no worker answered ready (its readiness probe timed out on a busy host) and
                    # this one, tried anyway, was not serving: a balancer tries the next, as on a 503
                    with self._lock:
                        self.stats.retried_unready += 1
                    continue
                break
            if r.status_code == 503 and attempt + 1 < len(self.urls):
                self._ready[url] = False
                with self._lock:
                    self.stats.retried_503 += 1
                continue
            if r.status_code == 200:
                doc = completion(r)
                if doc is None:
                    last = f"{url}: HTTP 200 without a completion: {r.text[:200]!r}"
                    break
                with self._lock:
                    self.stats.ok += 1
                    self.stats.latencies.append(time.perf_counter() - t0)
                    version = str(doc.get("weight_version", "?"))
                    self.stats.versions[version] += 1
                    self.stats.answered.append((sent_at, time.time(), version))
                return
            last = f"{url}: HTTP {r.status_code} {r.text[:200]}"
            break
        with self._lock:
            self.stats.failed += 1
            if len(self.stats.errors) < MAX_KEPT_ERRORS:
                self.stats.errors.append(f"{time.strftime('%H:%M:%S')} {last}")
