"""A loader buffer opened ahead of its update (issue 41): while the daemon still verifies a version
staged in the loader, the daemon asks each worker to open that version's buffer (`map_ahead`), so
the prepare after verification finds it open instead of paying a CUDA IPC open (~80 ms for 8B)
while the rollout waits. Nothing is read through it before the update, which still takes the
exported descriptor from the loader and ties it to the registry's digests.

At most one version is held. It is let go when an update's own open has taken it (`taken`), when
the daemon says so (`want(None)`, the version failed its checks), when another version is asked
for, or when no update took it within `hold_s` (checked on each weight_info, like preparations).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from daemon.transport import OPENER, map_ahead

log = logging.getLogger("hotswap.worker.map_ahead")

# An opened-ahead buffer no update took within this long is let go. A verified version's prepare
# follows within a second when nothing waits; one that waits longer (a health window, a newer
# version superseding it) should not keep its buffer's memory alive after the loader frees it.
HOLD_S = 15.0


class MappedAhead:
    def __init__(self, device: torch.device, event: Callable[..., None], hold_s: float = HOLD_S) -> None:
        self.device = device
        self.event = event  # the worker's event log (control.WorkerControl.event)
        self.hold_s = hold_s
        self._lock = threading.Lock()
        self._wanted = 0  # bumped by each want(): an open that finishes after a newer want is let go
        self._held: tuple[str, Any, float] | None = None  # (version, OpenedVersion, since)

    def want(self, version: str | None, loader: str | None) -> None:
        """Open `version`'s buffer from the loader at `loader` on a thread of its own (the daemon
        does not wait for it); None: let go of what is held."""
        with self._lock:
            self._wanted += 1
            ticket, held, self._held = self._wanted, self._held, None
        self._release(held, "replaced" if version is not None else "let_go")
        if version is not None and loader is not None:
            threading.Thread(target=self._open, args=(ticket, version, loader), name=f"map-ahead-{version}",
                             daemon=True).start()  # fmt: skip

    def _open(self, ticket: int, version: str, loader: str) -> None:
        t0 = time.perf_counter()
        try:
            opened = map_ahead(loader, version, self.device)
        except Exception as exc:  # noqa: BLE001  (only a head start lost: the update opens as before)
            self.event("map_ahead_failed", version=version, error=f"{type(exc).__name__}: {exc}")
            return
        with self._lock:
            current = ticket == self._wanted
            if current:
                self._held = (version, opened, time.monotonic())
        if not current:
            self._release((version, opened, 0.0), "replaced")
            return
        self.event("mapped_ahead", version=version, open_ms=round((time.perf_counter() - t0) * 1e3, 3))

    def taken(self, version: str) -> None:
        """An update of `version` opened its own reference: the one held ahead is not needed."""
        with self._lock:
            held = self._held
            if held is None or held[0] != version:
                return
            self._held = None
        self._release(held, "taken")

    def expire(self) -> None:
        with self._lock:
            held = self._held
            if held is None or time.monotonic() - held[2] < self.hold_s:
                return
            self._held = None
        self._release(held, "expired")

    def version(self) -> str | None:
        with self._lock:
            return None if self._held is None else self._held[0]

    def _release(self, held: tuple[str, Any, float] | None, why: str) -> None:
        if held is None:
            return
        OPENER.release(held[1])
        self.event("map_ahead_released", version=held[0], why=why)
