"""The files an engine (vLLM, SGLang) is about to load, checked against what verify recorded.

vLLM and SGLang read a checkpoint directory themselves and cannot compare what they read with
the registry's digests. So before such an engine is pointed at a directory, the client hashes
the files of the request's `expect.files` (one read, BLAKE3/SHA-256 as verify did) and records
each file's identity (device, inode, size, mtime, ctime; ctime cannot be set back by a user).
Right before the reload call it looks again (one stat per file) and refuses if anything changed.
It also refuses weight files in the directory that verify never saw: an engine loads every
`*.safetensors` (or `*.bin`) it finds there.

What this closes: a checkpoint overwritten, truncated, replaced or extended after verify (a
trainer writing in place, an operator copying over it) is refused and the engine keeps serving
its weights. What it narrows but cannot close: a writer racing the engine's own read in the
moment between the last stat and that read; the reference worker and the ipc loader hash the
very bytes they load (use them where that matters).

The hash runs in `prepare` (before the pause) when the rollout asks for it; one hash per
(directory, version, digest) serves every engine worker on the host. LoRA adapter directories
go through the same check before an engine's load-adapter call (`adapter_model.safetensors`
against its verified digest, and no other weight file beside it).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from daemon.bytepipe import hash_files
from daemon.transport import Expect, Reference, reference_for

# What an engine would load from a directory besides the files the manifest lists.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
CACHE_ENTRIES = 8  # checked (directory, version) pairs kept; a rollout touches one or two


class EngineFilesRefused(ValueError):
    """The directory's files are not the bytes verify saw (or cannot be checked)."""


@dataclass(frozen=True, slots=True)
class FileIdentity:
    path: str  # relative to the checkpoint directory
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, root: Path, rel: str) -> FileIdentity:
        st = os.stat(root / rel, follow_symlinks=True)
        return cls(rel, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True, slots=True)
class CheckedFiles:
    """A directory whose listed files hashed to the verified digests, as they were then."""

    root: str
    version: str
    files: tuple[FileIdentity, ...]
    weak: tuple[str, ...]  # files the registry knows only by CRC32C (format-1 rows)

    def changed(self) -> str | None:
        """Why the directory is no longer what was checked (a stat per file), or None."""
        root = Path(self.root)
        for before in self.files:
            try:
                now = FileIdentity.of(root, before.path)
            except OSError as exc:
                return f"{before.path}: {exc.strerror or exc} since it was checked"
            if now != before:
                return f"{before.path}: {_difference(before, now)} since it was checked"
        return _unlisted(root, {f.path for f in self.files})


def check_engine_files(root: str, version: str, expect: Expect) -> CheckedFiles | None:
    """Hash the request's files (or reuse an unchanged earlier check); None when the request
    carries no per-file digests. Raises EngineFilesRefused naming the first problem."""
    refs = [r for r in (reference_for(f) for f in expect.files) if r is not None]
    if not refs:
        return None
    key = (str(Path(root).resolve()), version, expect.digest)
    with _CACHE_LOCK:
        lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with lock:  # a second worker of the host waits for the first one's hash, then reuses it
        with _CACHE_LOCK:
            cached = _CACHE.get(key)
        if cached is not None and cached.changed() is None:
            return cached
        problem = _unlisted(Path(key[0]), {r.path for r in refs})  # a stat walk: never recorded
        if problem:
            raise EngineFilesRefused(problem)
        failed = _FAILED.get(key)  # only hash mismatches are recorded (what costs a read)
        if failed is not None and failed[0] == _identities(Path(key[0]), refs):
            raise EngineFilesRefused(failed[1])  # refused before and untouched since: not hashed again
        try:
            checked = _hash_and_compare(Path(key[0]), version, refs)
        except EngineFilesRefused as exc:
            _FAILED[key] = (_identities(Path(key[0]), refs), str(exc))
            raise
        _FAILED.pop(key, None)
        with _CACHE_LOCK:
            _CACHE[key] = checked
            _CACHE.move_to_end(key)
            while len(_CACHE) > CACHE_ENTRIES:
                old, _ = _CACHE.popitem(last=False)
                _KEY_LOCKS.pop(old, None)
                _FAILED.pop(old, None)
        return checked


def _hash_and_compare(root: Path, version: str, refs: list[Reference]) -> CheckedFiles:
    try:
        before = tuple(FileIdentity.of(root, r.path) for r in refs)
    except OSError as exc:
        raise EngineFilesRefused(f"{exc.filename or root}: {exc.strerror or exc}") from None
    for ident, ref in zip(before, refs, strict=True):
        if ident.size != ref.bytes:
            raise EngineFilesRefused(f"{ref.path}: {ident.size} bytes, {ref.bytes} verified (changed since verify)")
    for alg in sorted({r.alg for r in refs}):
        group = [r for r in refs if r.alg == alg]
        try:
            weak = alg == "crc32c"  # format-1 rows: CRC only; else only the strong hash (no CRC pass)
            digests = hash_files([root / r.path for r in group], alg=None if weak else alg, crc=weak)
        except OSError as exc:
            raise EngineFilesRefused(f"{exc.filename or root}: {exc.strerror or exc} while hashing") from None
        for ref, got in zip(group, digests, strict=True):
            value = got.crc32c if alg == "crc32c" else got.hash
            if value.lower() != ref.value:
                raise EngineFilesRefused(
                    f"{ref.path}: {alg} {value[:16]}... does not match the verified {ref.value[:16]}... "
                    "(changed since verify)"
                )
    checked = CheckedFiles(str(root), version, before, tuple(r.path for r in refs if not r.strong))
    moved = checked.changed()  # written to while it was hashed: what was hashed is not what is there
    if moved:
        raise EngineFilesRefused(moved.replace("since it was checked", "while it was hashed"))
    return checked


def _identities(root: Path, refs: list[Reference]) -> tuple[FileIdentity | None, ...]:
    out: list[FileIdentity | None] = []
    for r in refs:
        try:
            out.append(FileIdentity.of(root, r.path))
        except OSError:
            out.append(None)
    return tuple(out)


def _unlisted(root: Path, listed: set[str]) -> str | None:
    """A weight file in the directory that verify never saw (an engine would load it too)."""
    try:
        for path in sorted(root.rglob("*")):
            if path.suffix in WEIGHT_SUFFIXES and path.relative_to(root).as_posix() not in listed:
                return f"{path.relative_to(root).as_posix()}: a weight file that was not verified is in {root}"
    except OSError as exc:
        return f"{root}: {exc.strerror or exc}"
    return None


def _difference(before: FileIdentity, now: FileIdentity) -> str:
    if (now.dev, now.ino) != (before.dev, before.ino):
        return "replaced by another file"
    if now.size != before.size:
        return f"{now.size} bytes now, {before.size} checked"
    return "written to"


_CACHE: OrderedDict[tuple[str, str, str | None], CheckedFiles] = OrderedDict()
_KEY_LOCKS: dict[tuple[str, str, str | None], threading.Lock] = {}
# refusals, by the files' identities when refused: the same untouched files are not hashed again
_FAILED: dict[tuple[str, str, str | None], tuple[tuple[FileIdentity | None, ...], str]] = {}
_CACHE_LOCK = threading.Lock()
