"""The HTTP reference: every route of the daemon's API, its push listener and the worker, read from
the FastAPI apps the code builds (nothing is started: no port is bound, no model served).

    daemon   daemon.service.build_daemon(config)._app(): the app `hotswap daemon` serves, with one
             external worker configured so the rollout, broadcast and readiness routes are there
    push     daemon.sources.push.PushSource(config).app(token): the push source's own listener
    worker   daemon.worker.server.create_app / daemon.worker.admin.create_admin_app over a tiny
             model (the reference worker's serving port and its admin socket)
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path
from typing import Any

TOKEN_NAME = {"daemon": "control token", "push": "push token", "worker": "admin token"}


def _routes(app: Any, kind: str) -> list[tuple[str, str, str]]:
    """(method, path, who may call it) for every route in the app's OpenAPI schema (FastAPI's
    public view of its routes, included routers too). Who: each route is called once without a
    token, from loopback, with an empty body; a 401 means it needs the token."""
    from fastapi.testclient import TestClient

    inner = app
    while not hasattr(inner, "openapi") and hasattr(inner, "app"):  # BodyLimit and other ASGI wrappers
        inner = inner.app
    client = TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1")
    out = []
    for path, ops in inner.openapi().get("paths", {}).items():
        concrete = re.sub(r"{[^}]+}", "x", path)
        for method in ops:
            status = client.request(method.upper(), concrete, content=b"{}",
                                    headers={"Content-Type": "application/json"}).status_code  # fmt: skip
            out.append((method.upper(), path, TOKEN_NAME[kind] if status == 401 else "none"))
    return sorted(out, key=lambda t: (t[1], t[0]))


def daemon_routes(tmp: Path) -> list[tuple[str, str, str]]:
    from daemon.common.auth import ControlGuard
    from daemon.config import parse_config
    from daemon.service import build_daemon

    (tmp / "w.token").write_text("docs-token\n")
    config = parse_config({"daemon": {"state_dir": str(tmp / "state"), "listen": "127.0.0.1:0"},
                           "sources": [{"path": str(tmp / "ck")}],
                           "workers": [{"name": "w0", "url": "http://127.0.0.1:9", "token_file": str(tmp / "w.token")}]},
                          "docs")  # fmt: skip
    d = build_daemon(config)
    d.guard = ControlGuard("docs-token")
    try:
        return _routes(d._app(), "daemon")
    finally:
        d.registry.close()


def push_routes(tmp: Path) -> list[tuple[str, str, str]]:
    from daemon.sources.push import PushSource, PushSourceConfig

    (tmp / "k").write_text("00" * 32)
    src = PushSource(PushSourceConfig(path=str(tmp / "pushed"), token_file=str(tmp / "w.token"),
                                      hmac_keys={"k": str(tmp / "k")}), lambda item: 0)  # fmt: skip
    return _routes(src.app("docs-token"), "push")


def worker_routes(tmp: Path) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    from daemon.tinymodel import make_tiny_checkpoint
    from daemon.worker.admin import create_admin_app
    from daemon.worker.server import build_worker, create_app, parse_args

    make_tiny_checkpoint(tmp / "model", seed=1)
    args: argparse.Namespace = parse_args(["--model", str(tmp / "model"), "--port", "0", "--device", "cpu"])
    ctl, serving = build_worker(args)
    return _routes(create_app(ctl, b"t", serving, admin=True), "worker"), _routes(create_admin_app(ctl, b"t"), "worker")


def _table(routes: list[tuple[str, str, str]]) -> list[str]:
    lines = ["| method | path | needs |", "|---|---|---|"]
    lines += [f"| {method} | `{path}` | {who} |" for method, path, who in routes]
    return lines + [""]


def markdown() -> str:
    with tempfile.TemporaryDirectory(prefix="hotswap-docs-") as t:
        tmp = Path(t)
        daemon, push = daemon_routes(tmp), push_routes(tmp)
        serving, admin = worker_routes(tmp)
    return "\n".join([
        "## Daemon API (`[daemon] listen`)", "", *_table(daemon),
        "## Push listener (`[[sources]] type = \"push\"`, `listen`)", "", *_table(push),
        "## Reference worker: serving port (`hotswap worker --port`, admin routes included with `admin = \"tcp\"`)", "",
        *_table(serving),
        "## Reference worker: admin socket (`--admin-uds`, the daemon's managed workers)", "", *_table(admin),
    ])  # fmt: skip
