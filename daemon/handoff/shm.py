"""Shared host memory for the ipc transport on machines without a GPU (and in CI).

The loader writes a staged version into one file under /dev/shm (a tmpfs), mode 0600 while
it fills it and 0400 once sealed, so no worker can change a version after export. A worker
maps that file copy-on-write (MAP_PRIVATE): it reads the shared pages, and a stray in-place
write would land in a private copy rather than in the version other workers see. The file
descriptor is closed right after mapping, and the mapping goes away when the last tensor
view of it dies, so nothing is held open that the caller does not hold.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from daemon.handoff.descriptor import SHM_PREFIX, DescriptorError

if TYPE_CHECKING:
    import torch


class ShmError(RuntimeError):
    """A shared-memory segment could not be created, filled or mapped; the message names the file."""


def segment_name(pid: int, seq: int, version: str) -> str:
    """`hotswap-<pid>-<seq>-<128 random bits>-<version>`: no other user can guess it to take it first."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", version)[:64]
    return f"{SHM_PREFIX}{pid}-{seq}-{secrets.token_hex(16)}-{safe}"


def segment_owner(name: str) -> int | None:
    """The loader pid encoded in a segment file name, or None for a name we did not make."""
    m = re.match(rf"^{re.escape(SHM_PREFIX)}(\d+)-\d+-", name)
    return int(m.group(1)) if m else None


class ShmSegment:
    """Loader side: a new segment file, writable until `seal()`."""

    def __init__(self, directory: Path, name: str, nbytes: int) -> None:
        if nbytes <= 0:
            raise ShmError(f"segment {name}: size must be positive, got {nbytes}")
        self.path = directory / name
        self.nbytes = nbytes
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            self._fd: int | None = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise ShmError(f"{self.path}: cannot create segment ({exc.strerror})") from None
        try:
            # reserve the pages now: a full tmpfs fails here with ENOSPC, not later with SIGBUS
            os.posix_fallocate(self._fd, 0, nbytes)
            self._map: mmap.mmap | None = mmap.mmap(self._fd, nbytes, mmap.MAP_SHARED)
        except OSError as exc:
            self.unlink()
            raise ShmError(f"{self.path}: cannot size or map {nbytes} bytes ({exc.strerror})") from None

    def view(self) -> memoryview:
        if self._map is None:
            raise ShmError(f"{self.path}: segment is sealed")
        return memoryview(self._map)

    def seal(self) -> None:
        """Unmap, make the file read-only and close it; the data stays in the file."""
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.fchmod(self._fd, 0o400)
            os.close(self._fd)
            self._fd = None

    def unlink(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class ShmMapping:
    """Worker side: a sealed segment mapped copy-on-write, exposed as one flat uint8 tensor."""

    def __init__(self, path: str, nbytes: int, trusted_uids: frozenset[int] | None = None) -> None:
        """`trusted_uids`: the segment must belong to one of these users and be sealed (no write
        bits), so no other local user can have made or changed it."""
        import torch  # the loader side of this module must not pay for importing torch

        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise DescriptorError(f"shared-memory segment {path}: cannot open ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise DescriptorError(f"shared-memory segment {path} is not a regular file")
            if trusted_uids is not None and st.st_uid not in trusted_uids:
                raise DescriptorError(f"shared-memory segment {path} belongs to uid {st.st_uid}, not the loader's user")
            if trusted_uids is not None and st.st_mode & 0o222:
                raise DescriptorError(f"shared-memory segment {path} is writable (mode {stat.S_IMODE(st.st_mode):o}), not sealed")
            if st.st_size != nbytes:
                raise DescriptorError(
                    f"shared-memory segment {path} has {st.st_size} bytes, the descriptor says {nbytes}"
                )
            mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        self.path = path
        self.nbytes = nbytes
        self._holder = weakref.ref(mm)
        self._tensor: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8)

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ShmError(f"{self.path}: mapping was closed")
        return self._tensor

    def close(self) -> bool:
        """Drop our reference; True when unmapped now (no view of it is alive)."""
        self._tensor = None
        return self._holder() is None
