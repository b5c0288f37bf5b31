"""Check "crc32c": hash every file in parallel and compare with the manifest."""

from __future__ import annotations

import time
from typing import Any

from daemon.checks.base import CheckContext, CheckFailed
from daemon.crc import crc32c_files
from daemon.manifest import ManifestFile, digest


def check_crc32c(ctx: CheckContext) -> dict[str, Any]:
    root = ctx.directory
    files = ctx.files
    t0 = time.perf_counter()
    try:
        crcs = crc32c_files(
            [root / f.path for f in files],
            threads=ctx.settings.crc_threads,
            chunk=ctx.settings.crc_chunk_bytes,
        )
    except OSError as exc:
        raise CheckFailed(f"reading for crc32c failed: {exc}") from None
    seconds = time.perf_counter() - t0
    nbytes = sum(f.bytes for f in files)
    detail: dict[str, Any] = {
        "files": len(files),
        "bytes": nbytes,
        "seconds": round(seconds, 4),
        "gb_per_s": round(nbytes / seconds / 1e9, 3) if seconds > 0 else None,
    }
    if ctx.crcs_known:
        bad = [(f, c) for f, c in zip(files, crcs, strict=True) if f.crc32c != c]
        if bad:
            f, c = bad[0]
            raise CheckFailed(
                f"{f.path}: crc32c {c} does not match the manifest's {f.crc32c} (file corrupted)"
                + (f"; {len(bad) - 1} more files differ" if len(bad) > 1 else ""),
                {
                    "file": f.path,
                    "crc32c": c,
                    "expected": f.crc32c,
                    "mismatched": [b.path for b, _ in bad][:20],
                },
            )
    else:
        ctx.files = [ManifestFile(f.path, f.bytes, c) for f, c in zip(files, crcs, strict=True)]
        ctx.crcs_known = True
        ctx.digest = digest(ctx.files)
    detail["digest"] = ctx.digest
    return detail
