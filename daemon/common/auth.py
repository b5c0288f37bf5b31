"""The daemon's control tokens: who may change what the daemon serves.

Every state-changing route of the daemon's API (rollback, pin, unpin, broadcast rendezvous, ...)
depends on `ControlGuard.require(role)`: the request must carry `Authorization: Bearer <token>`,
where the token is the content of `<state_dir>/control.token` (created 0600 with 32 random bytes
at the daemon's first start, read by the CLI; role `admin`) or of a `[[api.tokens]]` file (its
name and role: daemon.common.tokens). An unknown token is 401, a role below the route's 403. Requests with an `Origin` header (a browser page, even a
CORS "simple request") or a `Host` that is not loopback are refused before the token is looked
at: the API is for local operators and the CLI, never for web pages.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request

from daemon.common.private import open_private, private_dir
from daemon.common.tokens import CONTROL_TOKEN_NAME, Caller, TokenSpec, TokenTable

CONTROL_TOKEN_FILE = "control.token"
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


class TokenFileError(RuntimeError):
    """A token file that is missing, unreadable, empty or readable by others (one-line message)."""


def control_token_path(state_dir: Path) -> Path:
    return Path(state_dir) / CONTROL_TOKEN_FILE


def ensure_control_token(state_dir: Path) -> str:
    """Read the control token, creating it (0600, O_EXCL: two starting daemons agree) if absent.

    An existing file must be a regular file owned by this user and closed to group and others:
    a token another local user planted, or can read, would hand them the control API."""
    path = control_token_path(state_dir)
    if not path.parent.is_dir():
        private_dir(path.parent)
    try:
        fd = open_private(path, os.O_WRONLY | os.O_EXCL)
    except FileExistsError:
        _check_private(path)
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


def read_private_token_file(path: Path) -> str:
    """A token file that must be private (this user's regular file, mode 0600 or tighter), read."""
    _check_private(path)
    return read_token_file(path)


def _check_private(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise TokenFileError(f"token file {path} does not exist") from None
    except OSError as exc:
        raise TokenFileError(f"token file {path} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise TokenFileError(f"token file {path} is not a regular file: remove it, the daemon makes a new one")
    if st.st_uid != os.getuid():
        raise TokenFileError(f"token file {path} is owned by uid {st.st_uid}, not this user ({os.getuid()}): "
                             "remove it, the daemon makes a new one")  # fmt: skip
    if st.st_mode & 0o077:
        raise TokenFileError(f"token file {path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}): "
                             "chmod 600 it, or remove it and the daemon makes a new one")  # fmt: skip


def build_guard(state_dir: Path, specs: list[TokenSpec], hosts: Iterable[str] = ()) -> ControlGuard:
    """The daemon's guard: its control token (admin, made if absent) and each `[[api.tokens]]`
    entry, every file read privately; a TokenFileError names the entry or the state dir."""
    try:
        entries = [(CONTROL_TOKEN_NAME, "admin", ensure_control_token(state_dir))]
    except TokenFileError as exc:
        raise TokenFileError(f"daemon.state_dir: {exc}") from None
    for i, spec in enumerate(specs):
        try:
            entries.append((spec.name, spec.role, read_private_token_file(Path(spec.token_file).expanduser())))
        except TokenFileError as exc:
            raise TokenFileError(f"api.tokens[{i}].token_file ({spec.name}): {exc}") from None
    try:
        return ControlGuard(TokenTable(entries), hosts=hosts)
    except ValueError as exc:
        raise TokenFileError(str(exc)) from None


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
    """FastAPI dependency: 403 for browsers and non-loopback Host, 401 without a known token, 403
    for a token whose role is below the route's (`require(role)`); called as is it needs `admin`."""

    def __init__(self, token: str | TokenTable, *, allow_remote_host: bool = False, hosts: Iterable[str] = ()) -> None:
        self._tokens = token if isinstance(token, TokenTable) else TokenTable([(CONTROL_TOKEN_NAME, "admin", token)])
        self._allow_remote_host = allow_remote_host
        self._hosts = {h.strip().lower() for h in hosts if h.strip()}  # [api] allowed_hosts
        self._required: dict[str, Any] = {}

    def _host_allowed(self, host_header: str | None) -> bool:
        if self._allow_remote_host or host_is_loopback(host_header):
            return True
        return host_header is not None and _host_name(host_header) in self._hosts

    def caller(self, request: Request) -> Caller:
        """Who sent it (any role); the refusals every control request gets first."""
        if request.headers.get("origin") is not None:
            raise HTTPException(403, "cross-origin requests are refused")
        if not self._host_allowed(request.headers.get("host")):
            raise HTTPException(403, "the control API answers only loopback Host names (and [api] allowed_hosts)")
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        caller = self._tokens.caller(given.strip()) if scheme.lower() == "bearer" else None
        if caller is None:
            raise HTTPException(401, "missing or unknown token (the control token in <state_dir>/control.token, "
                                "or an [[api.tokens]] file)", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        return caller

    def require(self, role: str) -> RequireRole:
        """A dependency that returns the Caller when its role is at least `role`, else 403."""
        if role not in self._required:
            self._required[role] = RequireRole(self, role)
        return self._required[role]  # type: ignore[no-any-return]

    def __call__(self, request: Request) -> Caller:
        return self.require("admin")(request)


class RequireRole:
    """`guard.require(role)`: the guard's checks, then the role (a route's dependency)."""

    def __init__(self, guard: ControlGuard, role: str) -> None:
        self.guard, self.role = guard, role

    def __call__(self, request: Request) -> Caller:
        caller = self.guard.caller(request)
        if not caller.may(self.role):
            raise HTTPException(403, f"token {caller.name!r} has role {caller.role}: {request.url.path} needs {self.role}")
        return caller


def _host_name(host_header: str) -> str:
    host = host_header.strip().lower()
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def control_dependency(guard: ControlGuard, role: str = "admin") -> Any:
    """`Depends(guard.require(role))`, for a route's or router's `dependencies=[...]`."""
    return Depends(guard.require(role))


def control_router(guard: ControlGuard, **kwargs: Any) -> APIRouter:
    """An APIRouter whose every route needs the control token: where state-changing routes go.

    `guard` is the daemon's (`app.state.control_guard`, `ApiState.guard`). Read the body with
    `daemon.jsonbody.json_object` (a dependency, solved after the guard), never `Body(...)`:
    FastAPI parses a `Body` before any dependency runs, so an unauthenticated client's body
    would be read and parsed before it is refused."""
    deps = [*kwargs.pop("dependencies", ()), control_dependency(guard)]
    return APIRouter(dependencies=deps, **kwargs)
