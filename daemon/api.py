"""The daemon's HTTP API (loopback by default): health, status, metrics, rollout control.

GET  /health               200 {"ok": true} while the process and its database answer and no configured
                           source is missing; 503 {"ok": false, "error": "<reasons>"} otherwise
GET  /status               JSON: daemon info, sources, checkpoints by status, latest versions, workers
GET  /metrics              Prometheus text format

With workers configured, the rollout routes (`rollout_router`):

GET  /v1/rollout           runner state: serving, last_good, pinned, pending, current job, workers
POST /v1/rollout/rollback  {"to": VERSION | null}  -> the rollback's result (waits for it)
POST /v1/rollout/pin       {"version": VERSION}     -> pins, deploying it if it is not serving
POST /v1/rollout/unpin     {}                       -> unpins; a waiting checkpoint deploys next

Rollout errors answer {"error": "..."}: 404 unknown version, 409 refused (pinned, not verified,
nothing to roll back to), 503 while the daemon is starting, 504 when the command did not
finish within `wait_s` (it still runs). Push ingest (a source) mounts its routes here too.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import APIRouter, Body, FastAPI
from fastapi.responses import JSONResponse, Response
from sqlalchemy import text

import daemon
from daemon.metrics import CONTENT_TYPE, DaemonMetrics
from daemon.registry import Registry
from daemon.registry import queries as q
from daemon.registry.db import redact_url
from daemon.rollout.queue import CommandError
from daemon.rollout.service import RolloutService

DEFAULT_WAIT_S = 900.0


@dataclass
class ApiState:
    registry: Registry
    metrics: DaemonMetrics
    sources: list[dict[str, Any]] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    queue_depth: Callable[[], int] | None = None  # the coordinator's queue depth
    problems: Callable[[], list[str]] | None = None  # why the daemon is unhealthy (a source gone); [] = none


def create_app(state: ApiState) -> FastAPI:
    app = FastAPI(title="hotswap daemon", version=daemon.__version__, docs_url=None, redoc_url=None)

    @app.get("/health")
    def health() -> Response:
        try:
            with state.registry.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:  # noqa: BLE001
            return JSONResponse({"ok": False, "error": f"database: {exc}"}, status_code=503)
        problems = state.problems() if state.problems is not None else []
        if problems:
            return JSONResponse({"ok": False, "error": "; ".join(problems), "problems": problems}, status_code=503)
        return JSONResponse({"ok": True})

    @app.get("/status")
    def status() -> dict[str, Any]:
        return status_document(state)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app


def rollout_router(service: RolloutService) -> APIRouter:
    router = APIRouter(prefix="/v1/rollout")

    def answer(future: Future[dict[str, Any]], wait_s: float) -> JSONResponse:
        try:
            result = future.result(timeout=wait_s)
        except CommandError as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.http_status)
        except FutureTimeout:
            return JSONResponse({"error": f"still running after {wait_s:g} s; see `hotswap status`"}, status_code=504)
        except Exception as exc:  # noqa: BLE001 - the daemon log has the traceback
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)
        return JSONResponse(result)

    def starting() -> JSONResponse | None:
        if not service.wait_ready(0):
            return JSONResponse({"error": "the daemon is still starting (recovering workers)"}, status_code=503)
        return None

    @router.get("")
    def status() -> dict[str, Any]:
        return service.status()

    # Plain `def` handlers: FastAPI runs them in its thread pool, so waiting on the
    # runner's Future does not block the event loop.
    @router.post("/rollback")
    def rollback(body: dict[str, Any] = Body(default_factory=dict)) -> JSONResponse:  # noqa: B008
        to = body.get("to")
        if to is not None and not isinstance(to, str):
            return JSONResponse({"error": "'to' must be a version string or null"}, status_code=422)
        return starting() or answer(service.rollback(to), float(body.get("wait_s", DEFAULT_WAIT_S)))

    @router.post("/pin")
    def pin(body: dict[str, Any] = Body(default_factory=dict)) -> JSONResponse:  # noqa: B008
        version = body.get("version")
        if not isinstance(version, str) or not version:
            return JSONResponse({"error": "'version' (a version string) is required"}, status_code=422)
        return starting() or answer(service.pin(version), float(body.get("wait_s", DEFAULT_WAIT_S)))

    @router.post("/unpin")
    def unpin(body: dict[str, Any] = Body(default_factory=dict)) -> JSONResponse:  # noqa: B008
        return starting() or answer(service.unpin(), float(body.get("wait_s", DEFAULT_WAIT_S)))

    return router


def status_document(state: ApiState) -> dict[str, Any]:
    with state.registry.session() as s:
        counts = q.status_counts(s)
        latest = q.history(s, limit=10)
        workers = q.worker_rows(s)
        aliases = q.aliases(s)
    return {
        "daemon": {
            "version": daemon.__version__,
            "uptime_s": round(time.time() - state.started_at, 1),
            "database": redact_url(state.registry.url),
            "queue_depth": state.queue_depth() if state.queue_depth is not None else None,
            "problems": state.problems() if state.problems is not None else [],
        },
        "sources": state.sources,
        "checkpoints": counts,
        "aliases": aliases,  # serving, last_good, pinned -> version
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
