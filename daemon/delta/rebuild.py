"""The host side: a delta checkpoint + this host's verified copy of its base -> a full version directory.

    rebuild(delta_dir, manifest, spec, base_dir, base_files, out_dir)

Every delta file is hashed against the signed `delta` section before it is used. Each base file
the result needs is re-hashed (CRC32C + the strong hash, in a thread beside the decoding) against
the digests the base was verified with; a base changed on disk since is refused. The result is
assembled in a hidden temporary folder beside `out_dir` and renamed into place only when
everything held, so `out_dir` is either whole or absent; any failure removes the temporary
folder and raises `DeltaError` naming the problem. The result is then verified like any full
checkpoint (the manifest copied in is the delta's own, signature and all).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from daemon.bytepipe.files import hash_files
from daemon.delta.codec import DeltaError
from daemon.delta.container import map_file, rebuild_file
from daemon.delta.section import DeltaSpec
from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.hashing import DigestMismatch, FileDigest
from daemon.manifest import Manifest, ManifestFile


@dataclass(frozen=True, slots=True)
class Rebuilt:
    directory: Path
    delta_bytes: int  # the delta files read (what a host fetches)
    result_bytes: int
    base_bytes: int  # base bytes re-hashed


def _check(digest: FileDigest, expected: ManifestFile, what: str) -> None:
    try:
        digest.check(expected, what)
    except DigestMismatch as exc:
        raise DeltaError(str(exc)) from None


def rebuild(
    delta_dir: Path,
    manifest: Manifest,
    spec: DeltaSpec,
    base_dir: Path,
    base_files: Mapping[str, ManifestFile],
    out_dir: Path,
    *,
    threads: int | None = None,
) -> Rebuilt:
    """Write the full version into `out_dir` (replacing an earlier rebuild of it); raises DeltaError."""
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
    shutil.rmtree(tmp, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        with ThreadPoolExecutor(n, thread_name_prefix="delta-dec") as pool, \
                ThreadPoolExecutor(1, thread_name_prefix="delta-base") as hasher:  # fmt: skip
            base_hashes = hasher.submit(hash_files, [base_dir / r for r in needed],
                                        alg=manifest.hash_alg or "blake3", threads=n)  # fmt: skip
            maps: dict[str, np.ndarray] = {r: map_file(base_dir / r) for r in needed}
            result = 0
            for f in manifest.files:
                target = tmp / f.path
                target.parent.mkdir(parents=True, exist_ok=True)
                d = by_target.get(f.path)
                if d is None:  # unchanged: the base's file (re-hashed below)
                    shutil.copyfile(base_dir / f.path, target)
                    result += f.bytes
                    continue
                result += rebuild_file(delta_dir / d.path, maps.get(f.path), target, pool, f"{d.path}")
            for rel, digest in zip(needed, base_hashes.result(), strict=True):
                _check(digest, base_files[rel], f"base file {rel} (changed on this host since it was verified)")
        shutil.copyfile(delta_dir / MANIFEST_NAME, tmp / MANIFEST_NAME)
        _replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Rebuilt(out_dir, spec.delta_bytes, result, sum(base_files[r].bytes for r in needed))


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
