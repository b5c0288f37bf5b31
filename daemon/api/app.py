"""The daemon's HTTP API (loopback by default): health, status, metrics, rollout control.

GET  /health               200 {"ok": true} while no critical problem holds (daemon.process.health: a
                           group with no worker serving, the database unreachable, a source failing,
                           a managed worker that cannot launch); 503 {"ok": false, "error": "<lines>",
                           "problems": [...]} while one does. Warnings are listed with a 200.
GET  /livez                200 {"ok": true} while the process answers (liveness, for systemd and
                           orchestrators: never restart a daemon because a source or worker is down)
GET  /ready                200 while at least one worker of every group serves, whatever a source
                           says; 503 otherwise (for load balancers: daemon.api.readiness)
GET  /status               JSON: daemon info, sources, checkpoints by status, latest versions, workers,
                           webhooks (deliveries by state, the last error: daemon.webhooks.report)
GET  /metrics              Prometheus text format

With workers configured, the rollout routes (`rollout_router`):

GET  /v1/rollout           runner state: serving, last_good, pinned, pending, current job, workers
POST /v1/rollout/rollback  {"to": VERSION | null, "adapter": NAME | null}  -> the rollback's result
                           (waits for it); with "adapter" (or an adapter VERSION) that LoRA adapter only
POST /v1/rollout/pin       {"version": VERSION, "force": false} -> pins, deploying it if it is not
                           serving; a `rejected` version only with "force": true
POST /v1/rollout/unpin     {"adapter": NAME | null}  -> unpins; a waiting checkpoint deploys next

Every state-changing route needs a token (daemon.common.auth): `Authorization: Bearer <content of
<state_dir>/control.token>` (admin) or of an `[[api.tokens]]` file; rollback, pin and unpin need
role operator, and answer with `"by"`: the token's name, also recorded in their events. A request with an `Origin` header or a non-loopback
`Host` is 403, a missing or wrong token 401. The guard is `ApiState.guard` and
`app.state.control_guard`; another module's routes use `daemon.auth.control_router(guard)` and
read their body with `daemon.jsonbody.json_object` (never `Body(...)`, parsed before the guard).
GET routes are open; `/status` passes through daemon.common.redact (no passwords, tokens or keys).

Errors answer {"error": "..."}: 400 bad JSON (malformed, nested deeper than 64), 401/403 above,
404 unknown version, 409 refused (pinned, not verified, rejected without force, nothing to roll
back to), 413 body over 64 KiB, 422 wrong field types, 503 while the daemon is starting, 504
when the command did not finish within `wait_s` (it still runs).
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

import daemon
from daemon.common import (
    CONTENT_TYPE,
    Caller,
    ControlGuard,
    DaemonMetrics,
    ListenerLimits,
    Problem,
    guarded_protocol,
    json_object,
    redact_doc,
    tcp_listener,
)
from daemon.config import ConfigError
from daemon.controller import CommandError, RolloutService, alias_problems
from daemon.process import database_problems, health_document
from daemon.registry import Registry, redact_url
from daemon.registry import queries as q
from daemon.webhooks import WebhookSettings, webhook_report

DEFAULT_WAIT_S = 900.0
# operators, the CLI, Prometheus and load balancers: a few dozen at most; a flood is refused
CONTROL_LIMITS = ListenerLimits(max_connections=256, header_timeout_s=5.0, max_per_address=64)


@dataclass
class ApiState:
    registry: Registry
    metrics: DaemonMetrics
    sources: list[dict[str, Any]] = field(default_factory=list)
    describe_sources: Callable[[], list[dict[str, Any]]] | None = None  # each source now (what it refused)
    started_at: float = field(default_factory=time.time)
    queue_depth: Callable[[], int] | None = None  # the coordinator's queue depth
    problems: Callable[[], list[Problem]] | None = None  # what is wrong now (daemon.process.health)
    guard: ControlGuard | None = None  # the control token check; every state-changing route needs it
    webhooks: list[WebhookSettings] = field(default_factory=list)  # [[webhooks]]: their deliveries in /status
    window: Callable[[], dict[str, Any] | None] | None = None  # the health window open now (the rollout service)


def create_app(state: ApiState) -> FastAPI:
    app = FastAPI(title="hotswap daemon", version=daemon.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.control_guard = state.guard

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.get("/health")
    def health() -> Response:
        doc, code = health_document(state.problems() if state.problems is not None else database_problems(state.registry))
        return JSONResponse(doc, status_code=code)

    @app.get("/livez")
    def livez() -> Response:
        return JSONResponse({"ok": True})

    @app.get("/status")
    def status() -> dict[str, Any]:
        return status_document(state)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app


def rollout_router(service: RolloutService, guard: ControlGuard) -> APIRouter:
    router = APIRouter(prefix="/v1/rollout")
    operator = Depends(guard.require("operator"))  # pin, unpin, rollback (daemon.common.tokens)
    body_of = Depends(json_object)  # read after the guard: an unauthenticated body is never parsed

    def answer(future: Future[dict[str, Any]], wait_s: float, by: Caller) -> JSONResponse:
        try:
            result = future.result(timeout=wait_s)
        except CommandError as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.http_status)
        except FutureTimeout:
            return JSONResponse({"error": f"still running after {wait_s:g} s; see `hotswap status`"}, status_code=504)
        except Exception as exc:  # noqa: BLE001 - the daemon log has the traceback
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)
        return JSONResponse({**result, "by": by.name})

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
    def rollback(who: Caller = operator, body: dict[str, Any] = body_of) -> JSONResponse:
        to, adapter = body.get("to"), body.get("adapter")
        if to is not None and not isinstance(to, str):
            return JSONResponse({"error": "'to' must be a version string or null"}, status_code=422)
        if adapter is not None and not isinstance(adapter, str):
            return JSONResponse({"error": "'adapter' must be an adapter name or null"}, status_code=422)
        return starting() or answer(service.rollback(to, adapter, by=who.name), wait_s(body), who)

    @router.post("/pin")
    def pin(who: Caller = operator, body: dict[str, Any] = body_of) -> JSONResponse:
        version, force = body.get("version"), body.get("force", False)
        if not isinstance(version, str) or not version:
            return JSONResponse({"error": "'version' (a version string) is required"}, status_code=422)
        if not isinstance(force, bool):
            return JSONResponse({"error": "'force' must be true or false"}, status_code=422)
        return starting() or answer(service.pin(version, force=force, by=who.name), wait_s(body), who)

    @router.post("/unpin")
    def unpin(who: Caller = operator, body: dict[str, Any] = body_of) -> JSONResponse:
        adapter = body.get("adapter")
        if adapter is not None and (not isinstance(adapter, str) or not adapter):
            return JSONResponse({"error": "'adapter' must be an adapter name or null"}, status_code=422)
        return starting() or answer(service.unpin(adapter, by=who.name), wait_s(body), who)

    return router


def wait_s(body: dict[str, Any]) -> float:
    value = body.get("wait_s", DEFAULT_WAIT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 86400:
        raise HTTPException(422, "'wait_s' must be a number of seconds in [0, 86400]")
    return float(value)


def status_document(state: ApiState) -> dict[str, Any]:
    with state.registry.snapshot() as s:  # counts, rows, aliases and workers of one moment
        counts = q.status_counts(s)
        latest = q.history(s, limit=10)
        workers = q.worker_rows(s)
        transports = q.update_transports(s)
        aliases = q.aliases(s)
        adapters = q.adapter_aliases(s)
        arrivals = _arrivals(s, latest, aliases.get("serving"))
    return {
        "daemon": {
            "version": daemon.__version__,
            "uptime_s": round(time.time() - state.started_at, 1),
            "database": redact_url(state.registry.url),
            "queue_depth": state.queue_depth() if state.queue_depth is not None else None,
            "window": state.window() if state.window is not None else None,
            "problems": [p.doc() for p in (state.problems() if state.problems is not None else [])],
        },
        "sources": redact_doc(state.describe_sources() if state.describe_sources is not None else state.sources),
        "checkpoints": counts,
        "aliases": aliases,  # serving, last_good, pinned -> version
        "adapters": adapters,  # LoRA adapter name -> its serving, last_good, pinned
        "alias_problems": alias_problems(state.registry),  # alias -> why its files cannot be deployed here
        "latest": redact_doc([_jsonable_row(r) for r in latest]),
        "workers": redact_doc([{**_jsonable_row(r), "transport": transports.get(r["worker"])} for r in workers]),
        "webhooks": webhook_report(state.registry, state.webhooks) if state.webhooks else [],
        "arrivals": redact_doc(arrivals),  # serving and pending versions: full or delta, bytes, changes
    }


_PENDING = ("discovered", "fetching", "verifying", "verified")  # not deployed (yet), newest first


def _arrivals(s: Any, latest: list[dict[str, Any]], serving: str | None) -> list[dict[str, Any]]:
    """How the serving version and the pending ones arrived (daemon.cli.arrival), where recorded."""
    rows = {r["version"]: r for r in latest}
    if serving and serving not in rows and (ckpt := q.get_checkpoint(s, serving)) is not None:
        rows.update({r["version"]: r for r in q.history(s, checkpoint_id=ckpt.id)})
    wanted = [(serving, "serving")] if serving else []
    wanted += [(r["version"], r["status"]) for r in latest if r["status"] in _PENDING and r["version"] != serving]
    return [{"version": v, "role": role, **{k: rows[v].get(k) for k in q.ARRIVAL_COLUMNS}}
            for v, role in wanted if v in rows and rows[v].get("encoding") is not None]  # fmt: skip


def _jsonable_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in row.items()}


class ApiServer:
    """uvicorn in a background thread on a socket bound up front (so port 0 works)."""

    def __init__(self, app: FastAPI, host: str, port: int, tls_certfile: str = "", tls_keyfile: str = "") -> None:
        self.sock = tcp_listener(host, port)
        # listening before daemon.json names the URL: a client that reads it at once is queued in
        # the kernel's backlog until uvicorn's thread accepts, never refused (CI: ConnectError)
        self.sock.listen(CONTROL_LIMITS.backlog)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.scheme = "https" if tls_certfile else "http"
        tls: dict[str, Any] = {"ssl_certfile": tls_certfile, "ssl_keyfile": tls_keyfile} if tls_certfile else {}
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                backlog=CONTROL_LIMITS.backlog, http=guarded_protocol(CONTROL_LIMITS, "control API"), **tls)
        try:
            config.load()  # here, so a bad certificate or key fails the start (one line), not the thread
        except (OSError, ssl.SSLError) as exc:
            self.sock.close()
            raise ConfigError(f"api.tls_certfile/tls_keyfile: cannot use {tls_certfile}: {exc}") from None
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="api", daemon=True
        )

    @property
    def url(self) -> str:
        """Where a local client reaches it (a wildcard address is reached on loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        host = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=5)
        self.sock.close()
