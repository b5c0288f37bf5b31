"""The reference worker's `GET /metrics` (Prometheus text): requests, errors, latency, tokens.

A pure-ASGI middleware counts every HTTP request by route and status class and times it
(streamed responses until their last byte); completions add the tokens they generated. One
private `CollectorRegistry` per app, so several workers in one test process do not collide.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
KNOWN_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics", "/weight_info")
# A 503 from a probe is the worker saying "not ready" (paused, draining, loading), not a failed request:
# counted in requests, never in errors, so an error-rate gate or alert does not trip on every update.
PROBE_ROUTES = ("/health", "/ready")


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("hotswap_worker_requests", "HTTP requests answered, by route and status class",
                                ["route", "code"], registry=self.registry)  # fmt: skip
        self.errors = Counter("hotswap_worker_errors", "Requests answered 5xx, by route (not /health or /ready)", ["route"],
                              registry=self.registry)  # fmt: skip
        self.latency = Histogram("hotswap_worker_request_seconds", "Time to the last byte of a response, by route",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)  # fmt: skip
        self.tokens = Counter("hotswap_worker_generated_tokens", "Tokens generated for clients",
                              registry=self.registry)  # fmt: skip

    def render(self) -> bytes:
        return generate_latest(self.registry)


def route_label(path: str) -> str:
    # a fixed label set: arbitrary client paths must not create unbounded series
    if path in KNOWN_ROUTES:
        return path
    return "/admin" if path.startswith("/admin") else "other"


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: WorkerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_label(scope.get("path", ""))
        t0 = time.perf_counter()
        status = {"code": 500}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            code = status["code"]
            self.metrics.requests.labels(route=route, code=f"{code // 100}xx").inc()
            if code >= 500 and route not in PROBE_ROUTES:
                self.metrics.errors.labels(route=route).inc()
            self.metrics.latency.labels(route=route).observe(time.perf_counter() - t0)


def install_metrics(app: Any, metrics: WorkerMetrics) -> None:
    """`GET /metrics` plus the middleware, on the worker's FastAPI app."""
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    @app.get("/metrics", include_in_schema=False)
    async def scrape(_request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)
