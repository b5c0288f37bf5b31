"""The daemon's control token: who may change what the daemon serves.

Every state-changing route of the daemon's API (rollback, pin, unpin, broadcast rendezvous, ...)
depends on `ControlGuard`: the request must carry `Authorization: Bearer <token>`, where the
token is the content of `<state_dir>/control.token` (created 0600 with 32 random bytes at the
daemon's first start, read by the CLI). Requests with an `Origin` header (a browser page, even a
CORS "simple request") or a `Host` that is not loopback are refused before the token is looked
at: the API is for local operators and the CLI, never for web pages.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from fastapi import HTTPException, Request

CONTROL_TOKEN_FILE = "control.token"
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


class TokenFileError(RuntimeError):
    """A token file that is missing, unreadable, empty or readable by others (one-line message)."""


def control_token_path(state_dir: Path) -> Path:
    return Path(state_dir) / CONTROL_TOKEN_FILE


def ensure_control_token(state_dir: Path) -> str:
    """Read the control token, creating it (0600, O_EXCL: two starting daemons agree) if absent."""
    path = control_token_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token_file(path)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return read_token_file(path)


def read_token_file(path: Path) -> str:
    """A bearer token from a file, stripped; a clear one-line error when it cannot be used."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise TokenFileError(f"token file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenFileError(f"token file {path} cannot be read: {exc}") from None
    if not token:
        raise TokenFileError(f"token file {path} is empty")
    return token


def host_is_loopback(host_header: str | None) -> bool:
    if not host_header:
        return False
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8780
        host = host.split("]", 1)[0] + "]"
    elif host.count(":") == 1:  # 127.0.0.1:8780
        host = host.split(":", 1)[0]
    return host in _LOOPBACK_HOSTS


class ControlGuard:
    """FastAPI dependency: 403 for browsers and non-loopback Host, 401 without the right token."""

    def __init__(self, token: str, *, allow_remote_host: bool = False) -> None:
        self._token = token.encode()
        self._allow_remote_host = allow_remote_host

    def __call__(self, request: Request) -> None:
        if request.headers.get("origin") is not None:
            raise HTTPException(403, "cross-origin requests are refused")
        if not self._allow_remote_host and not host_is_loopback(request.headers.get("host")):
            raise HTTPException(403, "the control API answers only loopback Host names")
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            raise HTTPException(401, "missing or wrong control token (see <state_dir>/control.token)",
                                headers={"WWW-Authenticate": "Bearer"})
