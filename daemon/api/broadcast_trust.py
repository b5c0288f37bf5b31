"""What a broadcast session must prove before the daemon trusts it (daemon.api.broadcast runs it).

- `signed_digest`: with `[checks]` signing keys configured, a session's body carries `digest` (the
  content digest of its tensors, `daemon.transport.broadcast.stream_digest`, computed by the
  trainer before sending) and `signature` {alg, key_id, value} over
  `daemon.transport.broadcast.session_message` (version, table, digest), made with the same keys
  and verified by the same code as manifests (`daemon.checks.signatures`). An unsigned or wrongly
  signed session is refused before any worker is paused; after the transfer the workers' digest
  must equal the signed one. Without keys: None, and sessions go unsigned, as before.
- `check_received`: while every worker is still paused on the received weights, the compat check
  against the serving version and the forward canary run (`daemon.checks.run_checks`, with the
  daemon's `[checks]` bounds) on the copy the first worker saved; a failure undoes the session.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse

from daemon.checks.base import CheckSettings
from daemon.checks.runner import run_checks
from daemon.checks.signatures import SignatureError, verify_signature
from daemon.transport.broadcast import parse_table, session_message


class Refusal(Exception):
    """An answer other than 202. `retry_after_s`: the refusal is transient (the daemon is starting,
    a worker is busy, another session runs); the trainer may ask again after that many seconds."""

    def __init__(self, status_code: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        headers = {} if self.retry_after_s is None else {"Retry-After": str(max(1, round(self.retry_after_s)))}
        return JSONResponse({"error": str(self)}, status_code=self.status_code, headers=headers)


def signed_digest(body: dict[str, Any], version: str, table: list[dict[str, Any]],
                  settings: CheckSettings | None) -> str | None:  # fmt: skip
    """The digest the session's signature vouches for; None when no signing keys are configured.
    Raises Refusal 403 (unsigned, unknown key, bad signature) or 422 (malformed)."""
    if settings is None or not settings.keys_configured:
        return None
    sig, digest = body.get("signature"), body.get("digest")
    if sig is None:
        raise Refusal(403, "signing keys are configured: a broadcast session must be signed "
                           "(BroadcastPush(key_file=..., key_id=...)); this one is unsigned")  # fmt: skip
    if not isinstance(sig, dict) or not all(isinstance(sig.get(k), str) for k in ("alg", "key_id", "value")):
        raise Refusal(422, "'signature' must be an object with string alg, key_id and value")
    if not isinstance(digest, str) or not digest.startswith("broadcast-"):
        raise Refusal(422, "a signed session needs 'digest': the content digest of its tensors (broadcast-<alg>:<hex>)")
    message = session_message(version, parse_table(table), digest)
    try:
        verify_signature(message, sig["alg"], sig["key_id"], sig["value"], settings.hmac_keys,
                         settings.ed25519_keys, what="broadcast session")  # fmt: skip
    except SignatureError as exc:
        raise Refusal(403, f"broadcast session refused: {exc}") from None
    return digest


RECEIVED_CHECKS = ("compat", "forward")  # the table, finiteness and digest the workers checked already


def check_received(directory: Path, reference: Path | None, settings: CheckSettings | None) -> tuple[str | None, list[dict[str, Any]]]:
    """(the first failure "<check>: <reason>" or None, every check's result) for the saved copy."""
    base = settings or CheckSettings()
    enabled = tuple(n for n in RECEIVED_CHECKS if n in base.enabled)
    if not enabled:
        return None, []
    # the saved copy has no manifest (the signature, if any, was checked on the session)
    only = dataclasses.replace(base, enabled=enabled, hmac_keys={}, ed25519_keys={}, require_manifest=False,
                               stage_device="off")  # fmt: skip
    report = run_checks(directory, only, reference=reference)
    results = [{"name": r.name, "status": r.status, "ms": round(r.duration_ms, 1),
                **({"reason": r.detail.get("reason")} if not r.ok else {})} for r in report.results]  # fmt: skip
    return (None if report.ok else report.reason or "a check failed"), results
