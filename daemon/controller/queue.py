"""The rollout runner's bookkeeping: what it does next (`RolloutQueue`) and what it decided (`RolloutState`).

Operator commands go first, then the newest waiting checkpoint. Checkpoints that arrive while a
rollout runs wait in a single slot: a newer arrival replaces the waiting one, which the caller
records as `superseded`. A checkpoint whose desired step is "wait" (daemon.controller.desired)
is put back in the slot, held there until a given time, and handed out again after it (as a
`Deploy`). Commands (daemon.controller.commands: rollback, pin, unpin, converge, reconcile, the
adapters') queue in order and carry a Future the API waits on; a refused one fails it with
`CommandError`; a reconcile already queued is not queued twice.

`RolloutState` (pinned, serving, the job in progress, a version held back for unavailable
workers) is written by the runner thread and read by the API and the health poll: every access
takes its lock, and the one compound step (take the held-back version) is one call.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from daemon.controller.commands import Command, Deploy
from daemon.registry import CheckpointRef
from daemon.rollout import newer


class RolloutQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: CheckpointRef | None = None
        self._held_until = 0.0  # monotonic: the waiting checkpoint is not handed out before it
        self._commands: deque[Command] = deque()

    def offer(self, ckpt: CheckpointRef) -> CheckpointRef | None:
        """Make `ckpt` the waiting checkpoint; returns the one it replaced (now superseded), if any."""
        with self._cond:
            old = self._pending
            if old is not None and old.id != ckpt.id and newer(old, ckpt):
                return ckpt  # an older version (by step, then arrival) is superseded by the waiting one
            self._pending = ckpt
            self._held_until = 0.0  # a new arrival is looked at now
            self._cond.notify_all()
            return old if old is not None and old.id != ckpt.id else None

    def put_back(self, ckpt: CheckpointRef, until: float) -> CheckpointRef | None:
        """`ckpt` waits again, not handed out before `until` (monotonic); returns the one superseded,
        as `offer` does (a newer arrival meanwhile wins the slot and is not held)."""
        with self._cond:
            replaced = self.offer(ckpt)
            if self._pending is not None and self._pending.id == ckpt.id:
                self._held_until = until
            return replaced

    def command(self, cmd: Command) -> Future[dict[str, Any]]:
        """Queue `cmd` after the commands waiting; one marked `once` and already queued is not queued
        again: its caller gets the queued one's Future."""
        with self._cond:
            if cmd.once and (same := next((c for c in self._commands if c == cmd), None)) is not None:
                return same.future
            self._commands.append(cmd)
            self._cond.notify_all()
        return cmd.future

    def take(self, timeout: float, deploy_allowed: bool) -> Command | None:
        """The next job (commands first; the waiting checkpoint only when deploys are allowed)."""
        with self._cond:
            if not self._commands and not self._deployable(deploy_allowed):
                held = self._held_until - time.monotonic() if deploy_allowed and self._pending else timeout
                self._cond.wait(max(0.0, min(timeout, held)))
            if self._commands:
                return self._commands.popleft()
            if self._deployable(deploy_allowed):
                assert self._pending is not None
                ckpt, self._pending = self._pending, None
                return Deploy(ckpt)
            return None

    def _deployable(self, deploy_allowed: bool) -> bool:
        return deploy_allowed and self._pending is not None and time.monotonic() >= self._held_until

    def wait(self, until: float, unless: Callable[[], bool]) -> None:
        """Sleep until `until` (monotonic), or sooner once `unless()` comes to hold (checked as
        commands arrive). Holding already, it wakes nothing: the sleep is whole (no spinning while,
        say, a window's gates finish after a command ended it)."""
        with self._cond:
            if unless():
                self._cond.wait(max(0.0, until - time.monotonic()))
                return
            self._cond.wait_for(lambda: unless() or time.monotonic() >= until, max(0.0, until - time.monotonic()))

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def newer_than(self, ckpt: CheckpointRef) -> bool:
        with self._cond:
            return self._pending is not None and self._pending.id != ckpt.id and newer(self._pending, ckpt)

    def has_command(self, of: tuple[type[Command], ...]) -> bool:
        """A command of one of these classes waits (the health window yields to a rollback, say)."""
        with self._cond:
            return any(isinstance(c, of) for c in self._commands)

    @property
    def pending(self) -> CheckpointRef | None:
        with self._cond:
            return self._pending


class CommandError(ValueError):
    """An operator command that cannot be done; `http_status` is what the API answers with."""

    def __init__(self, message: str, http_status: int = 409) -> None:
        super().__init__(message)
        self.http_status = http_status


@dataclass
class RolloutState:
    """What the runner decided, shared with the API and poll threads; every access takes the lock."""

    _pinned: str | None = None
    _serving: str | None = None
    _current_job: str | None = None
    _blocked: CheckpointRef | None = None  # waiting for unavailable workers to come back
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pinned(self) -> str | None:
        with self._lock:
            return self._pinned

    @property
    def serving(self) -> str | None:
        with self._lock:
            return self._serving

    @property
    def current_job(self) -> str | None:
        with self._lock:
            return self._current_job

    @property
    def blocked(self) -> CheckpointRef | None:
        with self._lock:
            return self._blocked

    def set_pinned(self, version: str | None) -> None:
        with self._lock:
            self._pinned = version

    def set_serving(self, version: str | None) -> None:
        with self._lock:
            self._serving = version

    def set_current_job(self, job: str | None) -> None:
        with self._lock:
            self._current_job = job

    def set_blocked(self, ckpt: CheckpointRef | None) -> None:
        with self._lock:
            self._blocked = ckpt

    def take_blocked(self, older_than: CheckpointRef | None = None) -> CheckpointRef | None:
        """Clear and return the held-back version (only if it is older than `older_than`, when given)."""
        with self._lock:
            b = self._blocked
            if b is None or (older_than is not None and (b.id == older_than.id or newer(b, older_than))):
                return None
            self._blocked = None
            return b
