"""JSON request bodies that can only fail as 4xx: size-capped, depth-capped, an object.

`json.loads` on a deeply nested document raises RecursionError (not ValueError, so FastAPI and
hand-written handlers answered 500), and a document just under the interpreter's limit parses
but breaks whatever walks it next (validation, encoding the echo). `parse_object` refuses both
with one message, as does `json_object`, the FastAPI dependency the daemon's routes use.

    parse_object(raw, max_depth=64)      -> dict  (empty body -> {}), raises JsonBodyError
    await read_capped(request, max_bytes) -> bytes (413 past the cap, read no further)
    json_object                           FastAPI dependency: the body as a dict, or a 4xx
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException, Request

MAX_DEPTH = 64  # nesting levels of arrays/objects; control and admin bodies use 2 or 3
MAX_CONTROL_BODY_BYTES = 64 * 1024


class JsonBodyError(ValueError):
    """A body that is not a usable JSON object; `status` is the HTTP answer (400 or 413)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_object(raw: bytes, *, max_depth: int = MAX_DEPTH, empty: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body as a JSON object; an empty body is `{}` (or `empty`)."""
    if not raw.strip():
        return {} if empty is None else dict(empty)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonBodyError(f"body is not UTF-8 (byte {exc.start})") from None
    try:
        doc = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise JsonBodyError(f"body is nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, ints too long to convert
        raise JsonBodyError(f"body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(doc, dict):
        raise JsonBodyError("body must be a JSON object")
    if depth(doc, max_depth) > max_depth:
        raise JsonBodyError(f"body is nested deeper than {max_depth} levels")
    return doc


def depth(doc: Any, limit: int) -> int:
    """Nesting depth of arrays/objects (a scalar is 0), without recursion; stops past `limit`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(doc, 1)] if isinstance(doc, dict | list) else []
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, level + 1) for c in children if isinstance(c, dict | list))
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


async def read_capped(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) a declared or streamed length past `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise JsonBodyError(f"body of {declared} bytes exceeds the limit of {max_bytes}", 413)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise JsonBodyError(f"body exceeds the limit of {max_bytes} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


async def json_object(request: Request) -> dict[str, Any]:
    """FastAPI dependency: the body (at most MAX_CONTROL_BODY_BYTES) as a JSON object, else 4xx."""
    try:
        return parse_object(await read_capped(request, MAX_CONTROL_BODY_BYTES))
    except JsonBodyError as exc:
        raise HTTPException(exc.status, str(exc)) from None
