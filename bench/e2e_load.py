"""A load balancer-like load generator for the end-to-end benchmarks.

Several client threads send short completions round-robin across the workers. Before each
request a client skips workers whose last `/ready` answer (polled every 50 ms) was not 200,
as a load balancer's health check would; a request answered 503 (the worker turned unready
meanwhile) is retried once on the next worker, like nginx `proxy_next_upstream http_503`,
and counted in `retried_503`. A request that ends without a 200 (any other status, a
connection error, a timeout, or 503 on every worker) counts as failed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx


class LoadGen:
    def __init__(
        self, urls: list[str], *, concurrency: int = 4, max_tokens: int = 4, timeout_s: float = 120.0
    ) -> None:
        self.urls = urls
        self.concurrency = concurrency
        self.body = {"prompt": [1, 3, 5, 7], "max_tokens": max_tokens, "ignore_eos": True}
        self.timeout_s = timeout_s
        self.ok = self.failed = self.retried_503 = 0
        self.errors: list[str] = []
        self.versions: dict[str, int] = {}
        self.latencies: list[float] = []
        self._ready = dict.fromkeys(urls, True)
        self._rr = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> LoadGen:
        self._threads = [threading.Thread(target=self._health_loop, daemon=True)]
        self._threads += [threading.Thread(target=self._loop, daemon=True) for _ in range(self.concurrency)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 5)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            lat = sorted(self.latencies)
            return {
                "ok": self.ok, "failed": self.failed, "retried_503": self.retried_503,
                "latency_p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
                "latency_p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else None,
                "latency_max_ms": 1000 * lat[-1] if lat else None,
                "versions_served": dict(self.versions),
            }  # fmt: skip

    def wait_ok(self, n: int, timeout: float) -> None:
        start, deadline = self.ok, time.monotonic() + timeout
        while self.ok < start + n:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"load: fewer than {n} successful requests in {timeout:g}s; errors {self.errors[:3]}"
                )
            time.sleep(0.02)

    def _health_loop(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.is_set():
                for url in self.urls:
                    try:
                        self._ready[url] = client.get(f"{url}/ready").status_code == 200
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
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                self._one(client)

    def _one(self, client: httpx.Client) -> None:
        t0 = time.perf_counter()
        last = ""
        for attempt, url in enumerate(self._order()[:2]):
            try:
                r = client.post(f"{url}/v1/completions", json=self.body)
            except httpx.HTTPError as exc:
                last = f"{url}: {type(exc).__name__}: {exc}"
                break
            if r.status_code == 200:
                version = str(r.json().get("weight_version"))
                with self._lock:
                    self.ok += 1
                    self.latencies.append(time.perf_counter() - t0)
                    self.versions[version] = self.versions.get(version, 0) + 1
                return
            last = f"{url}: HTTP {r.status_code}: {r.text[:200]}"
            if r.status_code != 503 or attempt == 1:
                break
            with self._lock:
                self.retried_503 += 1
        with self._lock:
            self.failed += 1
            if len(self.errors) < 100:
                self.errors.append(f"{time.strftime('%H:%M:%S')} {last}")
