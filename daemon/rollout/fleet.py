"""The workers the engine drives: one `WorkerHandle` per `[[workers]]` entry.

A handle ties a worker's config to its client, its state-machine position as
the engine last recorded it, and (for `launch = "managed"`) the child process
the daemon runs. `busy` is held while the engine drives the worker, so the
health poll never reports a state the engine is in the middle of changing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from daemon.adapters.base import WorkerClient
from daemon.rollout.settings import WorkerSpec
from daemon.rollout.states import WorkerState

if TYPE_CHECKING:
    from daemon.rollout.managed import ManagedWorker


@dataclass(eq=False)
class WorkerHandle:
    spec: WorkerSpec
    client: WorkerClient
    url: str
    managed: ManagedWorker | None = None
    state: WorkerState | None = None  # last state the engine recorded; None = not yet known
    busy: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return self.spec.name


class Fleet:
    def __init__(self, handles: list[WorkerHandle]) -> None:
        self._handles = {h.name: h for h in handles}
        self.specs = [h.spec for h in handles]

    def __iter__(self) -> Iterator[WorkerHandle]:
        return iter(self._handles.values())

    def __len__(self) -> int:
        return len(self._handles)

    def __getitem__(self, name: str) -> WorkerHandle:
        return self._handles[name]

    def names(self) -> list[str]:
        return list(self._handles)

    def close(self) -> None:
        for h in self:
            h.client.close()
