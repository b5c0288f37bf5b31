"""One daemon per state directory: an exclusive `flock` on `<state_dir>/daemon.lock`.

A second daemon on the same state directory would adopt the first one's workers, overwrite its
`daemon.json` and, on stop, kill the shared worker. The lock is taken before anything else
happens at start (no migration, no seed, no launch) and held by the open file descriptor for the
process's life: the kernel releases it when the holder dies, however it dies, so there is no
stale lock to clean up. The holder's pid is written into the file so the refusal can name it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from daemon.common.private import open_private, private_dir

LOCK_FILE = "daemon.lock"


class StateDirLocked(RuntimeError):
    """Another live daemon holds this state directory (str() is the one-line message)."""


class StateDirLock:
    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / LOCK_FILE
        self._fd: int | None = None

    def check_free(self) -> None:
        """Raise `StateDirLocked` if a live daemon holds the lock; creates nothing (for preflight)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return  # no lock file (or no state dir yet): nobody holds it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._locked(_read_pid(fd)) from None
        finally:
            os.close(fd)

    def acquire(self) -> None:
        if not self.path.parent.is_dir():
            private_dir(self.path.parent)  # 0700 from the start (an existing one is tightened by the daemon)
        fd = open_private(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise self._locked(holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def _locked(self, holder: int | None) -> StateDirLocked:
        who = f"pid {holder}" if holder else "another process"
        return StateDirLocked(f"another hotswap daemon ({who}) already runs on state directory {self.path.parent}; "
                              "stop it first or give this one its own [daemon] state_dir")  # fmt: skip

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None
