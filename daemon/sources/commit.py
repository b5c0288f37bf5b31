"""Commit detection: is this checkpoint directory finished being written?

Signals, first that applies (order configurable per source, DESIGN.md):
  manifest  hotswap-manifest.json is present (written last by `hotswap publish`)
  index     model.safetensors.index.json lists shards that are all present, and the
            sizes of every file stayed the same for the quiet period
  marker    a marker file such as _SUCCESS exists
Nothing is read past a listing and `stat` except the (small) manifest and index.

A manifest copied in before the files it lists (e.g. `cp -r` in arbitrary order)
is not trusted on sight: while a listed file is missing or has a different size
the directory is "pending", until the sizes stop changing for the quiet period;
then it is handed on and the checks reject it with the exact file named.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from daemon.formats.checkpoint import INDEX_NAME, MANIFEST_NAME
from daemon.formats.smallfile import INDEX_CAP_BYTES, SmallFileError, read_json_object
from daemon.sources.base import DiscoveredCheckpoint

MANIFEST_PEEK_BYTES = INDEX_CAP_BYTES  # the larger of the manifest's and the index's caps
COMMIT_SIGNALS = ("manifest", "index", "marker")


@dataclass(frozen=True, slots=True)
class Decision:
    committed: bool
    signal: str | None = None
    version: str | None = None
    reason: str = ""  # why not (yet): for debug logs
    recheck_after_s: float | None = None  # ask again after this long (quiet period running)


Snapshot = tuple[tuple[str, int, int], ...]  # (name, size, mtime_ns) of every file


@dataclass
class _Quiet:
    snapshot: Snapshot
    since: float


class CommitDetector:
    """Stateful (remembers snapshots for quiet periods); one per source; not thread-safe.

    `clock` is the seam for the quiet period (seconds, monotonic); tests pass a fake one.
    """

    def __init__(
        self,
        signals: list[str],
        quiet_period_s: float = 2.0,
        marker_names: list[str] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.signals = list(signals)
        self.quiet_period_s = quiet_period_s
        self.marker_names = list(marker_names or [])
        self._quiet: dict[Path, _Quiet] = {}
        self._now = clock

    def forget(self, directory: Path) -> None:
        self._quiet.pop(directory, None)

    def check(self, directory: Path) -> Decision:
        if not directory.is_dir():
            self.forget(directory)
            return Decision(False, reason="not a directory")
        reasons: list[str] = []
        recheck: float | None = None
        for signal in self.signals:
            d: Decision = getattr(self, f"_check_{signal}")(directory)
            if d.committed:
                self.forget(directory)
                return d
            if d.reason:
                reasons.append(f"{signal}: {d.reason}")
            if d.recheck_after_s is not None:
                recheck = d.recheck_after_s if recheck is None else min(recheck, d.recheck_after_s)
        return Decision(False, reason="; ".join(reasons), recheck_after_s=recheck)

    # -- signals --------------------------------------------------------------------------

    def _check_manifest(self, directory: Path) -> Decision:
        path = directory / MANIFEST_NAME
        if not path.is_file():
            return Decision(False)  # silent: the common "not yet" case
        doc = _read_json(path)
        if doc is None:
            # Unparseable: maybe still being copied. Wait for it to stop changing, then let the
            # manifest check reject it with the parse error.
            return self._quiet_or_commit(directory, "manifest", directory.name, "manifest not parseable yet")
        version = doc.get("version") if isinstance(doc.get("version"), str) and doc.get("version") else None
        label = version or directory.name
        files = doc.get("files")
        if isinstance(files, list):
            for item in files:
                if not isinstance(item, dict) or not isinstance(item.get("path"), str):
                    continue
                try:
                    st = (directory / item["path"]).stat()
                except (OSError, ValueError):
                    return self._quiet_or_commit(
                        directory, "manifest", label, f"{item['path']} not there yet"
                    )
                if st.st_size != item.get("bytes"):
                    return self._quiet_or_commit(
                        directory,
                        "manifest",
                        label,
                        f"{item['path']} has {st.st_size} of {item.get('bytes')} bytes",
                    )
        return Decision(True, "manifest", label)

    def _check_index(self, directory: Path) -> Decision:
        index = directory / INDEX_NAME
        if not index.is_file():
            return Decision(False)
        doc = _read_json(index)
        if doc is None or not isinstance(doc.get("weight_map"), dict):
            return self._quiet_only(directory, "index not parseable yet")
        shards = sorted({v for v in doc["weight_map"].values() if isinstance(v, str)})
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            self.forget(directory)
            return Decision(False, reason=f"shard {missing[0]} missing")
        return self._quiet_or_commit(directory, "index", directory.name, "waiting for the quiet period")

    def _check_marker(self, directory: Path) -> Decision:
        for name in self.marker_names:
            if (directory / name).exists():
                return Decision(True, "marker", directory.name)
        return Decision(False)

    # -- quiet period ---------------------------------------------------------------------

    def _quiet_only(self, directory: Path, reason: str) -> Decision:
        self._observe(directory)
        return Decision(False, reason=reason, recheck_after_s=self.quiet_period_s)

    def _quiet_or_commit(self, directory: Path, signal: str, version: str, reason: str) -> Decision:
        """Committed once the directory's file sizes have not changed for the quiet period."""
        elapsed = self._observe(directory)
        if elapsed >= self.quiet_period_s:
            return Decision(True, signal, version)
        return Decision(False, reason=reason, recheck_after_s=max(0.05, self.quiet_period_s - elapsed))

    def _observe(self, directory: Path) -> float:
        """Seconds the directory's snapshot has been unchanged (0 when it just changed)."""
        snap = snapshot(directory)
        now = self._now()
        q = self._quiet.get(directory)
        if q is None or q.snapshot != snap:
            self._quiet[directory] = _Quiet(snap, now)
            return 0.0 if self.quiet_period_s > 0 else float("inf")
        return now - q.since


def snapshot(directory: Path) -> Snapshot:
    """(relative path, size, mtime) of every file below `directory`; cheap: stat only."""
    out: list[tuple[str, int, int]] = []
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            p = os.path.join(dirpath, name)
            try:
                st = os.stat(p)
            except OSError:
                continue
            out.append((os.path.relpath(p, directory), st.st_size, st.st_mtime_ns))
    out.sort()
    return tuple(out)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:  # bounded, regular files only (a FIFO cannot hang the source), never a symlink out
        return read_json_object(path.parent, path.name, MANIFEST_PEEK_BYTES)
    except SmallFileError:
        return None


def discovered(source: str, directory: Path, decision: Decision) -> DiscoveredCheckpoint:
    assert decision.committed and decision.signal and decision.version
    return DiscoveredCheckpoint(
        source=source,
        directory=directory,
        version=decision.version,
        signal=decision.signal,
        uri=directory.resolve().as_uri(),
        detected_at=datetime.now(UTC),
    )
