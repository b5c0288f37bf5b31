"""The worker's error counter counts failed requests, not probes: a 503 from /health or /ready is
the worker saying "not ready" (paused, draining), and an error-rate gate or alert must not trip on
every update. Both still count in hotswap_worker_requests_total."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from daemon.worker.metrics import WorkerMetrics, install_metrics

pytestmark = pytest.mark.quick


def test_probe_503s_are_requests_not_errors() -> None:
    app = FastAPI()
    metrics = WorkerMetrics()
    install_metrics(app, metrics)
    for path in ("/health", "/ready", "/v1/completions"):
        app.add_api_route(path, lambda: JSONResponse({"ok": False}, status_code=503), methods=["GET"])
    with TestClient(app) as client:
        for path in ("/health", "/ready", "/health", "/v1/completions"):
            assert client.get(path).status_code == 503
        text = client.get("/metrics").text
    assert 'hotswap_worker_errors_total{route="/v1/completions"} 1.0' in text
    assert 'route="/health"' not in "\n".join(line for line in text.splitlines() if line.startswith("hotswap_worker_errors"))
    assert 'hotswap_worker_requests_total{code="5xx",route="/health"} 2.0' in text
    assert 'hotswap_worker_requests_total{code="5xx",route="/ready"} 1.0' in text
