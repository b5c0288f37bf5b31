"""`hotswap worker`: serve one causal LM and take new weights in place, without a restart.

    hotswap worker --model DIR --port N [--host 127.0.0.1] [--token-file F]
                   [--device auto|cpu|cuda:N] [--version V] [--uds PATH] [--max-batch N]
                   [--served-model-name NAME] [--max-body-bytes N] [--max-queue N]

Routes (admin ones need `Authorization: Bearer <token>`, the token read from --token-file and
compared in constant time; without --token-file the admin routes answer 403):

    GET  /health          200, or 503 when UNHEALTHY            (no auth)
    GET  /ready           200 only in RUNNING with weights loaded (no auth)
    GET  /v1/models       the served model name; weight version in its metadata (no auth)
    POST /v1/completions, /v1/chat/completions
                          OpenAI-compatible serving (completions.py); every response has
                          weight_version (no auth)
    GET  /weight_info     version, digest, state, in_flight, tensors, bytes, device, update_count,
                          requests_total, requests_failed, ...
    POST /admin/drain     {timeout_s}           POST /admin/pause {mode: keep|wait, timeout_s}
    POST /admin/resume                          POST /admin/rollback
    POST /admin/update    {version, transport, path|descriptor, mode, expect: {digest, tensors, files}}
    POST /admin/probe     {max_tokens}: one greedy generation even while paused (post-update check)

Serving errors are OpenAI error objects {"error": {message, type, param, code}}: 400 invalid
request, 404 unknown model or route, 413 body over --max-body-bytes, 429 at capacity
(--max-batch running + --max-queue waiting), 500 generation failed, 503 draining/unhealthy.
Admin errors are {"error": "..."}: 401 bad token, 409 refused in this state or table mismatch,
422 bad request / unreadable source, 500 write failed (weights restored), 503 unhealthy.
Nothing a serving client sends runs on the event loop for long (limits.py), so /health and the
admin routes answer while the serving side is saturated.
Prints one line `hotswap worker ready: ...` on stdout once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from daemon.formats.checkpoint import MANIFEST_NAME, LayoutError
from daemon.formats.safetensors import HeaderError
from daemon.jsonbody import JsonBodyError, parse_object
from daemon.transport.base import TableMismatch, TransportError, check_table
from daemon.transport.check import load_expect_file
from daemon.transport.disk import DiskTransport
from daemon.worker.completions import Serving, install_serving_routes
from daemon.worker.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, BodyLimit, ServingLimits
from daemon.worker.metrics import install_metrics
from daemon.worker.openai_errors import install_error_handlers
from daemon.worker.weight_group import weight_group_route

log = logging.getLogger("hotswap.worker")


def read_token(path: str | Path) -> bytes:
    p = Path(path)
    try:
        raw = p.read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"--token-file {p}: cannot read ({exc.strerror})") from None
    if not raw:
        raise ValueError(f"--token-file {p}: file is empty")
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token file %s is readable by group/others (mode %o); chmod 600 it", p, mode & 0o777)
    return raw


def create_app(ctl: Any, token: bytes | None, serving: Serving) -> Any:
    """The ASGI app: serving routes (a `completions.Serving`), health and admin, behind the body cap."""
    from daemon.worker.updates import UpdateError

    app = FastAPI(title="hotswap worker", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    install_serving_routes(app, serving)
    install_metrics(app, serving.metrics)

    def error(status: int, message: str, **extra: Any) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)

    def authorized(request: Request) -> JSONResponse | None:
        if token is None:
            return error(403, "admin API disabled: start the worker with --token-file")
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token):
            return error(401, "missing or wrong bearer token")
        return None

    async def body_of(request: Request) -> dict[str, Any]:
        try:  # malformed, too deep (RecursionError inside json) or not an object: 400, never 500
            return parse_object(await request.body())
        except JsonBodyError as exc:
            raise _BadBody(str(exc)) from None

    def admin(fn: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            denied = authorized(request)
            if denied is not None:
                return denied
            try:
                result = await fn(request)
            except _BadBody as exc:
                return error(400, str(exc))
            except UpdateError as exc:
                return error(exc.status, str(exc), state=ctl.state.value, **exc.detail)
            return JSONResponse(result)

        return route

    @app.get("/health")
    async def health() -> Response:
        if ctl.store.unhealthy:
            return error(503, f"unhealthy: {ctl.store.unhealthy}", state=ctl.state.value)
        return JSONResponse({"status": "ok", "state": ctl.state.value})

    @app.get("/ready")
    async def ready() -> Response:
        if ctl.ready():
            return JSONResponse({"ready": True, "version": ctl.store.current.version})
        return error(503, f"not ready: state {ctl.state.value}", ready=False, state=ctl.state.value)

    async def weight_info(request: Request) -> dict[str, Any]:
        info: dict[str, Any] = ctl.weight_info()
        return info

    async def drain(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        timeout = _number(body, "timeout_s", 30.0)
        return await run_in_threadpool(ctl.drain, timeout)

    async def pause(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return await run_in_threadpool(ctl.pause, body.get("mode", "keep"), _number(body, "timeout_s", 30.0))

    async def resume(request: Request) -> dict[str, Any]:
        return await run_in_threadpool(ctl.resume)

    async def update(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return await run_in_threadpool(ctl.update, body)

    async def rollback(request: Request) -> dict[str, Any]:
        return await run_in_threadpool(ctl.rollback)

    async def probe(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        n = body.get("max_tokens", 4)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
            raise _BadBody("'max_tokens' must be an integer in [1, 64]")
        return await run_in_threadpool(ctl.probe, n)

    app.add_api_route("/weight_info", admin(weight_info), methods=["GET"])
    for name, fn in (("drain", drain), ("pause", pause), ("resume", resume), ("update", update),
                     ("rollback", rollback), ("probe", probe)):
        app.add_api_route(f"/admin/{name}", admin(fn), methods=["POST"])
    app.add_api_route("/admin/init_weight_group", admin(weight_group_route(ctl)), methods=["POST"])  # broadcast
    return BodyLimit(app, serving.limits.max_body_bytes)


class _BadBody(Exception):
    pass


def _number(body: dict[str, Any], key: str, default: float) -> float:
    v = body.get(key, default)
    if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
        raise _BadBody(f"'{key}' must be a non-negative number")
    return float(v)


def initial_version(model_dir: Path, given: str | None) -> tuple[str, str | None]:
    """(version, digest): --version, else the manifest's version, else the directory name."""
    digest = version = None
    if (model_dir / MANIFEST_NAME).exists():
        from daemon.manifest import load_manifest

        m = load_manifest(model_dir)
        version, digest = m.version, m.digest
    return given or version or model_dir.resolve().name, digest


def build_worker(args: argparse.Namespace, *, before_write: Sequence[Any] = ()) -> tuple[Any, Serving]:
    """Model, weights, store, engine, controller and serving state; raises with a clear message
    on bad input.

    `before_write`: hooks run inside each update just before it writes (a test seam; see
    tests/hooked_worker.py). Production passes none."""
    from daemon.worker.control import Controller
    from daemon.worker.engine import Engine
    from daemon.worker.model import build_model, pick_device, served_name_default
    from daemon.worker.store import VersionRecord, WeightStore

    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise ValueError(f"--model {model_dir}: not a directory")
    device = pick_device(args.device)
    version, digest = initial_version(model_dir, args.version)
    t0 = time.perf_counter()
    loaded = build_model(model_dir, device)
    expect = load_expect_file(args.expect_file)  # checked while loading; kept for restores
    transport = DiskTransport(model_dir, expect=expect)
    check_table(transport.table(), loaded.params)
    transport.write_into(loaded.params)
    load_s = time.perf_counter() - t0
    record = VersionRecord(version=version, digest=expect.digest or digest, transport="disk", path=str(model_dir),
                           request={"transport": "disk", "path": str(model_dir), "version": version,
                                    **({"expect": expect.to_json()} if expect.files else {})})
    store = WeightStore(loaded.params, device, record)
    engine = Engine(loaded, store, max_batch=args.max_batch, step_delay_s=args.step_delay_ms / 1000)
    ctl = Controller(loaded, store, engine, model_dir=str(model_dir), before_write=before_write)
    log.info("loaded %s (%d tensors, %d bytes) on %s in %.2f s", version, store.tensors, store.bytes, device, load_s)
    name = args.served_model_name or served_name_default(model_dir, loaded.config)
    if args.max_body_bytes < 1024 or args.max_queue < 0:
        raise ValueError("--max-body-bytes must be >= 1024 and --max-queue >= 0")
    limits = ServingLimits(max_body_bytes=args.max_body_bytes, max_queue=args.max_queue)
    return ctl, Serving.build(ctl, name, limits)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hotswap worker", description="Reference serving worker with in-place weight updates.")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--port", type=int, default=8100, help="TCP port (0: pick a free one, printed when ready)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--uds", default=None, help="listen on this Unix socket instead of TCP")
    p.add_argument("--token-file", default=None, help="file holding the admin bearer token")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    p.add_argument("--version", default=None, help="version label of the initial weights")
    p.add_argument("--expect-file", default=None,
                   help="JSON {digest, tensors, files}: verified per-file digests the initial weights must match")
    p.add_argument("--max-batch", type=int, default=8, help="sequences stepped concurrently")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' and /v1/models lists; stays the same across "
                        "weight updates (default: config.json's _name_or_path, else its model_type)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 before they are read (default 1 MiB)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests waiting beyond --max-batch; more get 429 at once (default %(default)s)")
    p.add_argument("--step-delay-ms", type=float, default=0.0,
                   help="sleep between scheduler steps (demos and tests: makes requests last long enough to watch)")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, *, before_write: Sequence[Any] = ()) -> int:
    args = parse_args(argv)
    try:
        from daemon.logging import configure_logging

        configure_logging(args.log_level)
    except Exception:  # logging is a convenience; never the reason a worker fails to start
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    try:
        token = read_token(args.token_file) if args.token_file else None
        ctl, serving = build_worker(args, before_write=before_write)
    except (ValueError, LayoutError, HeaderError, TableMismatch, TransportError, OSError) as exc:
        print(f"hotswap worker: {exc}", file=sys.stderr)
        return 2
    if token is None:
        log.warning("no --token-file: the admin API is disabled")
    app = create_app(ctl, token, serving)
    ctl.engine.start()
    try:
        asyncio.run(_serve(app, args, ctl))
    finally:
        ctl.engine.stop()
    return 0


async def _serve(app: Any, args: argparse.Namespace, ctl: Any) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if not self.started:
                return
            if args.uds:
                where = f"unix:{args.uds}"
            else:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                where = f"http://{host}:{port}"
            print(f"hotswap worker ready: url={where} version={ctl.store.current.version} "
                  f"device={ctl.loaded.device} tensors={ctl.store.tensors} bytes={ctl.store.bytes} "
                  f"pid={os.getpid()}", flush=True)

    config = uvicorn.Config(app, host=args.host, port=args.port, uds=args.uds, log_level="warning",
                            access_log=False, lifespan="off")
    await Server(config).serve()


if __name__ == "__main__":
    raise SystemExit(main())
