"""The interface every checkpoint source implements, and what it hands the coordinator.

A source watches one place (a local folder; later an S3 prefix or the push routes) and calls
`emit(DiscoveredCheckpoint)` once per committed checkpoint. Two more duties, both on the
coordinator's thread:

* `fetch(item, progress)`: the pipeline step between register and verify. It turns a
  checkpoint registered without a local directory into one (download into a cache, resuming
  what is already there) and returns it; it raises `FetchError` with a clear reason when it
  cannot. A checkpoint discovered with a directory (local folder, a finished push) skips it.
* `prune(protected)`: the retention hook. Delete checkpoint directories *this source created*
  (a download cache), never one in `protected` (serving, last good, pinned and everything still
  in flight), and never a directory the user owns (a watched folder is never pruned).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class DiscoveredCheckpoint:
    """A committed checkpoint, as a source hands it to the coordinator."""

    source: str  # the source's label
    directory: Path | None  # its local directory, when it already has one; None: the fetch step makes it
    version: str  # manifest version, else the directory name
    signal: str  # manifest | index | marker | push
    uri: str  # where it was found (file://, s3://, the push URL)
    detected_at: datetime
    detected_monotonic: float = field(default_factory=time.monotonic)


Emit = Callable[[DiscoveredCheckpoint], object]
Progress = Callable[[int, int | None], None]  # (bytes done, bytes in all when known)


@dataclass(frozen=True, slots=True)
class FetchItem:
    """What the fetch step knows about a registered checkpoint."""

    checkpoint_id: int
    version: str
    uri: str
    compacted: bool = False  # a delta's compacted files (from its anchor) instead of its own (daemon.delta)


class FetchError(Exception):
    """The checkpoint could not be made local. With `retry_after_s` the cause is passing (the store
    is down): the checkpoint goes back to `discovered` and is fetched again; without it, rejected."""

    def __init__(self, reason: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class Source(Protocol):
    label: str  # stored in checkpoints.source

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def describe(self) -> dict[str, Any]:
        """What `/status` shows: at least name, type and where it looks."""
        ...

    def fetch(self, item: FetchItem, progress: Progress) -> Path: ...
    def prune(self, protected: frozenset[Path]) -> list[Path]: ...

    # Optional, read with getattr by the daemon's health monitor (daemon.process.health):
    #   health_problem() -> str | None   why it cannot see new checkpoints now (a `source_failing` problem)
    #   errors_total: int                failed polls since start (hotswap_source_errors_total)


class SourceType(Protocol):
    """A source class as the registry names it: its config dataclass and its constructor."""

    config_type: type[Any]

    # scheduler: the daemon's APScheduler (a source adds its periodic jobs to it), or None
    def __call__(self, config: Any, emit: Emit, scheduler: Any = None) -> Source: ...
