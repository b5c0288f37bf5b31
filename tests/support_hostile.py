"""Hostile serving load, run as its own process (so its CPU use is not the measuring test's GIL):

    python tests/support_hostile.py URL [N_CONCURRENT]

At once: a 100 MB body with Content-Length, a 100 MB chunked body, a 10 MB text prompt, and N
(default 200) concurrent completions. Prints one JSON line: what each got back. Bounded: every
request has a timeout, and the process exits when all are done.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx

MB = 1 << 20


async def _chunks(total: int) -> AsyncIterator[bytes]:
    piece = b"x" * MB
    for _ in range(total // MB):
        yield piece


async def big_body(c: httpx.AsyncClient, chunked: bool) -> str:
    headers = {"content-type": "application/json"}
    if not chunked:
        headers["content-length"] = str(100 * MB)
    try:
        r = await c.post("/v1/completions", content=_chunks(100 * MB), headers=headers, timeout=60)
        return str(r.status_code)
    except httpx.TransportError as exc:  # the worker answered 413 and closed while we were sending
        return f"closed:{type(exc).__name__}"


async def big_prompt(c: httpx.AsyncClient) -> str:
    body = json.dumps({"prompt": "a" * (10 * MB), "max_tokens": 4}).encode()
    try:
        r = await c.post("/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
        code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
        return f"{r.status_code}:{code}"
    except httpx.TransportError as exc:
        return f"closed:{type(exc).__name__}"


async def one(c: httpx.AsyncClient, i: int) -> str:
    try:
        r = await c.post("/v1/completions", json={"prompt": f"request {i}: héllo wörld", "max_tokens": 16,
                                                  "temperature": 0, "ignore_eos": True}, timeout=120)
        return str(r.status_code)
    except httpx.TransportError as exc:
        return f"error:{type(exc).__name__}"


async def main(url: str, n: int) -> dict[str, Any]:
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits) as c:
        hostile = [big_body(c, False), big_body(c, True), big_prompt(c)]
        results = await asyncio.gather(*hostile, *(one(c, i) for i in range(n)))
    return {"body_100mb": results[0], "chunked_100mb": results[1], "prompt_10mb": results[2],
            "concurrent": dict(Counter(results[3:])), "seconds": round(time.monotonic() - t0, 2)}


if __name__ == "__main__":
    out = asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200))
    print(json.dumps(out), flush=True)
