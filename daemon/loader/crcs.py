"""CRC32C of whole files from the chunks the loader's reader threads stage, in any order.

Each chunk is CRC'd by the thread that read it, from the buffer it staged from; at the end the
chunk CRCs are joined in file order with `crc32c_combine`, and the bytes no chunk covered (the
safetensors header, any gap) are read here. Used when the daemon's verify stages in the loader
(`stage` with `verify_alg`): the registry keeps a CRC32C next to the strong hash for every file.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import crc32c as _crc32c

from daemon.crc import crc32c_combine


class RangeCrcs:
    def __init__(self) -> None:
        self._parts: dict[Path, list[tuple[int, int, int]]] = {}
        self._lock = threading.Lock()

    def feed(self, file: Path, offset: int, data: Any) -> None:
        crc = _crc32c.crc32c(memoryview(data).cast("B"))
        with self._lock:
            self._parts.setdefault(file, []).append((offset, len(memoryview(data).cast("B")), crc))

    def result(self, file: Path, size: int) -> str:
        """The CRC32C (8 hex) of the whole `size`-byte file."""
        parts = sorted(self._parts.get(file, []))
        total, pos = 0, 0
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for off, n, crc in [*parts, (size, 0, 0)]:
                if off < pos:
                    raise ValueError(f"{file}: staged chunks overlap at byte {off}")
                if off > pos:  # bytes no chunk staged (the header): read them for the CRC
                    gap = os.pread(fd, off - pos, pos)
                    if len(gap) != off - pos:
                        raise OSError(f"{file}: short read at byte {pos} computing its CRC32C")
                    total = crc32c_combine(total, _crc32c.crc32c(gap), len(gap))
                if n:
                    total = crc32c_combine(total, crc, n)
                pos = off + n
        finally:
            os.close(fd)
        return f"{total:08x}"
