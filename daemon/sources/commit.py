"""Commit detection: is this checkpoint directory finished being written?

Signals, first that applies (order configurable per source, docs/concepts/checkpoints.md):
  manifest  hotswap-manifest.json is present (written last by `hotswap publish`)
  index     model.safetensors.index.json lists shards that are all present, and the
            sizes of every file stayed the same for the quiet period
  marker    a marker file such as _SUCCESS exists
Nothing is read past a listing and `stat` except the (small) manifest and index.

A manifest copied in before the files it lists (e.g. `cp -r` in arbitrary order, or a
writer that stalls) is not trusted on sight: while a listed file is missing or shorter
than listed the directory is "pending". It waits for the files, up to the commit timeout
(default 10 minutes) of no change at all; only then is it handed on, and the checks reject
it with the exact file named. A listed file that is longer than listed (being rewritten,
or not the file the manifest describes) waits for the quiet period, then is handed on.

A delta checkpoint's manifest (daemon.delta) lists the result files; what arrives are its delta
files, listed in its `delta` section: those are the files waited for.

A committed Decision's `version` is the manifest's `version`, else the directory's name; the
source refuses one that cannot be a label (daemon.formats.names.version_problem: a newline, a
control character, a slash, ...) with that reason, before anything is registered.

Nothing here follows a symlink out of the watched folder: `escapes(directory, root)` names
the first link (the checkpoint directory itself, or a file or folder in it) that resolves
outside, and the source refuses such a checkpoint with that reason. Files are read only when they are
regular files (a FIFO in place of the manifest is "not there", never a hang).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from daemon.formats import INDEX_CAP_BYTES, INDEX_NAME, MANIFEST_NAME, SmallFileError, read_json_object
from daemon.sources.base import DiscoveredCheckpoint

MANIFEST_PEEK_BYTES = INDEX_CAP_BYTES  # the larger of the manifest's and the index's caps


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
        commit_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.signals = list(signals)
        self.quiet_period_s = quiet_period_s
        self.commit_timeout_s = commit_timeout_s
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
        if isinstance(doc.get("delta"), dict):  # a delta checkpoint: its delta files are what arrives
            files = doc["delta"].get("files")
        if isinstance(files, list):
            for item in files:
                if not isinstance(item, dict) or not isinstance(item.get("path"), str):
                    continue
                try:
                    st = (directory / item["path"]).stat()
                except (OSError, ValueError):
                    return self._wait_for_files(directory, label, f"{item['path']} not there yet")
                listed = item.get("bytes")
                if isinstance(listed, int) and st.st_size < listed:
                    return self._wait_for_files(directory, label, f"{item['path']} has {st.st_size} of {listed} bytes")
                if st.st_size != listed:
                    return self._quiet_or_commit(
                        directory, "manifest", label, f"{item['path']} has {st.st_size} bytes, the manifest lists {listed}"
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

    def _wait_for_files(self, directory: Path, version: str, reason: str) -> Decision:
        """Listed files missing or short: wait for them while anything changes, and for up to the
        commit timeout after the last change; then hand it on (the checks name the file)."""
        elapsed = self._unchanged_for(directory)
        if elapsed >= self.commit_timeout_s:
            return Decision(True, "manifest", version)
        left = self.commit_timeout_s - elapsed
        return Decision(False, reason=f"{reason} (waiting up to {left:.0f} s more)",
                        recheck_after_s=max(0.05, min(left, max(self.quiet_period_s, 1.0))))  # fmt: skip

    def _quiet_or_commit(self, directory: Path, signal: str, version: str, reason: str) -> Decision:
        """Committed once the directory's file sizes have not changed for the quiet period."""
        elapsed = self._observe(directory)
        if elapsed >= self.quiet_period_s:
            return Decision(True, signal, version)
        return Decision(False, reason=reason, recheck_after_s=max(0.05, self.quiet_period_s - elapsed))

    def _observe(self, directory: Path) -> float:
        """Seconds the directory's snapshot has been unchanged (0 when it just changed; inf when
        there is no quiet period)."""
        elapsed = self._unchanged_for(directory)
        return elapsed if self.quiet_period_s > 0 else float("inf")

    def _unchanged_for(self, directory: Path) -> float:
        snap = snapshot(directory)
        now = self._now()
        q = self._quiet.get(directory)
        if q is None or q.snapshot != snap:
            self._quiet[directory] = _Quiet(snap, now)
            return 0.0
        return now - q.since


def natural(name: str) -> tuple[tuple[int, int, str], ...]:
    """A name's sort key with digit runs compared as numbers: "s2" before "s10"."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name) if part)


def commit_order(root: Path) -> list[str]:
    """The directories directly in `root`, oldest change first: by ctime (a rename into place or
    the last file written in it sets it), then by name with numbers read as numbers (ctimes tie
    at the kernel clock's tick). A scan registers checkpoints in this order, so a version's id
    (its arrival, what orders versions without a step: daemon.rollout.planner.newer) follows
    when it was committed, not the filesystem's listing order (a hash on ext4)."""
    found: list[tuple[int, tuple[tuple[int, int, str], ...], str]] = []
    for path in root.iterdir():
        try:
            st = path.stat()
        except OSError:
            continue  # removed since the listing
        if stat.S_ISDIR(st.st_mode):
            found.append((st.st_ctime_ns, natural(path.name), path.name))
    return [name for _ctime, _key, name in sorted(found)]


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


def fingerprint(directory: Path | None) -> str | None:
    """A short digest of what the directory holds (names, sizes, mtimes); None without a directory.
    It changes only when the bytes could have: a file written, added, removed or resized. Each
    host's copy has its own (its files' times are its own): compare it only with that host's."""
    if directory is None or not directory.is_dir():
        return None
    h = hashlib.sha256()
    for name, size, mtime in snapshot(directory):
        h.update(f"{name}\0{size}\0{mtime}\n".encode(errors="surrogateescape"))
    return h.hexdigest()[:32]


def escapes(directory: Path, root: Path) -> str | None:
    """Why `directory` (a checkpoint under the watched folder `root`) may not be read: it, or a
    file or folder in it, is a symlink resolving outside `root`. None when it stays inside."""
    real_root = os.path.realpath(root)
    if directory.is_symlink():
        target = os.path.realpath(directory)
        if os.path.commonpath([real_root, target]) != real_root:
            return f"{directory.name} is a symlink to {target}, outside the watched folder {root}"
    for dirpath, dirs, files in os.walk(directory):
        for name in (*dirs, *files):
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                continue
            target = os.path.realpath(p)
            if os.path.commonpath([real_root, target]) != real_root:
                rel = os.path.relpath(p, directory)
                return f"{directory.name}/{rel} is a symlink to {target}, outside the watched folder {root}"
    return None


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
