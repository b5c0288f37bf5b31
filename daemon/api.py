"""The daemon's HTTP API (loopback by default): health, status, metrics. Push ingest comes later.

GET /health   200 {"ok": true} while the process and its database answer; 503 otherwise
GET /status   JSON: daemon info, checkpoints by status, latest versions, workers
GET /metrics  Prometheus text format
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from sqlalchemy import text

import daemon
from daemon.metrics import CONTENT_TYPE, DaemonMetrics
from daemon.registry import Registry
from daemon.registry import queries as q
from daemon.registry.db import redact_url


@dataclass
class ApiState:
    registry: Registry
    metrics: DaemonMetrics
    sources: list[dict[str, Any]] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    queue_depth: Any = None  # callable returning the coordinator's queue depth


def create_app(state: ApiState) -> FastAPI:
    app = FastAPI(title="hotswap daemon", version=daemon.__version__, docs_url=None, redoc_url=None)

    @app.get("/health")
    def health() -> Response:
        try:
            with state.registry.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:  # noqa: BLE001
            return JSONResponse({"ok": False, "error": f"database: {exc}"}, status_code=503)
        return JSONResponse({"ok": True})

    @app.get("/status")
    def status() -> dict[str, Any]:
        return status_document(state)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app


def status_document(state: ApiState) -> dict[str, Any]:
    with state.registry.session() as s:
        counts = q.status_counts(s)
        latest = q.history(s, limit=10)
        workers = q.worker_rows(s)
    return {
        "daemon": {
            "version": daemon.__version__,
            "uptime_s": round(time.time() - state.started_at, 1),
            "database": redact_url(state.registry.url),
            "queue_depth": state.queue_depth() if callable(state.queue_depth) else None,
        },
        "sources": state.sources,
        "checkpoints": counts,
        "latest": [_jsonable_row(r) for r in latest],
        "workers": [_jsonable_row(r) for r in workers],
    }


def _jsonable_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in row.items()}


class ApiServer:
    """uvicorn in a background thread on a socket bound up front (so port 0 works)."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="api", daemon=True
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=5)
        self.sock.close()
