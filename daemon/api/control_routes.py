"""Who am I, and the fleet's control routes behind named tokens with roles (daemon.common.tokens).

GET  /v1/whoami                 any known token: {"name": ..., "role": ...} (what the CLI prints)
POST /v1/fleet/target           admin: {"version": VERSION | null} -> the fleet target set (or cleared)
POST /v1/fleet/rollout/pause    operator: pause the staged fleet rollout in progress
POST /v1/fleet/rollout/resume   operator: resume it
POST /v1/fleet/rollout/abort    admin: abort it (its version is rejected fleet-wide)

The fleet routes exist on fleet daemons only. Each records the token's name as `by` in its event
(`fleet_target_set`, `fleet_rollout_paused`, ...) and answers with it; a refusal is 409 with one
line (an unknown or unverified version, no rollout in progress).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from daemon.common import Caller, ControlGuard, json_object
from daemon.fleet import StageCommandRefused, TargetRefused, Trust, command, set_fleet_target
from daemon.registry import Journal, Registry

ACTION_ROLE = {"pause": "operator", "resume": "operator", "abort": "admin"}


def whoami_router(guard: ControlGuard) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/whoami")
    def whoami(who: Caller = Depends(guard.require("viewer"))) -> dict[str, Any]:  # noqa: B008
        return {"name": who.name, "role": who.role}

    return router


def fleet_router(registry: Registry, guard: ControlGuard, signing_key: str) -> APIRouter:
    router = APIRouter(prefix="/v1/fleet")
    body_of = Depends(json_object)  # read after the guard: an unauthenticated body is never parsed

    @router.post("/target")
    def target(who: Caller = Depends(guard.require("admin")), body: dict[str, Any] = body_of) -> JSONResponse:  # noqa: B008
        version = body.get("version")
        if version is not None and (not isinstance(version, str) or not version):
            return JSONResponse({"error": "'version' must be a version string, or null to clear"}, status_code=422)
        try:
            set_fleet_target(registry, version, by=who.name, trust=Trust.from_file(signing_key))
        except TargetRefused as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        return JSONResponse({"version": version, "by": who.name})

    for action, role in ACTION_ROLE.items():
        router.add_api_route(f"/rollout/{action}", _rollout_action(registry, action, guard.require(role)),
                             methods=["POST"], name=f"fleet_rollout_{action}")  # fmt: skip
    return router


def _rollout_action(registry: Registry, action: str, require: Any) -> Any:
    def act(who: Caller = Depends(require)) -> JSONResponse:  # noqa: B008
        try:
            done = command(Journal(registry), action, by=who.name)
        except StageCommandRefused as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        return JSONResponse({"done": done, "by": who.name})

    return act
