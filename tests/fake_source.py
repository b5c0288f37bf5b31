"""`FakeSource`: a `Source` whose checkpoints are not local until fetched, for fast tests of the
coordinator's fetch step and the retention hook. Registered in `daemon.sources.SOURCE_TYPES` as
type "fake" by those tests: that one line, plus this module, is all a new source type needs.

Its "store" is a folder of published checkpoints; `fetch` copies one into its cache folder (the
directory it created), failing first as told; `prune` deletes cached copies not protected.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Literal

from daemon.sources.base import DiscoveredCheckpoint, Emit, FetchError, FetchItem, Progress


@dataclass
class FakeSourceConfig:
    store: str  # required: folder of published checkpoints, one per subdirectory
    cache: str = ""  # where fetched copies go; "" = <store>/../cache
    type: Literal["fake"] = "fake"
    name: str = ""

    def validate(self, key: str) -> None:
        if not self.store:
            raise ValueError(f"{key}.store: must not be empty")

    @property
    def label(self) -> str:
        return self.name or f"fake:{self.store}"


@dataclass
class _Planned:
    reason: str
    retry_after_s: float | None


class FakeSource:
    config_type: ClassVar[type[FakeSourceConfig]] = FakeSourceConfig

    def __init__(self, config: FakeSourceConfig, emit: Emit, scheduler: Any = None) -> None:
        self.config = config
        self.label = config.label
        self.emit = emit
        self.store = Path(config.store)
        self.cache = Path(config.cache) if config.cache else self.store.parent / "cache"
        self.failures: list[_Planned] = []
        self.fetched: list[str] = []
        self.pruned_with: list[frozenset[Path]] = []
        self.started = False

    def fail_next(self, reason: str, retry_after_s: float | None = None) -> None:
        self.failures.append(_Planned(reason, retry_after_s))

    def offer(self, name: str) -> DiscoveredCheckpoint:
        """The trainer committed `name` in the store: announce it (no local directory yet)."""
        item = DiscoveredCheckpoint(self.label, None, name, "manifest", f"fake://{self.store}/{name}", datetime.now(UTC))
        self.emit(item)
        return item

    # -- Source ----------------------------------------------------------------------------
    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.started = False

    def describe(self) -> dict[str, Any]:
        return {"name": self.label, "type": "fake", "store": str(self.store)}

    def fetch(self, item: FetchItem, progress: Progress) -> Path:
        if self.failures:
            f = self.failures.pop(0)
            raise FetchError(f.reason, retry_after_s=f.retry_after_s)
        src = self.store / item.uri.rsplit("/", 1)[-1]
        dst = self.cache / item.version
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst)
        progress(sum(p.stat().st_size for p in dst.iterdir()), None)
        self.fetched.append(item.version)
        return dst

    def prune(self, protected: frozenset[Path]) -> list[Path]:
        self.pruned_with.append(protected)
        gone = []
        for d in sorted(self.cache.iterdir()) if self.cache.is_dir() else []:
            if d not in protected:
                shutil.rmtree(d)
                gone.append(d)
        return gone
