"""How often a version may be deferred because a check ran out of memory before it is rejected.

A check that runs out of host or GPU memory defers the version (daemon.checks.base): what else
held the memory at that moment is the host's state, not the version's fault, and the deferred
retry verifies it again once `headroom` passes. But a version whose own config makes the forward
check ask for more than the device has (a hostile or broken `config.json`) would be deferred for
ever, read and hashed again every `deferred_retry_s`. So the verdict is bounded: the
`OUT_OF_MEMORY_ATTEMPTS`-th out-of-memory in a row rejects it, saying so; `hotswap reverify`
tries again from a fresh count. The count is this daemon's (a restart starts it over).
"""

from __future__ import annotations

import threading

from daemon.checks import VerifyReport
from daemon.registry import CheckpointStatus

OUT_OF_MEMORY_ATTEMPTS = 3


class MemoryDeferrals:
    def __init__(self, attempts: int = OUT_OF_MEMORY_ATTEMPTS) -> None:
        self.attempts = attempts
        self._counts: dict[int, int] = {}
        self._lock = threading.Lock()

    def verdict(self, checkpoint_id: int, report: VerifyReport) -> tuple[CheckpointStatus, str | None]:
        """The status and reason a failed report records (deferred, or rejected)."""
        short = report.deferred and any(r.detail.get("out_of_memory") for r in report.results if not r.ok)
        with self._lock:
            n = self._counts.pop(checkpoint_id, 0) + 1 if short else 0
            if 0 < n < self.attempts:
                self._counts[checkpoint_id] = n
        if not report.deferred:
            return CheckpointStatus.REJECTED, report.reason
        if n >= self.attempts:
            return CheckpointStatus.REJECTED, (f"{report.reason} (out of memory on {n} attempts in a row: rejected; "
                                               "`hotswap reverify` tries again)")  # fmt: skip
        return CheckpointStatus.DEFERRED, report.reason

    def forget(self, checkpoint_id: int) -> None:
        """The version passed its checks: its count starts over."""
        with self._lock:
            self._counts.pop(checkpoint_id, None)
