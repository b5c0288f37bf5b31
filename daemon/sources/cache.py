"""A source's own folder of checkpoint directories (an S3 download cache, the push registry folder),
kept under a size limit by the retention hook.

`prune_cache(root, max_bytes, protected)` deletes whole checkpoint directories, oldest first
(by modification time), until the folder holds at most `max_bytes`; it never deletes one in
`protected` (serving, last good, pinned, in flight) nor one whose name starts with "." (a
download or upload still being assembled). `max_bytes = 0` keeps everything.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from daemon.common import get_logger

log = get_logger(__name__)


def tree_bytes(path: Path) -> int:
    """Bytes allocated to the regular files below `path` (sparse files count what they use on disk)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            total += min(st.st_size, st.st_blocks * 512) if st.st_blocks else st.st_size
    return total


def prune_cache(root: Path, max_bytes: int, protected: frozenset[Path], *, label: str = "") -> list[Path]:
    """Delete the oldest unprotected checkpoint directories of `root` until it fits `max_bytes`."""
    if max_bytes <= 0 or not root.is_dir():
        return []
    keep = {p.resolve() for p in protected}
    entries: list[tuple[float, Path, int]] = []
    total = 0
    for child in root.iterdir():
        if not child.is_dir() or child.is_symlink():
            continue
        size = tree_bytes(child)
        total += size
        if child.name.startswith("."):
            continue  # being assembled: counted, never deleted here
        entries.append((child.stat().st_mtime, child, size))
    removed: list[Path] = []
    for _mtime, child, size in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        if child.resolve() in keep:
            continue
        shutil.rmtree(child, ignore_errors=True)
        if not child.exists():
            total -= size
            removed.append(child)
    if total > max_bytes:
        log.info("cache over its size limit; the rest is protected", source=label, bytes=total, limit=max_bytes)
    return removed
