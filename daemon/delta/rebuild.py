"""The host side: a delta checkpoint + this host's verified copy of its base -> a full version directory.

    rebuild_delta(delta_dir, manifest, spec, base_dir, base_files, out_dir)

Every delta file is hashed against the signed `delta` section before it is used. Each rebuilt
file is hashed in memory as its chunks are decoded (CRC32C per chunk, the strong hash in file
order: daemon.bytepipe.sinks), so the result is checked against the manifest with no second read
of 16 GB. That check is also what proves the base bytes a rebuilt file was decoded from: a base
changed on disk since it was verified decodes to a result that does not match, so the bases of
rebuilt files are not re-hashed on the way (16 GB of hashing beside the decoding, for the 8B
layout); only when a result does not match is its base hashed, to say which was wrong. Each base
file the result copies unchanged is re-hashed (in a thread beside the decoding) against the
digests the base was verified with: with the strong hash alone where it has one (equal bytes hash
equal: the CRC32C would prove nothing more), else with CRC32C; a base changed on disk since is
refused. The result is assembled in a hidden temporary folder beside `out_dir` and renamed into
place only when everything held, so `out_dir` is either whole or absent; any failure removes the
temporary folder and raises `DeltaError` naming the problem. The result is then verified like any
full checkpoint (the manifest copied in is the delta's own, signature and all).

`recycle`: a stale rebuilt directory (one retention may delete: daemon.pipeline.deltas) whose files
the rebuild overwrites in place. Writing 16 GB into fresh files (block allocation, new page-cache
pages) is the slow part of a rebuild; overwriting cached files of the same size is several times
faster. The directory is renamed to the temporary folder in one step (so it is never left
half-present under its own name), every file of it that is not a rebuilt file of the same path and
size is deleted, and the rebuilt files are written over the rest, every byte (the hashes come from
the decoded chunks, never from what a file held before).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from daemon.bytepipe import Crcs, InOrder, Job, hash_files
from daemon.delta.codec import Chunk, DeltaError
from daemon.delta.container import ChunkBuffers, Lent, map_file, rebuild_file
from daemon.delta.section import DeltaFile, DeltaSpec
from daemon.formats import MANIFEST_NAME
from daemon.hashing import DigestMismatch, FileDigest
from daemon.manifest import Manifest, ManifestFile


@dataclass(frozen=True, slots=True)
class Rebuilt:
    directory: Path
    delta_bytes: int  # the delta files read (what a host fetches)
    result_bytes: int
    base_bytes: int  # base bytes the result was made from (read; re-hashed only where copied unchanged)
    recycled_bytes: int | None = None  # bytes written over `recycle`'s files; None: no directory was taken


class _InMemory:
    """The rebuilt files' digests from the decoded chunks, in the decoding threads."""

    def __init__(self, files: list[Path], alg: str, threads: int) -> None:
        self.alg = alg
        self.crcs = Crcs()
        self.strong = InOrder(files, alg, threads=threads)

    def taker(self, target: Path) -> Callable[[Chunk, np.ndarray, Lent], None]:
        def take(c: Chunk, data: np.ndarray, lent: Lent) -> None:
            if c.length:  # an empty chunk adds nothing (and would share its offset with the next)
                view = data.data  # uint8, contiguous: a byte view
                self.crcs.feed(target, c.out, view)
                self.strong.take(Job(target, c.out, c.length), view, lent, 0)  # parked: the buffer held

        return take

    def digest(self, target: Path, size: int) -> FileDigest:
        try:
            return FileDigest(size, self.crcs.result(target, size), self.alg, self.strong.hexdigest(target))
        except ValueError as exc:  # chunks that do not tile the file
            raise DeltaError(str(exc)) from None


def _check(digest: FileDigest, expected: ManifestFile, what: str) -> None:
    try:
        digest.check(expected, what)
    except DigestMismatch as exc:
        raise DeltaError(str(exc)) from None


def rebuild_delta(
    delta_dir: Path,
    manifest: Manifest,
    spec: DeltaSpec,
    base_dir: Path,
    base_files: Mapping[str, ManifestFile],
    out_dir: Path,
    *,
    threads: int | None = None,
    recycle: Path | None = None,
) -> Rebuilt:
    """Write the full version into `out_dir` (replacing an earlier rebuild of it), over `recycle`'s
    files of the same path and size when given (that directory is gone afterwards); raises DeltaError."""
    n = max(1, threads or os.cpu_count() or 1)
    for df in spec.files:
        if not (delta_dir / df.path).is_file():
            raise DeltaError(f"delta file {df.path} is missing from {delta_dir}")
    digests = hash_files([delta_dir / df.path for df in spec.files], alg=manifest.hash_alg or "blake3", threads=n)
    for digest, df in zip(digests, spec.files, strict=True):
        _check(digest, df.file, f"delta file {df.path}")
    by_target = {f.target: f for f in spec.files}
    needed = sorted({f.path for f in manifest.files if f.path in base_files})
    for rel in needed:
        if not (base_dir / rel).is_file():
            raise DeltaError(f"base file {rel} is missing from this host's copy ({base_dir})")
    for f in manifest.files:
        if f.path not in by_target:
            if f.path not in base_files:
                raise DeltaError(f"{f.path}: no delta file and no base file of that path: the delta is incomplete")
            b = base_files[f.path]
            if (b.bytes, b.hash) != (f.bytes, f.hash):
                raise DeltaError(f"{f.path}: no delta file, but the base's file differs from the one listed")
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    alg = manifest.hash_alg or "blake3"
    rebuilt = [(f, by_target[f.path]) for f in manifest.files if f.path in by_target]
    # the files at once (each its own writer: buffered writes to one file serialize on its inode),
    # their chunks on one pool of decoding threads; BLAKE3 splits each in-order update
    in_memory = _InMemory([tmp / f.path for f, _d in rebuilt], alg, max(1, n // max(1, len(rebuilt))))
    shutil.rmtree(tmp, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    recycled = _recycle(recycle, tmp, {f.path: f.bytes for f, _d in rebuilt}) if recycle is not None else None
    if recycled is None:
        tmp.mkdir()
    try:
        with ThreadPoolExecutor(n, thread_name_prefix="delta-dec") as pool, \
                ThreadPoolExecutor(1, thread_name_prefix="delta-base") as hasher, \
                ThreadPoolExecutor(max(1, len(rebuilt)), thread_name_prefix="delta-file") as files:  # fmt: skip
            copied = [r for r in needed if r not in by_target]  # the rebuilt ones are proven by their result
            base_hashes = hasher.submit(_base_digests, base_dir, copied, base_files, alg, n)
            maps: dict[str, np.ndarray] = {r: map_file(base_dir / r) for r in needed}
            buffers = ChunkBuffers()  # shared by the files: about the chunks being decoded, not one per chunk
            for f in manifest.files:
                (tmp / f.path).parent.mkdir(parents=True, exist_ok=True)
                if f.path not in by_target:  # unchanged: the base's file (re-hashed below)
                    shutil.copyfile(base_dir / f.path, tmp / f.path)

            def one(f: ManifestFile, d: DeltaFile) -> int:
                target = tmp / f.path
                size = rebuild_file(delta_dir / d.path, maps.get(f.path), target, pool, d.path,
                                    on_chunk=in_memory.taker(target), window=2 * n, buffers=buffers)  # fmt: skip
                try:
                    _check(in_memory.digest(target, size), f, f"result file {f.path} (rebuilt from {d.path})")
                except DeltaError:
                    if f.path in base_files:  # say so when it is the base that changed, not the delta
                        _check_bases(_base_digests(base_dir, [f.path], base_files, alg, n))
                    raise
                return size

            jobs = [files.submit(one, f, d) for f, d in rebuilt]
            try:
                result = sum(j.result() for j in jobs) + sum(f.bytes for f in manifest.files if f.path not in by_target)
            except BaseException:
                in_memory.strong.abort()
                raise
            _check_bases(base_hashes.result())
        shutil.copyfile(delta_dir / MANIFEST_NAME, tmp / MANIFEST_NAME)
        _replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Rebuilt(out_dir, spec.delta_bytes, result, sum(base_files[r].bytes for r in needed), recycled)


def _base_digests(base_dir: Path, rels: list[str], base_files: Mapping[str, ManifestFile], alg: str,
                  threads: int) -> list[tuple[str, FileDigest, ManifestFile]]:  # fmt: skip
    """Each base file's digest now, beside what it was verified with. A base verified with a strong
    hash is re-hashed with it alone: equal bytes hash equal, so its CRC32C adds no proof (a base
    listed with a CRC alone keeps its CRC check)."""
    strong_only = all(base_files[r].hash and base_files[r].hash_alg == alg for r in rels)
    digests = hash_files([base_dir / r for r in rels], alg=alg, crc=not strong_only, threads=threads)
    return [(r, d, replace(base_files[r], crc32c="") if strong_only else base_files[r])
            for r, d in zip(rels, digests, strict=True)]  # fmt: skip


def _check_bases(digests: list[tuple[str, FileDigest, ManifestFile]]) -> None:
    for rel, digest, want in digests:
        _check(digest, want, f"base file {rel} (changed on this host since it was verified)")


def _recycle(stale: Path, tmp: Path, want: Mapping[str, int]) -> int | None:
    """`stale` renamed to `tmp` (one step: it is never half-present under its own name), keeping only
    the regular, unshared files of a path and size in `want`; the bytes kept, or None when it could
    not be taken (gone: retention or another rebuild took it first; then nothing was changed)."""
    if stale.is_symlink():  # its files are another directory's
        return None
    try:
        os.rename(stale, tmp)
    except OSError:
        return None
    kept = 0
    try:
        for root, dirs, names in os.walk(tmp, topdown=False):
            for name in names:
                path = Path(root, name)
                size = reusable_size(path)
                if size >= 0 and want.get(path.relative_to(tmp).as_posix()) == size:
                    kept += size
                else:
                    path.unlink()
            for name in dirs:
                d = Path(root, name)
                if d.is_symlink():
                    d.unlink()
                elif not any(d.iterdir()):
                    d.rmdir()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return kept


def reusable_size(path: Path) -> int:
    """The size of a file a rebuild may overwrite in place: a regular file no other name links to
    (a link shared with another file, a base's say, would be overwritten under it); else -1."""
    try:
        st = os.lstat(path)
    except OSError:
        return -1
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else -1


def _replace(tmp: Path, out_dir: Path) -> None:
    """Rename `tmp` to `out_dir`; an older `out_dir` is moved aside first and removed after."""
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(out_dir.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
