"""`POST /admin/init_weight_group`: the reference worker joins a trainer's torch.distributed group.

    {master_address, master_port, rank_offset, world_size, backend: "gloo"|"nccl", group_name, timeout_s}
    -> {group_name, rank, world_size, backend, join_ms}

It answers once every rank has joined (at most `timeout_s`); the following
`POST /admin/update {transport: "broadcast", group_name, table, ...}` receives the weights
(`daemon.transport.broadcast_worker`). Errors: 422 bad body, 502 the group could not be joined.
Mounted by one line in `daemon.worker.server.create_app` (behind its admin token check).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from daemon.transport import BadUpdateRequest, GroupSpec, TransportError, join
from daemon.worker.updates import BadRequest, UpdateError


class JoinFailed(UpdateError):
    status = 502


def weight_group_route(ctl: Any) -> Callable[[Request], Awaitable[dict[str, Any]]]:
    """The route body for the worker's `admin(...)` wrapper (it checks the token, maps UpdateError)."""

    async def init_weight_group(request: Request) -> dict[str, Any]:
        try:
            spec = GroupSpec.from_json(json.loads(await request.body() or b"{}"))
        except ValueError as exc:  # BadUpdateRequest, or JSON that does not parse
            raise BadRequest(str(exc) if isinstance(exc, BadUpdateRequest) else "body is not valid JSON") from None
        if ctl.store.unhealthy:
            raise BadRequest(f"worker is unhealthy ({ctl.store.unhealthy}): restore it before a broadcast")
        try:
            result: dict[str, Any] = await run_in_threadpool(join, spec, ctl.model_dir, ctl.store.device)
        except BadUpdateRequest as exc:
            raise BadRequest(str(exc)) from None
        except TransportError as exc:
            raise JoinFailed(str(exc)) from None
        return result

    return init_weight_group
