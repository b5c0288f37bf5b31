"""Bounded reads of the small JSON files a checkpoint carries (config, index, manifest).

A checkpoint directory is written by someone else. Whatever sits under these names,
reading it must neither hang (a FIFO or a device), nor eat memory (a 1 GB "config"),
nor leave the checkpoint (a symlink to /etc/shadow or to another user's files):

- opened with O_NONBLOCK | O_NOCTTY, then `fstat` on the open descriptor must say
  "regular file" before a byte is read (no check-then-open race);
- the file actually opened (its /proc/self/fd link) must lie inside the checkpoint
  directory, symlinks inside it are fine;
- at most `cap` bytes are read; a larger file is refused naming the file and the cap;
- JSON is parsed with duplicate keys allowed (as json does), deep nesting refused.

    from daemon.formats.smallfile import read_json_object, CONFIG_CAP_BYTES
    doc = read_json_object(directory, "config.json", CONFIG_CAP_BYTES)   # SmallFileError on any fault
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
CONFIG_CAP_BYTES = 4 * MIB  # Hugging Face configs are kilobytes
INDEX_CAP_BYTES = 32 * MIB  # one weight_map line per tensor: the largest MoE indexes are ~10 MB
MANIFEST_CAP_BYTES = 16 * MIB  # ~200 bytes per file: 80,000 files

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)


class SmallFileError(ValueError):
    """Missing, not a regular file, too large, outside the checkpoint, or not a JSON object."""


class SmallFileMissing(SmallFileError, FileNotFoundError):
    """Nothing under that name (a caller may treat this as "not there yet")."""


def _opened_path(fd: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:  # no /proc: fall back to resolving the name (racy, but still a check)
        return None


def read_small_file(directory: str | os.PathLike[str], name: str, cap: int) -> bytes:
    """The bytes of `directory/name` (a relative path), read with every rule above."""
    root = Path(directory)
    path = root / name
    where = str(path)
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise SmallFileError(f"{where}: path leaves the checkpoint")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise SmallFileMissing(f"{where}: missing") from None
    except OSError as exc:
        raise SmallFileError(f"{where}: unreadable ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SmallFileError(f"{where}: not a regular file")
        real_root = root.resolve()
        opened = _opened_path(fd) or path.resolve()
        if str(opened).endswith(" (deleted)"):
            raise SmallFileError(f"{where}: removed while being read")
        if not opened.is_relative_to(real_root):
            raise SmallFileError(f"{where}: a symlink leaving the checkpoint (-> {opened})")
        if st.st_size > cap:
            raise SmallFileError(f"{where}: {st.st_size} bytes, larger than the {cap}-byte cap")
        chunks: list[bytes] = []
        left = cap + 1  # one byte more than allowed tells a file that grew while read
        while left > 0:
            data = os.read(fd, min(left, MIB))
            if not data:
                break
            chunks.append(data)
            left -= len(data)
    except OSError as exc:
        raise SmallFileError(f"{where}: unreadable ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > cap:
        raise SmallFileError(f"{where}: larger than the {cap}-byte cap")
    return raw


def parse_json_object(raw: bytes, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise SmallFileError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise SmallFileError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:
        raise SmallFileError(f"{where}: not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise SmallFileError(f"{where}: not a JSON object")
    return doc


def read_json_object(directory: str | os.PathLike[str], name: str, cap: int) -> dict[str, Any]:
    """`read_small_file`, then strict UTF-8 JSON whose top level is an object."""
    return parse_json_object(read_small_file(directory, name, cap), str(Path(directory) / name))
