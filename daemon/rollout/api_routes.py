"""The daemon HTTP API's rollout routes (mounted by daemon.api on the daemon's loopback API).

GET  /v1/rollout           runner state: serving, last_good, pinned, pending, current job, workers
POST /v1/rollout/rollback  {"to": VERSION | null}  -> the rollback's result (waits for it)
POST /v1/rollout/pin       {"version": VERSION}     -> pins, deploying it if it is not serving
POST /v1/rollout/unpin     {}                       -> unpins; a waiting checkpoint deploys next

Errors answer {"error": "..."}: 404 unknown version, 409 refused (pinned, not
verified, nothing to roll back to), 503 while the daemon is starting, 504 when
the command did not finish within `wait_s` (it still runs).
"""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from fastapi import APIRouter, Body
from fastapi.responses import JSONResponse

from daemon.rollout.commands import CommandError
from daemon.rollout.service import RolloutService

DEFAULT_WAIT_S = 900.0


def make_router(service: RolloutService) -> APIRouter:
    router = APIRouter(prefix="/v1/rollout")

    def answer(future: Future[dict[str, Any]], wait_s: float) -> JSONResponse:
        try:
            result = future.result(timeout=wait_s)
        except CommandError as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
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
