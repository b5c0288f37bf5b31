"""`GET /v1/workers/{name}/ready`: a load balancer's health check for one worker, served by the daemon.

Engines such as vLLM have no readiness route of their own (vLLM's /health stays 200 while it
is paused or being reloaded), so drain mode needs the daemon to say "stop sending here":

    200 {"ready": true, "state": "RUNNING"}      the daemon last recorded RUNNING and the worker's
                                                 client says ready (not draining; engine healthy)
    503 {"ready": false, "state": ...}           draining, paused, updating, unhealthy, or not yet known
    404 {"error": "no worker named ..."}

Read-only and without auth (load balancers do not carry the control token); it reveals only the
worker's state. Point the balancer's health check for each backend at it.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from daemon.controller.service import RolloutService
from daemon.engines.base import WorkerError
from daemon.rollout.states import WorkerState

NAME_ECHO = 128  # at most this much of an unknown name is echoed back


def readiness_router(service: RolloutService) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/workers/{name}/ready")
    def ready(name: str) -> JSONResponse:
        try:
            h = service.fleet[name]
        except KeyError:
            return JSONResponse({"error": f"no worker named {name[:NAME_ECHO]!r}"}, status_code=404)
        state = h.state
        if state != WorkerState.RUNNING or service.stopping:
            return JSONResponse({"ready": False, "state": state.value if state else "UNKNOWN"}, status_code=503)
        try:
            ok = h.client.ready()
        except WorkerError:
            ok = False
        body = {"ready": ok, "state": state.value}
        return JSONResponse(body, status_code=200 if ok else 503)

    return router
