"""Exponential backoff for relaunching a managed worker that keeps failing.

The n-th consecutive failure waits `min(max_s, base_s * 2 ** (n - 1))` before the next launch
(1 s, 2 s, 4 s, ... 60 s with the defaults); a worker that stayed healthy for `reset_s` starts
again from `base_s`. No jitter: one daemon relaunches its own children, there is no herd to spread.
"""

from __future__ import annotations

from dataclasses import dataclass


def backoff_delay(failures: int, base_s: float, max_s: float) -> float:
    """Seconds to wait after `failures` consecutive failures (0 when there were none)."""
    if failures <= 0:
        return 0.0
    # capped exponent: 2 ** 1000 would overflow a float long before any sane max_s
    return min(max_s, base_s * 2.0 ** min(failures - 1, 64))


@dataclass
class Backoff:
    base_s: float = 1.0
    max_s: float = 60.0
    reset_s: float = 60.0
    failures: int = 0

    def failed(self) -> float:
        """One more consecutive failure; returns how long to wait before the next try."""
        self.failures += 1
        return backoff_delay(self.failures, self.base_s, self.max_s)

    def healthy_for(self, seconds: float) -> None:
        """The worker has been healthy this long: after `reset_s` the next failure waits `base_s`."""
        if seconds >= self.reset_s:
            self.failures = 0

    def configure(self, base_s: float, max_s: float, reset_s: float) -> None:
        """Follow a reloaded config (SIGHUP) without forgetting the failures counted so far."""
        self.base_s, self.max_s, self.reset_s = base_s, max_s, reset_s
