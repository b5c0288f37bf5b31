"""The worker's health and admin routes, and the private server that carries them.

Routes (admin ones need `Authorization: Bearer <token>`, compared in constant time; without a
token the admin routes answer 403):

    GET  /health, /ready                          (no auth)
    POST /admin/identify {nonce}   -> {proof}     (no auth: the worker proves it holds the launch
                                                   secret before the daemon sends its token;
                                                   daemon/common/identity.py)
    GET  /weight_info
    POST /admin/drain|pause|resume|prepare|update|rollback|probe
                                                  (prepare: the update body, opened and validated
                                                   while serving; the next update of it only writes;
                                                   update?then=resume: resumes right after the write
                                                   and probes serving, flipping back if it fails)
    POST /admin/adapters/load|unload              LoRA adapters by name, nothing paused (lora_admin.py)

With `--admin-uds PATH` these routes are served by `AdminServer`: its own uvicorn server, event
loop and thread, on a Unix socket (0600, in a directory that must be 0700 and ours), so no
serving load (huge bodies, long prompts, hundreds of connections on the TCP port) delays them,
and no other local user can reach them. The TCP port then carries only serving, /health and
/ready.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from daemon.common import (
    JsonBodyError,
    ListenerLimits,
    check_private_socket_dir,
    guarded_protocol,
    parse_object,
    proof,
    valid_nonce,
)
from daemon.worker import lora_admin
from daemon.worker.limits import ADMIN_MAX_BODY_BYTES, BodyLimit
from daemon.worker.updates import UpdateError
from daemon.worker.weight_group import weight_group_route

log = logging.getLogger("hotswap.worker.admin")


class BadBody(Exception):
    pass


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)


def _number(body: dict[str, Any], key: str, default: float) -> float:
    v = body.get(key, default)
    if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
        raise BadBody(f"'{key}' must be a non-negative number")
    return float(v)


async def body_of(request: Request) -> dict[str, Any]:
    try:  # malformed, too deep (RecursionError inside json) or not an object: 400, never 500
        return parse_object(await request.body())
    except JsonBodyError as exc:
        raise BadBody(str(exc)) from None


def health_answer(ctl: Any) -> tuple[int, dict[str, Any]]:
    if ctl.store.unhealthy:
        return 503, {"error": f"unhealthy: {ctl.store.unhealthy}", "state": ctl.state.value}
    return 200, {"status": "ok", "state": ctl.state.value}


def ready_answer(ctl: Any) -> tuple[int, dict[str, Any]]:
    if ctl.ready():
        return 200, {"ready": True, "version": ctl.store.current.version}
    return 503, {"error": f"not ready: state {ctl.state.value}", "ready": False, "state": ctl.state.value}


def health_router(ctl: Any) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        status, doc = health_answer(ctl)
        return JSONResponse(doc, status_code=status)

    @router.get("/ready")
    async def ready() -> Response:
        status, doc = ready_answer(ctl)
        return JSONResponse(doc, status_code=status)

    return router


class ProbesFirst:
    """ASGI: `GET /health` and `/ready` on the serving port answered before the app (no routing, no
    middleware), so a probe under 200 concurrent completions does the least work on the loop
    (issue 37: /health under 100 ms); the answers are health_router's."""

    def __init__(self, app: Any, ctl: Any) -> None:
        self.app, self.ctl = app, ctl

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or scope.get("method") != "GET" or path not in ("/health", "/ready"):
            await self.app(scope, receive, send)
            return
        status, doc = (health_answer if path == "/health" else ready_answer)(self.ctl)
        body = json.dumps(doc, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


def admin_router(ctl: Any, token: bytes | None) -> APIRouter:
    router = APIRouter()

    def authorized(request: Request) -> JSONResponse | None:
        if token is None:
            return _error(403, "admin API disabled: start the worker with --token-file")
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token):
            return _error(401, "missing or wrong bearer token")
        return None

    def admin(fn: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            denied = authorized(request)
            if denied is not None:
                return denied
            try:
                result = await fn(request)
            except BadBody as exc:
                return _error(400, str(exc))
            except UpdateError as exc:
                return _error(exc.status, str(exc), state=ctl.state.value, **exc.detail)
            return JSONResponse(result)

        return route

    async def identify(request: Request) -> Response:
        if token is None:
            return _error(403, "admin API disabled: start the worker with --token-file")
        raw = await request.body()
        try:
            nonce = json.loads(raw).get("nonce") if len(raw) <= 1024 else None
        except (ValueError, AttributeError):
            nonce = None
        if not valid_nonce(nonce):
            return _error(400, "'nonce' must be 32-256 lowercase hex characters")
        assert isinstance(nonce, str)
        return JSONResponse({"proof": proof(token, nonce)})

    async def weight_info(request: Request) -> dict[str, Any]:
        info: dict[str, Any] = ctl.weight_info()
        return info

    async def drain(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return await run_in_threadpool(ctl.drain, _number(body, "timeout_s", 30.0))

    async def pause(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return await run_in_threadpool(ctl.pause, body.get("mode", "keep"), _number(body, "timeout_s", 30.0))

    async def resume(request: Request) -> dict[str, Any]:
        return await run_in_threadpool(ctl.resume)

    async def update(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        then = request.query_params.get("then")
        if then not in (None, "resume"):
            raise BadBody(f"'then' must be 'resume', not {then!r}")
        return await run_in_threadpool(functools.partial(ctl.update, body, resume_after=then == "resume"))

    async def prepare(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return await run_in_threadpool(ctl.prepare, body)

    async def rollback(request: Request) -> dict[str, Any]:
        return await run_in_threadpool(ctl.rollback)

    async def map_ahead(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return await run_in_threadpool(ctl.map_ahead, body)

    async def read_ahead(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return await run_in_threadpool(ctl.read_ahead, body)

    async def probe_route(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        n = body.get("max_tokens", 4)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
            raise BadBody("'max_tokens' must be an integer in [1, 64]")
        adapter = body.get("adapter")
        if adapter is not None:
            if not isinstance(adapter, str):
                raise BadBody("'adapter' must be a string")
            return await run_in_threadpool(lora_admin.adapter_probe, ctl, adapter, n)
        return await run_in_threadpool(ctl.probe, n)

    async def adapter_load(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return await run_in_threadpool(lora_admin.load_adapter, ctl, body)

    async def adapter_unload(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return await run_in_threadpool(lora_admin.unload_adapter, ctl, body)

    router.add_api_route("/admin/identify", identify, methods=["POST"])
    router.add_api_route("/weight_info", admin(weight_info), methods=["GET"])
    for name, fn in (("drain", drain), ("pause", pause), ("resume", resume), ("update", update),
                     ("prepare", prepare), ("rollback", rollback), ("probe", probe_route), ("map_ahead", map_ahead),
                     ("read_ahead", read_ahead)):
        router.add_api_route(f"/admin/{name}", admin(fn), methods=["POST"])
    router.add_api_route("/admin/init_weight_group", admin(weight_group_route(ctl)), methods=["POST"])  # broadcast
    router.add_api_route("/admin/adapters/load", admin(adapter_load), methods=["POST"])  # LoRA: lora_admin.py
    router.add_api_route("/admin/adapters/unload", admin(adapter_unload), methods=["POST"])
    return router


def create_admin_app(ctl: Any, token: bytes | None) -> Any:
    """The app `AdminServer` serves on the Unix socket: health, ready and the admin routes."""
    app = FastAPI(title="hotswap worker admin", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(health_router(ctl))
    app.include_router(admin_router(ctl, token))
    return BodyLimit(app, ADMIN_MAX_BODY_BYTES)


def bind_private_socket(path: Path) -> socket.socket:
    """A listening Unix socket at `path`, 0600, in a directory that must be ours and 0700.

    A stale socket file left by a dead worker is replaced; anything else at the path is refused."""
    check_private_socket_dir(path)
    if path.is_socket():
        path.unlink()
    elif path.exists() or path.is_symlink():
        raise OSError(f"--admin-uds {path}: exists and is not a socket; refusing to replace it")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


class AdminServer:
    """Serves `create_admin_app` on its own thread and event loop, from a pre-bound socket."""

    def __init__(self, app: Any, sock: socket.socket, path: Path) -> None:
        self.path = path
        self._sock = sock
        self._inode = _inode(path)  # the socket file it made (a newer worker's may take the path)
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                backlog=64,
                                http=guarded_protocol(ListenerLimits(max_connections=64, max_per_address=16), "worker admin"))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="hotswap-admin", daemon=True)  # fmt: skip

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"admin server on {self.path} did not start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()
        # Only its own socket file: in a restart rollout's handover the path is the new worker's by now.
        if self._inode is not None and _inode(self.path) == self._inode:
            with contextlib.suppress(OSError):
                self.path.unlink()


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
