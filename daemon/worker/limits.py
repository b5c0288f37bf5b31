"""What one client can make the worker do: body size, JSON, capacity, work kept off the event loop.

The event loop also answers `/health`, `/ready` and the admin routes, so nothing a serving
client sends may hold it: bodies are capped (Content-Length checked before a byte is read,
streamed bodies counted as they arrive), a body larger than any request that fits the model's
context is refused before it is parsed, JSON over a few KB is parsed in a worker thread,
tokenization, chat templates and whole-text detokenization run in a small pool of their own
(not Starlette's, which the admin routes use), and requests beyond `max_batch + max_queue`
get 429 at once instead of waiting behind everybody else.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from daemon.worker.openai_errors import ApiError, bad_request

T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB
DEFAULT_MAX_QUEUE = 64
ADMIN_MAX_BODY_BYTES = 64 << 20  # authenticated routes: an IPC descriptor lists every tensor
INLINE_JSON_BYTES = 16 << 10  # parse smaller bodies on the loop (a thread hop costs more)


@dataclass(frozen=True, slots=True)
class ServingLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queue: int = DEFAULT_MAX_QUEUE  # waiting requests beyond the engine's max_batch
    tokenizer_threads: int = 2


def too_large(limit: int, what: str) -> ApiError:
    return ApiError(413, f"request body {what} exceeds the limit of {limit} bytes (--max-body-bytes)",
                    code="request_too_large")


class BodyLimit:
    """ASGI middleware: a body over the limit is refused with 413 before it is read
    (Content-Length) or as soon as the count passes the limit (chunked bodies). Serving routes
    (/v1/...) get `serving_limit`; the others (admin: the token is checked before the body is
    read) `other_limit`, room for the tensor table of an IPC descriptor of a large MoE model."""

    def __init__(self, app: ASGIApp, serving_limit: int, other_limit: int = ADMIN_MAX_BODY_BYTES) -> None:
        self.app = app
        self.serving_limit = serving_limit
        self.other_limit = max(other_limit, serving_limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.serving_limit if str(scope.get("path", "")).startswith("/v1/") else self.other_limit
        declared = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if declared is not None:
            if not declared.isdigit():
                await _send_error(send, bad_request("Content-Length is not a number", code="invalid_header"))
                return
            if int(declared) > limit:
                await _send_error(send, too_large(limit, f"of {int(declared)} bytes"))
                return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise too_large(limit, f"(more than {seen} bytes so far)")
            return message

        await self.app(scope, counted, send)


async def _send_error(send: Send, err: ApiError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


def parse_json(raw: bytes) -> Any:
    """JSON from a client: any malformed, too deep or too big-numbered document is a 400."""
    if not raw.strip():
        raise bad_request("the body is empty: send a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the body is not UTF-8 (byte {exc.start})", code="invalid_json") from None
    try:
        doc = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise bad_request("the JSON body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, and ints longer than Python converts
        raise bad_request(f"the body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class Offload:
    """A small thread pool for CPU work a request causes (tokenizing, templates, detokenizing)."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="hotswap-tokenize")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def read_json(receive_body: Callable[[], Any], offload: Offload, most: int) -> dict[str, Any]:
    """The body as a JSON object. `most`: the largest body a request that fits the model can need;
    a bigger one is refused before it is parsed (json.loads holds the GIL, and with it the
    event loop, for its whole run: 100 ms and more for a body of many MB)."""
    raw = await receive_body()
    if len(raw) > most:
        raise ApiError(400, f"the request body is {len(raw)} bytes; a request that fits this model's context "
                            f"needs at most {most}, refused before parsing", code="context_length_exceeded")
    if len(raw) <= INLINE_JSON_BYTES:
        return parse_json(raw)  # type: ignore[no-any-return]
    return await offload.run(parse_json, raw)


def most_request_bytes(max_chars: int, max_positions: int) -> int:
    """An upper bound on the JSON of any request that fits: the text at 6 bytes a character
    (\\uXXXX escapes), token ids or per-message overhead at 64 bytes a token, 64 KiB for the rest."""
    return 6 * max_chars + 64 * max_positions + (64 << 10)


class Admission:
    """At most `limit` requests past validation at once (tokenizing, queued or generating)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.held = 0
        self.refused = 0

    def enter(self) -> None:
        if self.held >= self.limit:
            self.refused += 1
            raise ApiError(429, f"the worker is at capacity ({self.held} requests queued or running, limit "
                                f"{self.limit}); retry shortly", code="server_busy", headers={"Retry-After": "1"})
        self.held += 1

    def leave(self) -> None:
        self.held = max(0, self.held - 1)


def finite_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
