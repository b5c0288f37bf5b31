"""What a broadcast session must prove before the daemon starts it (daemon.api.broadcast asks).

With `[checks]` signing keys configured, a session's body carries `digest` (the content digest of
its tensors, `daemon.transport.broadcast.stream_digest`, computed by the trainer before sending)
and `signature` {alg, key_id, value} over `daemon.transport.broadcast.session_message` (version,
table, digest), made with the same keys and verified by the same code as manifests
(`daemon.checks.signatures`). An unsigned or wrongly signed session is refused before any worker
is paused; after the transfer the workers' digest must equal the signed one
(daemon.controller.broadcast). Without keys: None, and sessions go unsigned, as before.
"""

from __future__ import annotations

from typing import Any

from daemon.checks import CheckSettings, SignatureError, verify_signature
from daemon.controller import Refusal
from daemon.transport import parse_table, session_message


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
