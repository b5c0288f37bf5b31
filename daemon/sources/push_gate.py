"""Who may use the push routes, and how often: the token first, then the rate limits.

Every push route depends on one `PushGate`, which decides in this order:

1. a request with an `Origin` header (a browser page) is 403;
2. the bearer token is compared with the configured one in constant time (`hmac.compare_digest`
   over fixed-length digests: no I/O, no parsing, the same cost for every wrong token);
3. a missing or wrong token is 401, and counts against a failure bucket of its own per client
   address (`auth_failures_per_s`, `auth_failure_burst`); once that is empty the address's wrong
   tokens are 429. The bucket is never consulted for a request carrying the valid token, so a
   flood of wrong tokens from an address (a NAT, a proxy, loopback) never locks out the trainer
   behind the same address;
4. a request with the valid token takes one token from the bucket of its credential and one from
   the bucket of its address (`rate_per_s`, `burst` each); either empty is 429 with Retry-After.

Buckets that have refilled are dropped by `prune` (the janitor's sweep), so addresses that came
once do not accumulate.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time
from dataclasses import dataclass

from fastapi import HTTPException, Request


@dataclass
class Limits:
    max_checkpoint_bytes: int
    max_concurrent_uploads: int
    rate_per_s: float  # requests with the valid token, per credential and per client address
    burst: int
    upload_timeout_s: float
    auth_failures_per_s: float = 1.0  # wrong or missing tokens per client address
    auth_failure_burst: int = 20


class Bucket:
    """A token bucket: `take()` is 0 when a request may go, else the seconds until one may."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.at = float(burst), time.monotonic()

    def _refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def take(self) -> float:
        self._refill(time.monotonic())
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate if self.rate > 0 else 3600.0

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.burst


def client_address(request: Request) -> str:
    return request.client.host if request.client else "?"


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class PushGate:
    """FastAPI dependency for the push routes (see the module docstring); thread-safe."""

    def __init__(self, token: str, limits: Limits) -> None:
        self._token = _digest(token.encode())
        self.credential = "credential:" + hashlib.sha256(b"hotswap-push-credential\n" + token.encode()).hexdigest()[:12]
        self.limits = limits
        self._lock = threading.Lock()
        self.buckets: dict[str, Bucket] = {}  # credential or address -> requests with the valid token
        self.failures: dict[str, Bucket] = {}  # address -> wrong or missing tokens

    def authenticated(self, request: Request) -> bool:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        ok = hmac.compare_digest(_digest(given.strip().encode("utf-8", "surrogateescape")), self._token)
        return ok and scheme.lower() == "bearer"

    def __call__(self, request: Request) -> None:
        if request.headers.get("origin") is not None:
            raise HTTPException(403, "cross-origin requests are refused")
        address = client_address(request)
        lim = self.limits
        if not self.authenticated(request):
            with self._lock:
                wait = self.failures.setdefault(address, Bucket(lim.auth_failures_per_s, lim.auth_failure_burst)).take()
            if wait > 0:
                raise HTTPException(429, "too many failed authentications from this client",
                                    headers={"Retry-After": str(math.ceil(wait))})  # fmt: skip
            raise HTTPException(401, "missing or wrong push token", headers={"WWW-Authenticate": "Bearer"})
        with self._lock:
            waits = [self.buckets.setdefault(key, Bucket(lim.rate_per_s, lim.burst)).take()
                     for key in (self.credential, f"address:{address}")]  # fmt: skip
        wait = max(waits)
        if wait > 0:
            who = "this client" if waits[1] > 0 else "this credential"
            raise HTTPException(429, f"too many requests from {who}", headers={"Retry-After": str(math.ceil(wait))})

    def prune(self) -> None:
        """Forget buckets that are full again (they would start full anyway)."""
        now = time.monotonic()
        with self._lock:
            for table in (self.buckets, self.failures):
                for key in [k for k, b in table.items() if b.full(now)]:
                    del table[key]
