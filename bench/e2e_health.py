"""The daemon's own /health, polled while the rollouts of bench/gpu_e2e.py run: what an orchestrator
or a load balancer's health check sees during an update (latency and answers), beside the
commit -> serving figures of the same run."""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from typing import Any

import httpx


class HealthProbe:
    """A thread that GETs `<api>/health` every `interval_s` until stopped; one request at a time,
    a fresh connection is not forced (a health checker keeps its connection too)."""

    def __init__(self, api_url: str, interval_s: float = 0.05) -> None:
        self.url, self.interval_s = api_url + "/health", interval_s
        self.latencies_ms: list[float] = []
        self.answers: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    answer = str(client.get(self.url).status_code)
                except httpx.HTTPError as exc:
                    answer = type(exc).__name__
                self.latencies_ms.append((time.perf_counter() - t0) * 1000)
                self.answers[answer] += 1
                self._stop.wait(self.interval_s)

    def summary(self) -> dict[str, Any]:
        v = sorted(self.latencies_ms)
        if not v:
            return {"n": 0}
        return {"n": len(v), "p50_ms": statistics.median(v), "p99_ms": v[min(len(v) - 1, int(0.99 * len(v)))],
                "max_ms": v[-1], "answers": dict(self.answers)}  # fmt: skip
