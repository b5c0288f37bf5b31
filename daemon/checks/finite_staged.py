"""The finite scan on the staged copy: the same raw-bits rule as daemon.checks.finite, in torch.

Runs where the copy is: a GPU scans 16 GB in milliseconds with torch; a copy in host memory is
counted with numpy over the same bytes (faster there), and the tests run the torch engine on CPU
tensors too.

torch engine, in two passes (issue 41: the per-slice mask-and-count pass cost ~120 ms for 8B on
an H200, several temporaries per element): first one fused reduction per tensor, the sum of its
values accumulated in float32 (float64 for F64), read once at HBM speed with no temporaries, and
one synchronisation for all of them. A finite sum proves the tensor finite (NaN and Inf are
sticky under addition). Only tensors whose sum is not finite (a NaN or Inf, or finite values
whose sum overflowed) are counted exactly: viewed as signed integers of their width (same bits,
every mask positive) and tested in bounded slices, counts kept on the device until one more
synchronisation. float8 tensors (no sum kernel everywhere) go straight to the exact count.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from daemon.bytepipe import StagedTensors, typed
from daemon.formats import TensorLocation

SLICE_ELEMENTS = 1 << 26  # bounds the temporaries to ~64 M elements at a time


@dataclass(frozen=True, slots=True)
class _Bits:
    word: torch.dtype
    exponent: int
    mantissa: int
    nan_only: bool = False  # float8_e4m3fn: no Inf; NaN is exponent and mantissa all ones


FLOAT_BITS: dict[str, _Bits] = {
    "F64": _Bits(torch.int64, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "F32": _Bits(torch.int32, 0x7F800000, 0x007FFFFF),
    "F16": _Bits(torch.int16, 0x7C00, 0x03FF),
    "BF16": _Bits(torch.int16, 0x7F80, 0x007F),
    "F8_E5M2": _Bits(torch.uint8, 0x7C, 0x03),
    "F8_E4M3": _Bits(torch.uint8, 0x78, 0x07, nan_only=True),
}


@dataclass(frozen=True, slots=True)
class StagedBad:
    tensor: str
    file: str
    nan: int
    inf: int
    first_index: int


def _words(copy: StagedTensors, name: str, loc: TensorLocation, root: Path, bits: _Bits) -> torch.Tensor:
    return typed(copy.raw_tensor(name, loc, root), bits.word)


def _special(w: torch.Tensor, bits: _Bits) -> torch.Tensor:
    """Mask of the NaN/Inf words of one slice (NaN-only for float8_e4m3fn)."""
    full = bits.exponent | bits.mantissa if bits.nan_only else bits.exponent
    return (w & full) == full


def _nan(w: torch.Tensor, bits: _Bits) -> torch.Tensor:
    """Of the special words, the NaNs (mantissa not zero)."""
    return _special(w, bits) & ((w & bits.mantissa) != 0)


_NP_WORDS = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.uint8: np.uint8}


def _count_np(copy: StagedTensors, name: str, loc: TensorLocation, root: Path) -> int:
    """NaN/Inf words of one tensor of a copy in host memory, with numpy over the same bytes
    (torch's CPU bitwise kernels run ~10x slower than numpy's on these integer widths)."""
    bits = FLOAT_BITS[loc.entry.dtype]
    words = _words(copy, name, loc, root, bits).numpy().view(_NP_WORDS[bits.word])
    full = bits.exponent | bits.mantissa if bits.nan_only else bits.exponent
    mask = np.array(full, dtype=words.dtype)
    return sum(int(np.count_nonzero((words[s : s + SLICE_ELEMENTS] & mask) == mask))
               for s in range(0, words.size, SLICE_ELEMENTS))  # fmt: skip


def scan_staged(
    copy: StagedTensors, floating: list[tuple[str, TensorLocation]], root: Path, *, engine: str | None = None
) -> list[StagedBad]:
    """Every tensor in `floating` (dtype in FLOAT_BITS) that holds a NaN or Inf, with counts.

    `engine`: "torch" (the default on a GPU) or "numpy" (the default for a copy in host memory)
    for the counting pass; naming the bad tensors' NaN/Inf split and first index is torch's.
    """
    if not floating:
        return []
    device = copy.torch_device
    if (engine or ("torch" if device.type != "cpu" else "numpy")) == "numpy":
        with ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, len(floating))), thread_name_prefix="finite") as pool:
            host = list(pool.map(lambda item: _count_np(copy, item[0], item[1], root), floating))
        return _name_bad(copy, floating, host, root)
    with torch.inference_mode():
        suspects = _suspects(copy, floating, root)
        counts = torch.zeros(len(floating), dtype=torch.int64, device=device)  # NaN/Inf words per tensor
        for i, (name, loc) in enumerate(floating):
            if i not in suspects:
                continue
            bits = FLOAT_BITS[loc.entry.dtype]
            w = _words(copy, name, loc, root, bits)
            for s in range(0, w.numel(), SLICE_ELEMENTS):
                # count_nonzero: bool.sum() is ~20x slower on CPUs
                counts[i] += torch.count_nonzero(_special(w[s : s + SLICE_ELEMENTS], bits))
        host = counts.cpu().tolist() if suspects else [0] * len(floating)  # the second synchronisation
    return _name_bad(copy, floating, host, root)


_SUMMED = {"F64": (torch.float64, torch.float64), "F32": (torch.float32, torch.float32),
           "F16": (torch.float16, torch.float32), "BF16": (torch.bfloat16, torch.float32)}  # fmt: skip
SUMS_RUN = [0]  # tensors whose finiteness the fused pass settled (tests read it)


def _suspects(copy: StagedTensors, floating: list[tuple[str, TensorLocation]], root: Path) -> set[int]:
    """Indices of the tensors the fused pass cannot clear: an L1 norm that is not finite (a NaN or
    Inf gives one; so can finite values whose sum overflows, then counted exactly), or a dtype
    without a norm (float8). One `_foreach_norm` per dtype (fused kernels, not one reduction and
    one cast per tensor: ~900 launches for 8B) and one synchronisation."""
    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[int], list[torch.Tensor]]] = {}
    suspects: set[int] = set()
    for i, (name, loc) in enumerate(floating):
        kinds = _SUMMED.get(loc.entry.dtype)
        if kinds is None:
            suspects.add(i)
            continue
        at, views = groups.setdefault(kinds, ([], []))
        at.append(i)
        views.append(typed(copy.raw_tensor(name, loc, root), kinds[0]))
    summed = [i for at, _views in groups.values() for i in at]
    if summed:
        flags = [torch.isfinite(torch.stack(torch._foreach_norm(views, 1, dtype=acc)))
                 for (_t, acc), (_at, views) in groups.items()]  # fmt: skip
        finite = torch.cat(flags).cpu().tolist()  # the one synchronisation
        suspects.update(i for i, ok in zip(summed, finite, strict=True) if not ok)
        SUMS_RUN[0] += len(summed)
    return suspects


def _name_bad(
    copy: StagedTensors, floating: list[tuple[str, TensorLocation]], host: list[int], root: Path
) -> list[StagedBad]:
    with torch.inference_mode():
        bad: list[StagedBad] = []
        for (name, loc), n_special in zip(floating, host, strict=True):
            if not n_special:
                continue
            bits = FLOAT_BITS[loc.entry.dtype]  # only the few bad tensors: split NaN/Inf, first index
            w = _words(copy, name, loc, root, bits)
            n_nan = int(torch.count_nonzero(_nan(w, bits)))
            first = int(_special(w, bits).nonzero()[0, 0])
            bad.append(StagedBad(name, loc.file.name, n_nan, int(n_special) - n_nan, first))
    return bad
