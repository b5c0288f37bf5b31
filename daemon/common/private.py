"""Files and folders only the daemon's user may open, whatever the umask it was started with.

The state directory holds the registry (`hotswap.db` and its -wal/-shm), the control and worker
tokens, `daemon.json`, the managed workers' logs and runtime files: another local user who can
read it reads the whole registry, or takes the control API. So the directory is 0700 and what the
daemon creates in it is 0600, set when each is created (the mode is given to open(2) and then set
exactly, since a umask only takes bits away), and an existing one of ours that is looser is
tightened (and the caller logs that it was):

    private_dir(path) -> previous mode when it was tightened, else None   (created 0700)
    tighten(path, mode) -> previous mode when it was tightened, else None (ours only)
    open_private(path, flags) -> fd                                        (created 0600)
    write_private(path, data)                                              (atomic, 0600)
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def tighten(path: Path, mode: int) -> int | None:
    """Set `path`'s mode to `mode` when it allows more; only for a file or folder of this user (never a
    symlink's target). Returns the mode it had when it was changed, else None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    old = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or old & ~mode == 0:
        return None
    os.chmod(path, mode)
    return old


def private_dir(path: Path) -> int | None:
    """Create `path` (and its parents) with the folder itself 0700; tighten it when it exists and is
    looser. Returns the mode it had when it was tightened, else None."""
    path = Path(path)
    try:
        path.mkdir(parents=True, mode=DIR_MODE)
    except FileExistsError:
        return tighten(path, DIR_MODE)
    os.chmod(path, DIR_MODE)  # exactly, whatever the umask took away
    return None


def open_private(path: Path, flags: int) -> int:
    """os.open with O_CREAT: a new file is 0600; an existing one of ours that is looser is tightened."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically (a 0600 temporary file renamed over it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_EXCL)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
