"""The `Hotswap-Signature` header: `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>`.

The Stripe shape: the timestamp is signed with the body, so a receiver refuses a replay older
than its tolerance. `verify` is what a receiver runs (docs/how-to/webhooks.md has it standalone).
"""

from __future__ import annotations

import hashlib
import hmac
import time

SIGNATURE_HEADER = "Hotswap-Signature"
DELIVERY_HEADER = "Hotswap-Delivery"
EVENT_HEADER = "Hotswap-Event"


def sign(secret: bytes, body: bytes, at: int | None = None) -> str:
    t = int(time.time()) if at is None else at
    mac = hmac.new(secret, f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def verify(secret: bytes, body: bytes, header: str, tolerance_s: float = 300.0, now: float | None = None) -> bool:
    """True when `header` signs `body` with `secret` and its timestamp is within `tolerance_s`."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        t = int(fields["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - t) > tolerance_s:
        return False
    want = hmac.new(secret, f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(want, fields.get("v1", ""))
