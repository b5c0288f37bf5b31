"""The one copy of the test suite's small helpers: waiting for a condition and finding free
loopback ports. Light on purpose (no pytest import): support modules that run as scripts in a
subprocess (support_rollout, support_engines) use them too. conftest re-exports them."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    fn: Callable[[], T], timeout: float = 30.0, interval: float = 0.05, what: str = "condition"
) -> T:
    """Poll until fn() is truthy and return its value; an exception from fn() counts as not yet
    (the last one is named if the wait times out)."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            value = fn()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - keep polling; report the last error on timeout
            last_exc = exc
        if time.monotonic() > deadline:
            extra = f" (last error: {last_exc!r})" if last_exc else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{extra}")
        time.sleep(interval)


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]
