"""The HTTP face of a trainer broadcast: parse, authenticate, start, answer.

    POST /v1/broadcast            {version, table, master_address, master_port, backend?, timeout_s?,
                                  bucket_bytes?, step?}
                                  -> 202 {session, group_name, world_size, workers, rollout_id}
    GET  /v1/broadcast/{session}  ?wait_s=N -> 200 the session's result, 202 while it runs

Both need the control token (`daemon.auth.ControlGuard`). `daemon.client.broadcast.BroadcastPush` is the
caller. The body is parsed and, with signing keys, its signature checked
(`daemon.api.broadcast_trust`) before any worker is touched; the session itself (the workers
paused, joined to the trainer's group, fed, checked, resumed or put back, and the registry's
record) is daemon.controller.broadcast. A refusal answers with its status and, when it is
transient, `Retry-After`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from daemon.api.broadcast_trust import signed_digest
from daemon.checks import CheckSettings
from daemon.common import ControlGuard, JsonBodyError, parse_object, read_capped
from daemon.controller import BroadcastSessions, Refusal, RolloutService
from daemon.transport import DEFAULT_BUCKET_BYTES, BadUpdateRequest, GroupSpec, parse_table, table_to_json

__all__ = ["Broadcasts", "Refusal", "broadcast_router", "refused"]

MAX_TABLE_BODY_BYTES = 16 << 20  # a tensor table of ~100k entries; the trainer is authenticated first


def refused(exc: Refusal) -> JSONResponse:
    """The answer to a refused session; `Retry-After` only when the refusal is transient."""
    headers = {} if exc.retry_after_s is None else {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    return JSONResponse({"error": str(exc)}, status_code=exc.status_code, headers=headers)


class Broadcasts:
    """Parses and authenticates a session's body, then hands it to the daemon's sessions."""

    def __init__(self, service: RolloutService, state_dir: Path, checks: CheckSettings | None = None) -> None:
        self.service = service
        self.checks = checks
        self.sessions = BroadcastSessions(service, state_dir, checks)

    def begin(self, body: Any) -> dict[str, Any]:
        version, table, spec = self._parse(body)
        signed = signed_digest(body, version, table, self.checks)  # before any worker is touched
        return self.sessions.start(version, table, spec, body, signed)

    def result(self, session: str, wait_s: float) -> tuple[int, dict[str, Any]]:
        return self.sessions.result(session, wait_s)

    def _parse(self, body: Any) -> tuple[str, list[dict[str, Any]], GroupSpec]:
        if not isinstance(body, dict):
            raise Refusal(422, "body must be a JSON object")
        version = body.get("version")
        if not isinstance(version, str) or not version.strip() or len(version) > 200:
            raise Refusal(422, "'version' must be a non-empty string (at most 200 characters)")
        try:
            table = parse_table(body.get("table"))
            spec = GroupSpec.from_json({**body, "rank_offset": 1, "world_size": len(self.service.fleet) + 1,
                                        "group_name": "check"})  # fmt: skip
            bucket = body.get("bucket_bytes", DEFAULT_BUCKET_BYTES)
            if not isinstance(bucket, int) or isinstance(bucket, bool) or not 1 <= bucket <= 1 << 34:
                raise BadUpdateRequest("'bucket_bytes' must be an integer in [1, 16 GiB]")
        except BadUpdateRequest as exc:
            raise Refusal(422, str(exc)) from None
        bound = self.service.settings.broadcast_max_pause_s
        if float(body.get("timeout_s", 0)) > bound:
            raise Refusal(422, f"'timeout_s' {body.get('timeout_s')} is above this daemon's bound on a session's "
                               f"pause ([rollout] broadcast_max_pause_s = {bound:g})")  # fmt: skip
        step = body.get("step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise Refusal(422, "'step' must be an integer")
        return version.strip(), table_to_json(table), spec


def broadcast_router(service: RolloutService, state_dir: Path, guard: ControlGuard,
                     checks: CheckSettings | None = None) -> APIRouter:  # fmt: skip
    """The broadcast routes, behind the daemon's control token (mounted by one line in daemon.service)."""
    sessions = Broadcasts(service, state_dir, checks)
    router = APIRouter(prefix="/v1/broadcast", dependencies=[Depends(guard)])

    @router.post("")
    async def begin(request: Request) -> Response:
        try:  # a tensor table: larger than a control body, still capped in bytes and depth
            body = parse_object(await read_capped(request, MAX_TABLE_BODY_BYTES))
        except JsonBodyError as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        try:
            return JSONResponse(await run_in_threadpool(sessions.begin, body), status_code=202)
        except Refusal as exc:
            return refused(exc)

    @router.get("/{session}")
    async def result(session: str, wait_s: float = 0.0) -> Response:
        try:
            code, doc = await run_in_threadpool(sessions.result, session, wait_s)
        except Refusal as exc:
            return refused(exc)
        return JSONResponse(doc, status_code=code)

    return router
