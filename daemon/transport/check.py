"""The transports' side of the check while loading: what a request must carry, and what is
refused before any byte is read.

The check itself (per-file ordered hashing against the registry's digests) is
`daemon.bytepipe.check.LoadCheck`, shared with the loader; it is re-exported here for the
transports and the worker.
"""

from __future__ import annotations

import json
from pathlib import Path

from daemon.bytepipe import (
    DigestMismatch,
    LoadCheck,
    OrderedHasher,
    Reference,
    ensure_contained,
    is_aborted,
    reference_for,
    wants_check,
)
from daemon.transport.base import BadUpdateRequest, Expect

__all__ = ["DigestMismatch", "LoadCheck", "OrderedHasher", "Reference", "ensure_contained", "files_problem",
           "is_aborted", "load_expect_file", "reference_for", "wants_check"]


def files_problem(local_path: str | None, expect: Expect) -> str | None:
    """Why a version cannot be sent to a worker: its directory or a verified file is gone, or a file
    changed size since verify (a cheap stat; the bytes are checked by whoever reads them)."""
    if not local_path:
        return "no local copy to deploy from"
    root = Path(local_path)
    if not root.is_dir():
        return f"its directory {local_path} is missing"
    for f in expect.files:
        try:
            size = (root / f.path).stat().st_size
        except OSError:
            return f"its file {f.path} is missing"
        if size != f.bytes:
            return f"its file {f.path} has {size} bytes, {f.bytes} were verified"
    return None


MAX_EXPECT_FILE_BYTES = 16 << 20


def load_expect_file(path: str | None) -> Expect:
    """`hotswap worker --expect-file F`: the verified per-file digests of the initial weights
    (JSON `{digest, tensors, files}`), written by the daemon for the workers it launches; the
    initial load is checked against them and the worker refuses to start on a mismatch."""
    if not path:
        return Expect()
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_EXPECT_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"--expect-file {path}: cannot read ({exc.strerror})") from None
    if len(raw) > MAX_EXPECT_FILE_BYTES:
        raise ValueError(f"--expect-file {path}: larger than {MAX_EXPECT_FILE_BYTES} bytes")
    try:
        doc = json.loads(raw)
        return Expect.from_json(doc)
    except (ValueError, RecursionError, BadUpdateRequest) as exc:
        raise ValueError(f"--expect-file {path}: not an expect object ({str(exc)[:200]})") from None
