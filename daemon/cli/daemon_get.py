"""`hotswap status` asks the running daemon: its /status and /health, with the standard library.

Two GETs on loopback do not need httpx, whose import alone (~60 ms of CPU) was a fifth of the
0.3 s that `hotswap status` may take on an idle 2-core machine (issue 36; tests/cli/test_cli_speed.py).
"""

from __future__ import annotations

import json
from typing import Any

API_TIMEOUT_S = 5.0


def ask_daemon(url: str, verify: Any = True) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The running daemon's /status and /health (http.client: two loopback GETs do not need
    httpx's ~60 ms of imports, a fifth of the 0.3 s `hotswap status` may take, issue 36)."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)

    def get(path: str) -> tuple[int, Any]:
        if parts.scheme == "https":
            import ssl

            ctx = verify if isinstance(verify, ssl.SSLContext) else ssl.create_default_context()
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                parts.hostname or "", parts.port, timeout=API_TIMEOUT_S, context=ctx)  # fmt: skip
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=API_TIMEOUT_S)
        try:
            conn.request("GET", path)
            reply = conn.getresponse()
            return reply.status, json.loads(reply.read())
        finally:
            conn.close()

    try:
        live = get("/status")[1]
        code, body = get("/health")
        health = {"ok": code == 200, **body}
    except (OSError, http.client.HTTPException, ValueError, TypeError) as exc:
        return None, {"ok": False, "error": f"the daemon's API at {url} does not answer ({exc})"}
    return (live if isinstance(live, dict) else None), health
