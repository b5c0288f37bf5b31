"""The CLI side of the daemon's control API: find the running daemon, POST with its control token.

Used by `hotswap rollback/pin/unpin` (daemon.cli.main) and `hotswap reverify` (daemon.cli.reverify).
`NotRunning` means no daemon answers (callers may fall back to working offline); a token that
cannot be read, or a daemon that refuses it, is a `RuntimeError` with one line: never a reason to
act as if no daemon were running.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from daemon.cli.read import read_runtime_file
from daemon.common import (
    TokenFileError,
    client_tls,
    control_token_path,
    read_private_token_file,
    read_token_file,
)
from daemon.config import Config

TOKEN_FILE_ENV = "HOTSWAP_TOKEN_FILE"  # a named token's file ([[api.tokens]]) when no --token-file is given


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


def token_to_send(config: Config, token_file: str | None = None) -> tuple[Path, str]:
    """The token the CLI sends, and its file: `token_file` (`--token-file`), else $HOTSWAP_TOKEN_FILE
    (a named token: read only when private to this user, as the daemon reads it), else the
    daemon's control token (`<state_dir>/control.token`, admin)."""
    named = token_file or os.environ.get(TOKEN_FILE_ENV)
    try:
        if named:
            return Path(named).expanduser(), read_private_token_file(Path(named).expanduser())
        path = control_token_path(config.state_dir)
        return path, read_token_file(path)
    except TokenFileError as exc:
        why = "" if named else " (run as the daemon's user, or give --token-file)"
        raise RuntimeError(f"cannot send a token: {exc}{why}") from None


def post_control(config: Config, path: str, body: dict[str, Any], timeout_s: float,
                 token_file: str | None = None) -> dict[str, Any]:  # fmt: skip
    """POST `body` to the running daemon with the token `token_to_send` picks. Its answer names
    the token (`by`): the daemon's name for it, which its events record."""
    url = daemon_url(config)
    token_file_used, token = token_to_send(config, token_file)
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
                           f"token from {token_file_used})")  # fmt: skip
    if r.status_code != 200:
        raise RuntimeError(str(doc.get("error") or f"HTTP {r.status_code}"))
    return doc
