"""Check "finite": no NaN or Inf in any floating tensor, read by header offsets in bounded chunks.

When the crc32c check staged the checkpoint (daemon.bytepipe.staged), the scan runs on that copy
on its device (daemon.checks.finite_staged) and reads nothing again. Otherwise, from the files:
it works on the raw bits (an all-ones exponent field means Inf or NaN), so bf16 and fp8
need no float conversion and numpy is enough. Threads share the work; numpy releases
the GIL on large arrays.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from daemon.bytepipe import StagedTensors
from daemon.checks.base import CheckContext, CheckFailed
from daemon.checks.finite_staged import FLOAT_BITS as STAGED_BITS
from daemon.checks.finite_staged import scan_staged
from daemon.checks.headers import load_table
from daemon.formats import TensorLocation


@dataclass(frozen=True, slots=True)
class _Bits:
    word: type  # numpy unsigned int type of one element
    exponent: int  # mask of the exponent field
    mantissa: int  # mask of the mantissa field
    nan_only: bool = False  # float8_e4m3fn: no Inf, NaN is exponent and mantissa all ones


# The masks are finite_staged's (one table); the file scan reads the words as numpy unsigned ints.
_NUMPY_WORD = {torch.int64: np.uint64, torch.int32: np.uint32, torch.int16: np.uint16, torch.uint8: np.uint8}
_FLOAT_BITS: dict[str, _Bits] = {
    name: _Bits(_NUMPY_WORD[b.word], b.exponent, b.mantissa, b.nan_only) for name, b in STAGED_BITS.items()
}


@dataclass(frozen=True, slots=True)
class _Bad:
    tensor: str
    file: str
    nan: int
    inf: int
    first_index: int


def _scan(name: str, loc: TensorLocation, chunk: int) -> _Bad | None:
    bits = _FLOAT_BITS[loc.entry.dtype]
    itemsize = np.dtype(bits.word).itemsize
    step = max(itemsize, chunk - chunk % itemsize)
    nan = inf = 0
    first = -1
    fd = os.open(loc.file, os.O_RDONLY)
    try:
        buf = bytearray(min(step, max(loc.entry.nbytes, 1)))
        pos, end, element = loc.entry.start, loc.entry.end, 0
        while pos < end:
            want = min(len(buf), end - pos)
            got = os.preadv(fd, [memoryview(buf)[:want]], pos)
            if got != want:
                raise OSError(f"{loc.file}: short read in tensor {name!r} at byte {pos}")
            words: Any = np.frombuffer(buf, dtype=bits.word, count=want // itemsize)
            if bits.nan_only:
                special = (words & (bits.exponent | bits.mantissa)) == (bits.exponent | bits.mantissa)
            else:
                special = (words & bits.exponent) == bits.exponent
            if special.any():
                hits = np.flatnonzero(special)
                is_nan = (words[hits] & bits.mantissa) != 0
                nan += int(is_nan.sum())
                inf += int(hits.size - is_nan.sum())
                if first < 0:
                    first = element + int(hits[0])
            pos += want
            element += want // itemsize
    finally:
        os.close(fd)
    if nan or inf:
        return _Bad(name, loc.file.name, nan, inf, first)
    return None


def check_finite(ctx: CheckContext) -> dict[str, Any]:
    table = load_table(ctx)
    fallback = "files"
    floating = sorted(
        ((n, loc) for n, loc in table.items() if loc.entry.dtype in _FLOAT_BITS),
        key=lambda item: -item[1].entry.nbytes,
    )
    staged = ctx.staged if isinstance(ctx.staged, StagedTensors) else None
    found: list[_Bad] = []
    if staged is not None:
        try:
            found = [_Bad(b.tensor, b.file, b.nan, b.inf, b.first_index)
                     for b in scan_staged(staged, floating, ctx.directory)]  # fmt: skip
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
            fallback = f"files (the staged scan failed: {type(exc).__name__}: {str(exc)[:160]})"
            staged = None
    if staged is None:
        chunk = ctx.settings.finite_chunk_bytes
        threads = max(1, min(ctx.settings.crc_threads or os.cpu_count() or 1, len(floating) or 1))
        with ThreadPoolExecutor(threads, thread_name_prefix="finite") as pool:
            found = [b for b in pool.map(lambda item: _scan(item[0], item[1], chunk), floating) if b]
    scanned_bytes = sum(loc.entry.nbytes for _, loc in floating)
    if found:
        found.sort(key=lambda b: b.tensor)
        b = found[0]
        raise CheckFailed(
            f"tensor {b.tensor!r} in {b.file} has {b.nan} NaN and {b.inf} Inf values "
            f"(first at element {b.first_index})"
            + (f"; {len(found) - 1} more tensors are not finite" if len(found) > 1 else ""),
            {
                "tensor": b.tensor,
                "file": b.file,
                "nan": b.nan,
                "inf": b.inf,
                "bad_tensors": [x.tensor for x in found][:20],
            },
        )
    where = f"staged copy on {staged.device}" if staged is not None else fallback
    return {"tensors_scanned": len(floating), "bytes_scanned": scanned_bytes, "scanned": where}
