"""`POST /v1/checkpoints/reverify`: the daemon side of `hotswap reverify` (daemon.cli.reverify).

Sends a settled version (not the serving one) back to `discovered`, so it goes through fetch and
every check again like a new arrival; the coordinator decides what may be verified again.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from daemon.common import Caller, ControlGuard, json_object
from daemon.pipeline import OPERATOR_REVERIFY as WHY
from daemon.pipeline import Coordinator


def router(coordinator: Coordinator, guard: ControlGuard) -> APIRouter:
    r = APIRouter(prefix="/v1/checkpoints")
    operator = Depends(guard.require("operator"))

    @r.post("/reverify")
    def reverify(who: Caller = operator, body: dict[str, Any] = Depends(json_object)) -> JSONResponse:  # noqa: B008 - read after the guard
        version = body.get("version")
        if not isinstance(version, str) or not version or len(version) > 255:
            return JSONResponse({"error": "'version' must be a version label"}, status_code=400)
        try:
            was = coordinator.reverify(version, WHY.replace("an operator", who.name))  # the token's name, in the event
        except LookupError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        return JSONResponse({"version": version, "was": was, "outcome": "queued", "by": who.name})

    return r
