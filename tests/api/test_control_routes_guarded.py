"""Every state-changing route the daemon mounts depends on its ControlGuard (a net for new routes).

Builds the daemon's app in-process exactly as `Daemon.start()` does (no server, nothing started)
with workers configured, so the rollout routes and anything else `_app()` mounts are there. A
POST/PUT/PATCH/DELETE route without the guard fails this test: mount it with
`daemon.auth.control_router(guard)` or `dependencies=[control_dependency(guard)]`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute

from daemon.common.auth import ControlGuard, RequireRole
from daemon.config import parse_config
from daemon.service import build_daemon

pytestmark = pytest.mark.quick

READ_ONLY = {"GET", "HEAD", "OPTIONS"}


def routes_of(app: Any) -> list[tuple[str, set[str], Any, Any]]:
    """(path, methods, dependant, body_field) of every route, on FastAPI before and after
    0.16x (which keeps included routers as lazy `_IncludedRouter` entries, not copied routes)."""
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute):
            out.append((route.path, set(route.methods), route.dependant, route.body_field))
        elif hasattr(route, "effective_route_contexts"):
            for ctx in route.effective_route_contexts():
                original = ctx.original_route
                if isinstance(original, APIRoute):
                    out.append((ctx.path, set(original.methods), ctx.dependant, ctx.body_field))
        elif getattr(route, "path", None) is not None and set(getattr(route, "methods", None) or ()) - READ_ONLY:
            out.append((route.path, set(route.methods), None, None))  # a plain Starlette route: no guard possible
    return out


def guards_of(dependant: Any) -> list[Any]:
    found = []
    for dep in getattr(dependant, "dependencies", ()):
        if isinstance(dep.call, ControlGuard):
            found.append(dep.call)
        if isinstance(dep.call, RequireRole):  # guard.require(role)
            found.append(dep.call.guard)
        found += guards_of(dep)
    return found


def roles_of(dependant: Any) -> set[str]:
    out = set()
    for dep in getattr(dependant, "dependencies", ()):
        out |= {dep.call.role} if isinstance(dep.call, RequireRole) else {"admin"} if isinstance(dep.call, ControlGuard) else set()
        out |= roles_of(dep)
    return out


def test_every_state_changing_route_needs_the_control_token(tmp_path: Path) -> None:
    token = tmp_path / "w.token"
    token.write_text("t\n")
    config = parse_config({
        "daemon": {"state_dir": str(tmp_path / "state"), "listen": "127.0.0.1:0"},
        "sources": [{"path": str(tmp_path / "ckpts")}],
        "workers": [{"name": "w0", "url": "http://127.0.0.1:9", "token_file": str(token)}],
    }, "test.toml")  # fmt: skip
    d = build_daemon(config)
    try:
        d.guard = ControlGuard("x" * 43)
        app = d._app()
        changing = [r for r in routes_of(app) if r[1] - READ_ONLY]
        assert {r[0] for r in changing} >= {"/v1/rollout/rollback", "/v1/rollout/pin", "/v1/rollout/unpin"}
        for path, methods, dependant, body_field in changing:
            assert d.guard in guards_of(dependant), f"{sorted(methods)} {path} has no ControlGuard"
            assert body_field is None, f"{path} parses a Body before the guard runs: use jsonbody.json_object"
        assert app.state.control_guard is d.guard
        roles = {path: roles_of(dep) for path, m, dep, _ in changing}  # each route's role (daemon.common.tokens)
        assert {p: r for p, r in roles.items() if p.startswith("/v1/rollout/") or "reverify" in p} == {
            "/v1/rollout/rollback": {"operator"}, "/v1/rollout/pin": {"operator"}, "/v1/rollout/unpin": {"operator"},
            "/v1/checkpoints/reverify": {"operator"}}  # fmt: skip
        assert all(r == {"admin"} for p, r in roles.items() if p.startswith("/v1/broadcast")), roles
    finally:
        d.registry.close()


def test_control_router_guards_its_routes_and_never_parses_an_unauthenticated_body() -> None:
    from fastapi import Depends, FastAPI
    from fastapi.testclient import TestClient

    from daemon.common.auth import control_router
    from daemon.common.jsonbody import json_object

    guard = ControlGuard("t" * 43)
    router = control_router(guard, prefix="/v1/push")
    seen: list[dict[str, Any]] = []

    @router.post("/land")
    def land(body: dict[str, Any] = Depends(json_object)) -> dict[str, Any]:  # noqa: B008
        seen.append(body)
        return {"ok": True}

    app = FastAPI()
    app.include_router(router)
    assert all(guard in guards_of(dep) for _, m, dep, _ in routes_of(app) if m - READ_ONLY)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        assert c.post("/v1/push/land", content=b"[" * 30_000).status_code == 401
        assert c.post("/v1/push/land", json={}, headers={"Origin": "http://evil.example"}).status_code == 403
        ok = c.post("/v1/push/land", json={"a": 1}, headers={"Authorization": "Bearer " + "t" * 43})
        assert ok.status_code == 200 and seen == [{"a": 1}]
        deep = c.post("/v1/push/land", content=b"[" * 30_000, headers={"Authorization": "Bearer " + "t" * 43})
        assert deep.status_code == 400 and seen == [{"a": 1}]
