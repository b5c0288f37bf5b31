"""Readiness for load balancers, served by the daemon: the host's (`GET /ready`) and each worker's.

`GET /ready` says "this host serves": 200 while at least one worker of every group serves
(RUNNING, or paused for an update for under a second), whatever a source, the database or a
warning says; 503 while a group has none, or the daemon is stopping. Point a load balancer that
fronts whole hosts at it. `/health` is for alerting (503 while any critical problem holds, a
failing S3 source included: a balancer on it would drain a host that serves), `/livez` for
liveness (systemd, orchestrators):

    200 {"ready": true, "groups": {"default": ["w0", "w1"]}}
    503 {"ready": false, "error": "no worker of group 'default' serves", "groups": {"default": []}}

`GET /v1/workers/{name}/ready`, one worker:

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

from daemon.controller import RolloutService, groups_serving
from daemon.engines import WorkerError
from daemon.rollout import WorkerState

NAME_ECHO = 128  # at most this much of an unknown name is echoed back


def readiness_router(service: RolloutService) -> APIRouter:
    router = APIRouter()

    @router.get("/ready")
    def host_ready() -> JSONResponse:
        groups = groups_serving(service.fleet)
        idle = [g for g, names in sorted(groups.items()) if not names]
        if service.stopping:
            return JSONResponse({"ready": False, "error": "the daemon is stopping", "groups": groups}, status_code=503)
        if idle:
            why = "; ".join(f"no worker of group {g!r} serves" for g in idle)
            return JSONResponse({"ready": False, "error": why, "groups": groups}, status_code=503)
        return JSONResponse({"ready": True, "groups": groups})

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
