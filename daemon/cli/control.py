"""The CLI side of the daemon's control API: find the running daemon, POST with its control token.

Used by `hotswap rollback/pin/unpin` (daemon.cli.main) and `hotswap reverify` (daemon.cli.reverify).
`NotRunning` means no daemon answers (callers may fall back to working offline); a token that
cannot be read, or a daemon that refuses it, is a `RuntimeError` with one line: never a reason to
act as if no daemon were running.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from daemon.cli.read import read_runtime_file
from daemon.common.apiconfig import client_tls
from daemon.common.auth import TokenFileError, control_token_path, read_token_file
from daemon.config import Config


class NotRunning(RuntimeError):
    pass


def daemon_url(config: Config) -> str:
    """The running daemon's API address from its runtime file; NotRunning when there is none."""
    runtime = read_runtime_file(config)
    where = str(config.runtime_file)
    if not runtime:
        raise NotRunning(f"the hotswap daemon is not running (no {where}); start it with `hotswap daemon`")
    try:
        os.kill(int(runtime["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        raise NotRunning(
            f"the hotswap daemon is not running (pid {runtime.get('pid')} from {where} is gone); "
            "start it with `hotswap daemon`"
        ) from None
    if not runtime.get("api_url"):
        raise NotRunning("the running daemon has its HTTP API turned off ([daemon] listen = \"\")")
    return str(runtime["api_url"])


def post_control(config: Config, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST `body` to the running daemon with its control token (`<state_dir>/control.token`)."""
    url = daemon_url(config)
    token_file = control_token_path(config.state_dir)
    try:
        token = read_token_file(token_file)
    except TokenFileError as exc:
        raise RuntimeError(f"cannot send the daemon's control token: {exc} (run as the daemon's user)") from None
    try:
        r = httpx.post(f"{url}{path}", json=body, timeout=timeout_s,
                       headers={"Authorization": f"Bearer {token}"}, verify=client_tls(config.api, url))  # fmt: skip
    except httpx.TransportError as exc:
        raise NotRunning(f"the hotswap daemon at {url} does not answer ({exc})") from None
    try:
        doc: dict[str, Any] = r.json()
    except ValueError:
        doc = {"error": r.text[:500]}
    if r.status_code in (401, 403):
        raise RuntimeError(f"the daemon at {url} refused the request ({doc.get('error') or r.status_code}; "
                           f"token from {token_file})")  # fmt: skip
    if r.status_code != 200:
        raise RuntimeError(str(doc.get("error") or f"HTTP {r.status_code}"))
    return doc
