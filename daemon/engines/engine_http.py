"""HTTP plumbing shared by the low-level engine clients (`vllm_api`, `sglang_api`).

One `httpx.Client` per engine server, a timeout on every call, and errors that name the
engine, the worker, the route and the engine's reply, so an operator reading one log line
knows which server refused what. Nothing here retries: whether a step may be repeated is the
caller's decision (a reload is not idempotent in effect while a pause or a flush is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

REPLY_CHARS = 300  # how much of an engine's reply an error message quotes


@dataclass(frozen=True, slots=True)
class RouteUse:
    """The query parameters and JSON body fields a client sends to one engine route.

    Each client lists its routes in ROUTES_USED; tests check that the client sends nothing else
    and that the engine's released source still has every route and field listed."""

    query: tuple[str, ...] = ()
    body: tuple[str, ...] = ()


class EngineAPIError(RuntimeError):
    """An engine route failed: HTTP error status, malformed reply, or a refusal in the body."""

    def __init__(self, message: str, *, route: str, status: int | None = None, reply: str = "") -> None:
        super().__init__(message)
        self.route = route
        self.status = status
        self.reply = reply


class EngineUnreachable(EngineAPIError):
    """No answer at all: connection refused or reset, or the call's timeout passed."""


class EngineHTTP:
    """`request()` / `json()` against one engine server; `engine` and `name` go into every error."""

    def __init__(
        self,
        engine: str,
        name: str,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.engine = engine
        self.name = name
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.token = token
        # No keep-alive: engines close the connection after an internal error (uvicorn does on
        # any unhandled exception), and a pooled dead connection would fail the next call.
        # Control calls are few; a loopback connect costs well under a millisecond.
        self._http = httpx.Client(
            base_url=self.url,
            timeout=timeout_s,
            transport=transport,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def _headers(self, token: str | None) -> dict[str, str]:
        tok = token if token is not None else self.token
        return {"Authorization": f"Bearer {tok}"} if tok else {}

    def _where(self, method: str, route: str, params: dict[str, Any] | None) -> str:
        query = "&".join(f"{k}={_q(v)}" for k, v in (params or {}).items())
        return f"{method} {route}{'?' + query if query else ''}"

    def error(self, where: str, what: str, *, status: int | None = None, reply: str = "") -> EngineAPIError:
        text = f"{self.engine} worker {self.name} ({self.url}): {where}: {what}"
        if reply:
            text += f": {reply[:REPLY_CHARS]}"
        return EngineAPIError(text, route=where, status=status, reply=reply)

    def request(
        self,
        method: str,
        route: str,
        *,
        params: dict[str, Any] | None = None,
        json: Any = None,
        timeout_s: float | None = None,
        token: str | None = None,
        ok: tuple[int, ...] = (200,),
    ) -> httpx.Response:
        """The response when its status is in `ok`; otherwise EngineAPIError quoting the reply."""
        where = self._where(method, route, params)
        wire_params = {k: _q(v) for k, v in (params or {}).items()}
        try:
            resp = self._http.request(
                method, route, params=wire_params, json=json, headers=self._headers(token),
                timeout=timeout_s if timeout_s is not None else self.timeout_s,
            )
        except (httpx.TransportError, OSError) as exc:  # refused, reset, read/connect timeouts
            kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "no answer"
            raise EngineUnreachable(
                f"{self.engine} worker {self.name} ({self.url}): {where}: {kind} ({type(exc).__name__}: {exc})",
                route=where,
            ) from None
        if resp.status_code not in ok:
            raise self.error(where, f"HTTP {resp.status_code}", status=resp.status_code, reply=resp.text)
        return resp

    def json(self, method: str, route: str, **kw: Any) -> Any:
        """`request()` and its body parsed as JSON (EngineAPIError when it is not JSON)."""
        resp = self.request(method, route, **kw)
        try:
            return resp.json()
        except ValueError:
            where = self._where(method, route, kw.get("params"))
            raise self.error(where, f"HTTP {resp.status_code} with a non-JSON body", reply=resp.text) from None

    def json_object(self, method: str, route: str, **kw: Any) -> dict[str, Any]:
        doc = self.json(method, route, **kw)
        if not isinstance(doc, dict):
            where = self._where(method, route, kw.get("params"))
            raise self.error(where, "reply is not a JSON object", reply=str(doc))
        return doc

    def close(self) -> None:
        self._http.close()


def _q(value: Any) -> str:
    """Query values as engines parse them (FastAPI reads booleans as true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
