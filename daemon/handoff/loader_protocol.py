"""The loader's wire protocol: one JSON object per line over a Unix stream socket, no pickle.

Request:  {"op": "stage", "version": "step-1200", "path": "/ckpt/step-1200", "id": 7}
Response: {"ok": true, "id": 7, "result": {...}}  or  {"ok": false, "id": 7, "error": "reason"}

Ops: stage{version, path, digest?, files?, verify_alg?} -> {version, bytes, tensors, devices, digests?};
descriptor{version, device?, purpose?} -> descriptor JSON (see daemon.handoff.descriptor; purpose
"check": a version held back for the daemon's checks, "map": the buffers of one still staging);
verified{version, files, digest?} -> {version, verified} (a version staged with verify_alg: now exported);
acquire{version, worker, pid?} / release{version, worker} -> {version, holders};
drop{version} -> {version, freed}; status{} -> {devices, budget_bytes, used_bytes, versions}.
"""

from __future__ import annotations

import json
import socket
from typing import Any

MAX_REQUEST_BYTES = 1 << 20
MAX_RESPONSE_BYTES = 256 << 20  # a descriptor of a model with very many tensors
OPS = ("stage", "descriptor", "verified", "acquire", "release", "drop", "status")


class LoaderError(RuntimeError):
    """The loader answered with an error; its message says why."""


class LoaderUnavailable(LoaderError):
    """No answer from the loader: socket missing, connection refused or reset, or timed out."""


class ProtocolError(LoaderError):
    """A line that is not a JSON object within the size limit."""


def encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8") + b"\n"


def read_line(sock: socket.socket, buf: bytearray, limit: int) -> bytes | None:
    """Next line (without the newline) from `sock`, keeping leftovers in `buf`; None at EOF."""
    while True:
        nl = buf.find(b"\n")
        if nl >= 0:
            line = bytes(buf[:nl])
            del buf[: nl + 1]
            return line
        if len(buf) > limit:
            raise ProtocolError(f"line longer than {limit} bytes")
        chunk = sock.recv(1 << 20)
        if not chunk:
            if buf:
                raise ProtocolError("connection closed in the middle of a line")
            return None
        buf += chunk


def decode(line: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError(f"not a JSON line ({exc})") from None
    if not isinstance(doc, dict):
        raise ProtocolError("a message must be a JSON object")
    return doc
