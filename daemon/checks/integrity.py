"""Check "crc32c": hash every file once (CRC32C and the strong hash), in parallel; compare with the manifest.

Format 2: both CRC32C and the strong hash must match; the strong hash is what decides
(a CRC-preserving edit is named as such). Format 1: the CRCs must match and the strong
hashes are computed with `checks.hash_alg`. No manifest: both are computed. In every
case the hashes computed here, never the manifest's claims, become the report's files
and content digest (the reference for duplicate detection and for transports).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from daemon.bytepipe import hash_files, stage_files
from daemon.checks.base import CheckContext, CheckFailed
from daemon.formats import LayoutError, weight_files
from daemon.hashing import FileDigest, content_digest
from daemon.manifest import ManifestFile


def check_crc32c(ctx: CheckContext) -> dict[str, Any]:
    if ctx.file_list_from is None:
        raise CheckFailed("no file list to hash: the manifest check did not run")
    root = ctx.directory
    files = ctx.files
    manifest = ctx.manifest
    recorded = ctx.recorded
    recorded_alg = next((r.hash_alg for r in recorded or [] if r.hash and r.hash_alg), None)
    if manifest is not None and not manifest.weak:
        alg = manifest.hash_alg
    else:
        alg = recorded_alg or ctx.settings.hash_alg
    assert alg is not None
    if recorded is not None:
        _same_file_list(files, recorded)
    t0 = time.perf_counter()
    staged_note, digests = _hash(ctx, root, files, alg)
    seconds = time.perf_counter() - t0
    nbytes = sum(d.bytes for d in digests)
    detail: dict[str, Any] = {
        "files": len(files),
        "bytes": nbytes,
        "hash_alg": alg,
        "seconds": round(seconds, 4),
        "gb_per_s": round(nbytes / seconds / 1e9, 3) if seconds > 0 else None,
        "staged": staged_note,
    }
    for f, d in zip(files, digests, strict=True):
        if d.bytes != f.bytes:
            raise CheckFailed(
                f"{f.path}: {d.bytes} bytes when hashed, {f.bytes} when listed (changed meanwhile)",
                {"file": f.path},
            )
    compared: list[str] = []
    if manifest is not None:
        _compare(manifest.files, digests, "the manifest's")
        compared.append("manifest: crc32c" if manifest.weak else f"manifest: crc32c and {alg}")
    if recorded is not None:
        by_path = {r.path: r for r in recorded}
        _compare([by_path[f.path] for f in files], digests, "the recorded")
        compared.append(f"recorded: crc32c{' and ' + alg if recorded_alg == alg else ''}")
    if compared:
        detail["compared"] = "; ".join(compared)
    else:
        detail["compared"] = f"nothing (no manifest): crc32c and {alg} computed and recorded as the reference"
    if manifest is not None and manifest.weak and recorded_alg != alg:
        detail["weak"] = "format 1: only CRC32C compared; the strong hashes were computed, not checked"
    ctx.files = [
        ManifestFile(f.path, d.bytes, d.crc32c, d.hash, alg) for f, d in zip(files, digests, strict=True)
    ]
    ctx.hashed = True
    ctx.digest = content_digest(ctx.files, alg)
    detail["digest"] = ctx.digest
    return detail


def _hash(ctx: CheckContext, root: Path, files: list[ManifestFile], alg: str) -> tuple[str, list[FileDigest]]:
    """Digests of every file from one read; when a later check uses it, that read also stages the
    bytes on the staging device (ctx.staged), hashed from the very buffer they were copied from."""
    settings = ctx.settings
    device = settings.staging_device
    if ctx.stager is not None:
        in_loader = _hash_in_loader(ctx, root, files, alg)
        if in_loader is not None:
            return in_loader
    if device is not None:
        try:
            digests, copy = stage_files(root, [f.path for f in files], device, alg=alg,
                                        threads=settings.crc_threads, chunk=settings.crc_chunk_bytes)  # fmt: skip
        except OSError as exc:
            raise CheckFailed(f"reading for crc32c failed: {exc}") from None
        except (RuntimeError, ValueError) as exc:  # no memory on the staging device, no such device
            note = f"not staged on {device} ({type(exc).__name__}: {str(exc)[:160]}); checks read the files"
        else:
            ctx.staged = copy
            return f"on {device} ({copy.nbytes} bytes, hashed as read)", digests
    else:
        note = "no (checks.stage_device off, or neither finite nor forward enabled)"
    try:
        return note, hash_files([root / f.path for f in files], alg=alg, threads=settings.crc_threads,
                                chunk=settings.crc_chunk_bytes)  # fmt: skip
    except OSError as exc:
        raise CheckFailed(f"reading for crc32c failed: {exc}") from None


def _hash_in_loader(
    ctx: CheckContext, root: Path, files: list[ManifestFile], alg: str
) -> tuple[str, list[FileDigest]] | None:
    """The weight files hashed and staged by the loader in one read, the rest hashed here; None
    when the loader cannot (then this process stages as usual)."""
    assert ctx.stager is not None
    try:
        weights = {w.relative_to(root).as_posix() for w in weight_files(root)}
    except LayoutError:
        return None
    rels = [f.path for f in files if f.path in weights]
    if not rels:
        return None
    try:
        got = ctx.stager.stage(root, rels, alg, on_mapped=ctx.premap)
    except OSError as exc:
        raise CheckFailed(f"reading for crc32c failed: {exc}") from None
    except (RuntimeError, ValueError) as exc:
        raise CheckFailed(f"staging in the loader for verify failed: {exc}") from None
    if got is None:
        return None
    digests, staged = got
    ctx.staged = staged
    by_path = dict(zip(rels, digests, strict=True))
    rest = [f.path for f in files if f.path not in by_path]
    try:
        others = hash_files([root / r for r in rest], alg=alg, threads=ctx.settings.crc_threads) if rest else []
    except OSError as exc:
        raise CheckFailed(f"reading for crc32c failed: {exc}") from None
    by_path.update(zip(rest, others, strict=True))
    ahead = "; its buffer opened here while the loader read" if getattr(staged, "opened_ahead", False) else ""
    note = f"in the loader on {staged.device} ({len(rels)} weight files, hashed as staged; {len(rest)} others here{ahead})"
    return note, [by_path[f.path] for f in files]


def _same_file_list(files: list[ManifestFile], recorded: list[ManifestFile]) -> None:
    now, then = {f.path for f in files}, {r.path for r in recorded}
    if now != then:
        diff = sorted(now ^ then)
        where = "new since" if diff[0] in now else "missing since"
        raise CheckFailed(
            f"{diff[0]}: {where} the recorded verify (file list changed)"
            + (f"; and {len(diff) - 1} more" if len(diff) > 1 else ""),
            {"file": diff[0], "changed": diff[:20]},
        )


def _compare(listed: list[ManifestFile], digests: list[FileDigest], whose: str = "the manifest's") -> None:
    for f, d in zip(listed, digests, strict=True):
        if f.bytes != d.bytes:
            raise CheckFailed(f"{f.path}: {d.bytes} bytes, {whose} {f.bytes}", {"file": f.path})
    crc_bad = [(f, d) for f, d in zip(listed, digests, strict=True) if f.crc32c and f.crc32c != d.crc32c]
    hash_bad = [
        (f, d)
        for f, d in zip(listed, digests, strict=True)
        if f.hash and (f.hash_alg or d.hash_alg) == d.hash_alg and f.hash != d.hash
    ]
    # a strong-hash mismatch with the CRC intact is the forgery case: name it first
    forged = [(f, d) for f, d in hash_bad if f.crc32c == d.crc32c]
    if forged:
        f, d = forged[0]
        raise CheckFailed(
            f"{f.path}: {d.hash_alg} does not match {whose} although its crc32c does "
            "(the file was altered so as to keep its CRC)"
            + (f"; {len(hash_bad) - 1} more files differ" if len(hash_bad) > 1 else ""),
            {
                "file": f.path,
                "hash_alg": d.hash_alg,
                "hash": d.hash,
                "expected": f.hash,
                "crc32c": d.crc32c,
                "mismatched": [b.path for b, _ in hash_bad][:20],
            },
        )
    if crc_bad:
        f, d = crc_bad[0]
        raise CheckFailed(
            f"{f.path}: crc32c {d.crc32c} does not match {whose} {f.crc32c} (file corrupted)"
            + (f"; {len(crc_bad) - 1} more files differ" if len(crc_bad) > 1 else ""),
            {
                "file": f.path,
                "crc32c": d.crc32c,
                "expected": f.crc32c,
                "mismatched": [b.path for b, _ in crc_bad][:20],
            },
        )
