"""`hotswap worker`: serve one causal LM and take new weights in place, without a restart.

    hotswap worker --model DIR --port N [--host 127.0.0.1] [--token-file F]
                   [--device auto|cpu|cuda:N] [--version V] [--uds PATH] [--admin-uds PATH]
                   [--max-batch N] [--served-model-name NAME] [--max-body-bytes N] [--max-queue N]

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
                          answers with `probe`: one greedy forward under the new weights (post-check)
    POST /admin/prepare   the same body, while serving: opened and validated before the pause
    POST /admin/map_ahead {version, loader}: open a version's loader buffer while it is verified
    POST /admin/read_ahead {version, path, alg}: read a disk version while it is verified
    POST /admin/probe     {max_tokens, adapter?}: one greedy generation even while paused (post-update check)
    POST /admin/adapters/load|unload  LoRA adapters by name beside the base, nothing paused (lora_admin.py);
                          a request's `model` naming one runs with it
    POST /admin/identify  {nonce} -> {proof}: HMAC of the nonce under the token (no auth;
                          the daemon checks it before it sends the token: daemon/common/identity.py)

With --admin-uds PATH, /health, /ready and the admin routes are served on that Unix socket by a
server, event loop and thread of their own (admin.py), and the TCP port has no admin routes: the
daemon's managed workers run this way.

Serving errors are OpenAI error objects {"error": {message, type, param, code}}: 400 invalid
request, 404 unknown model or route, 413 body over --max-body-bytes, 429 at capacity
(--max-batch running + --max-queue waiting), 500 generation failed, 503 draining/unhealthy.
Admin errors are {"error": "..."}: 401 bad token, 409 refused (in this state, a table mismatch, or
bytes that did not match their verified digests, the previous weights restored), 422 bad request /
unreadable source, 500 write failed (detail "restored" says whether), 503 unhealthy.
Nothing a serving client sends runs on the event loop for long (limits.py), so /health and the
admin routes answer while the serving side is saturated.
Prints one line `hotswap worker ready: url=... [admin=unix:PATH] ...` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import socket
import stat
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from daemon.common import ListenerLimits, PrivateDirError, guarded_protocol, tcp_listener
from daemon.formats import MANIFEST_NAME, HeaderError, LayoutError
from daemon.transport import DiskTransport, TableMismatch, TransportError, check_table, load_expect_file
from daemon.worker.admin import (
    AdminServer,
    ProbesFirst,
    admin_router,
    bind_private_socket,
    create_admin_app,
    health_router,
)
from daemon.worker.completions import Serving, install_serving_routes
from daemon.worker.flat import checkpoint_order, pack_flat, room_to_pack
from daemon.worker.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, BodyLimit, ServingLimits
from daemon.worker.metrics import install_metrics
from daemon.worker.openai_errors import install_error_handlers

log = logging.getLogger("hotswap.worker")
ADMIN_SWITCH_INTERVAL_S = 0.001


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


def create_app(ctl: Any, token: bytes | None, serving: Serving, *, admin: bool = True) -> Any:
    """The ASGI app on the TCP port: serving routes (a `completions.Serving`), health, and (unless
    `admin` is False: the admin API is on its own Unix socket, admin.py) the admin routes, behind
    the body cap."""
    app = FastAPI(title="hotswap worker", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    install_serving_routes(app, serving)
    install_metrics(app, serving.metrics)
    app.include_router(health_router(ctl))
    if admin:
        app.include_router(admin_router(ctl, token))
    return ProbesFirst(BodyLimit(app, serving.limits.max_body_bytes), ctl)


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
    flat = None
    if not args.no_flat_weights:
        no_room = room_to_pack(loaded.params)
        if no_room is None:
            flat = pack_flat(loaded.params, checkpoint_order(str(model_dir)))
        else:
            log.warning("weights stay in separate allocations (ipc copies one per tensor): %s", no_room)
    expect = load_expect_file(args.expect_file)  # checked while loading; kept for restores
    transport = DiskTransport(model_dir, expect=expect)
    try:
        check_table(transport.table(), loaded.params)
        transport.write_into(loaded.params)
    finally:
        transport.close()
    load_s = time.perf_counter() - t0
    record = VersionRecord(version=version, digest=expect.digest or digest, transport="disk", path=str(model_dir),
                           request={"transport": "disk", "path": str(model_dir), "version": version,
                                    **({"expect": expect.to_json()} if expect.files else {})})
    store = WeightStore(loaded.params, device, record)
    store.flat = flat
    store.stage_disk = args.stage_disk
    engine = Engine(loaded, store, max_batch=args.max_batch, step_delay_s=args.step_delay_ms / 1000)
    ctl = Controller(loaded, store, engine, model_dir=str(model_dir), before_write=before_write,
                     **({} if args.prepared_ttl_s is None else {"prepared_ttl_s": args.prepared_ttl_s}))
    log.info("loaded %s (%d tensors, %d bytes) on %s in %.2f s", version, store.tensors, store.bytes, device, load_s)
    name = args.served_model_name or served_name_default(model_dir, loaded.config)
    ctl.served_name = name
    if args.max_body_bytes < 1024 or args.max_queue < 0:
        raise ValueError("--max-body-bytes must be >= 1024 and --max-queue >= 0")
    limits = ServingLimits(max_body_bytes=args.max_body_bytes, max_queue=args.max_queue)
    return ctl, Serving.build(ctl, name, limits)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hotswap worker", description="Reference serving worker with in-place weight updates.")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--port", type=int, default=8100, help="TCP port (0: pick a free one, printed when ready)")
    p.add_argument("--host", default="127.0.0.1", help="serving address (default 127.0.0.1)")
    p.add_argument("--uds", default=None, help="listen on this Unix socket instead of TCP")
    p.add_argument("--listen-fd", type=int, default=None,
                   help="serve on this inherited, listening TCP socket (bound by whoever launched the worker, "
                        "so the port is never free while it restarts); --port must name its port")
    p.add_argument("--token-file", default=None, help="file holding the admin bearer token (also the key of "
                   "the identity proof, POST /admin/identify)")
    p.add_argument("--admin-uds", default=None,
                   help="serve /health, /ready and the admin API on this Unix socket (0600; its directory must be "
                        "0700 and yours) from a thread and event loop of their own; the TCP port then carries no "
                        "admin routes")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    p.add_argument("--version", default=None, help="version label of the initial weights")
    p.add_argument("--expect-file", default=None,
                   help="JSON {digest, tensors, files}: verified per-file digests the initial weights must match")
    p.add_argument("--max-batch", type=int, default=8, help="sequences stepped concurrently")
    p.add_argument("--stage-disk", choices=["auto", "on", "off"], default="auto",
                   help="a prepared disk update reads and checks the version into a buffer of its own before the "
                        "pause (auto: on CUDA, when the device has room; on: also on the CPU; off: read in the pause)")
    p.add_argument("--prepared-ttl-s", type=float, default=None,
                   help="let go of a prepared update (open IPC handle, read-ahead buffer) that no update used "
                        "within this many seconds (default: control.PREPARED_TTL_S, 120)")
    p.add_argument("--no-flat-weights", action="store_true",
                   help="keep each weight in its own allocation (default: one flat buffer laid out as the staging "
                        "loader lays out a version, so an ipc copy update is a few large copies)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' and /v1/models lists; stays the same across "
                        "weight updates (default: config.json's _name_or_path, else its model_type)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 before they are read (default 1 MiB)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests waiting beyond --max-batch; more get 429 at once (default %(default)s)")
    p.add_argument("--step-delay-ms", type=float, default=0.0,
                   help="sleep between scheduler steps (demos and tests: makes requests last long enough to watch)")
    p.add_argument("--log-level", default="info", help="debug | info | warning | error")
    args = p.parse_args(argv)
    ttl = args.prepared_ttl_s
    if ttl is not None and not (math.isfinite(ttl) and ttl > 0):
        p.error(f"--prepared-ttl-s: must be a positive number of seconds, got {ttl}")
    return args


def main(argv: Sequence[str] | None = None, *, before_write: Sequence[Any] = ()) -> int:
    args = parse_args(argv)
    try:
        from daemon.common import configure_logging

        configure_logging(args.log_level)
    except Exception:  # logging is a convenience; never the reason a worker fails to start
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    try:
        # The port first, before the model loads: a worker that cannot have its port exits at
        # once, and never serves its admin API while another process answers on that port.
        tcp = None if args.uds else inherited_tcp(args.listen_fd, args.port) if args.listen_fd is not None \
            else bind_tcp(args.host, args.port)
        token = read_token(args.token_file) if args.token_file else None
        ctl, serving = build_worker(args, before_write=before_write)
    except (ValueError, LayoutError, HeaderError, TableMismatch, TransportError, OSError) as exc:
        print(f"hotswap worker: {exc}", file=sys.stderr)
        return 2
    if token is None:
        log.warning("no --token-file: the admin API is disabled")
    admin_server: AdminServer | None = None
    if args.admin_uds:
        path = Path(args.admin_uds)
        try:
            admin_server = AdminServer(create_admin_app(ctl, token), bind_private_socket(path), path)
        except (OSError, PrivateDirError) as exc:
            print(f"hotswap worker: --admin-uds: {exc}", file=sys.stderr)
            return 2
    if admin_server is not None:
        # The admin thread asks for the GIL while serving threads hold it: hand it over every
        # 1 ms instead of every 5 (the default), so its answers wait less behind serving work.
        sys.setswitchinterval(ADMIN_SWITCH_INTERVAL_S)
    app = create_app(ctl, token, serving, admin=admin_server is None)
    ctl.engine.start()
    try:
        if admin_server is not None:
            admin_server.start()
        asyncio.run(_serve(app, args, ctl, tcp))
    finally:
        if admin_server is not None:
            admin_server.stop()
        ctl.engine.stop()
    return 0


# serving: 200 concurrent completions and more; each held connection is one file descriptor
SERVING_LIMITS = ListenerLimits(max_connections=1024, header_timeout_s=5.0, max_per_address=256)


def inherited_tcp(fd: int, port: int) -> socket.socket:
    """The launcher's listening socket: it must be a listening TCP socket on `port`."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise OSError(f"--listen-fd {fd}: not an open socket ({exc.strerror})") from None
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        bound = sock.getsockname()[1] if sock.family in (socket.AF_INET, socket.AF_INET6) else None
    except OSError as exc:
        sock.close()
        raise OSError(f"--listen-fd {fd}: cannot inspect it ({exc.strerror})") from None
    if sock.type != socket.SOCK_STREAM or not listening or bound != port:
        sock.close()
        raise OSError(f"--listen-fd {fd}: not a listening TCP socket on port {port}")
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    try:
        sock = tcp_listener(host, port)
    except OSError as exc:
        raise OSError(f"--port {port} on {host}: cannot listen there ({exc.strerror}); another process may hold it") from None
    return sock


async def _serve(app: Any, args: argparse.Namespace, ctl: Any, tcp: socket.socket | None) -> None:

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
            if args.admin_uds:
                where += f" admin=unix:{args.admin_uds}"
            print(f"hotswap worker ready: url={where} version={ctl.store.current.version} "
                  f"device={ctl.loaded.device} tensors={ctl.store.tensors} bytes={ctl.store.bytes} "
                  f"pid={os.getpid()}", flush=True)

    config = uvicorn.Config(app, host=args.host, port=args.port, uds=args.uds, log_level="warning",
                            access_log=False, lifespan="off", backlog=SERVING_LIMITS.backlog, http=guarded_protocol(SERVING_LIMITS, "worker"))
    await Server(config).serve(sockets=[tcp] if tcp is not None else None)


if __name__ == "__main__":
    raise SystemExit(main())
