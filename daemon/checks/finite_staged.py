"""The finite scan on the staged copy: the same raw-bits rule as daemon.checks.finite, in torch.

Runs where the copy is (a GPU scans 16 GB in milliseconds; CI runs the same code on a CPU
tensor). Each floating tensor is viewed as signed integers of its width (same bits, and every
mask here is positive, so no unsigned types are needed) and tested in bounded slices; the
per-tensor counts stay on the device until one synchronisation at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from daemon.checks.staged import StagedTensors, typed
from daemon.formats.checkpoint import TensorLocation

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


def _special(w: torch.Tensor, bits: _Bits) -> tuple[torch.Tensor, torch.Tensor]:
    """(special, nan) masks of one slice of words."""
    if bits.nan_only:
        full = bits.exponent | bits.mantissa
        special = (w & full) == full
        return special, special
    special = (w & bits.exponent) == bits.exponent
    return special, special & ((w & bits.mantissa) != 0)


def scan_staged(
    copy: StagedTensors, floating: list[tuple[str, TensorLocation]], root: Path
) -> list[StagedBad]:
    """Every tensor in `floating` (dtype in FLOAT_BITS) that holds a NaN or Inf, with counts."""
    if not floating:
        return []
    device = copy.torch_device
    counts = torch.zeros((len(floating), 2), dtype=torch.int64, device=device)  # specials, nans
    with torch.inference_mode():
        for i, (name, loc) in enumerate(floating):
            bits = FLOAT_BITS[loc.entry.dtype]
            w = _words(copy, name, loc, root, bits)
            for s in range(0, w.numel(), SLICE_ELEMENTS):
                special, nan = _special(w[s : s + SLICE_ELEMENTS], bits)
                counts[i, 0] += special.sum()
                counts[i, 1] += nan.sum()
        host = counts.cpu().tolist()
    bad: list[StagedBad] = []
    for (name, loc), (n_special, n_nan) in zip(floating, host, strict=True):
        if not n_special:
            continue
        bits = FLOAT_BITS[loc.entry.dtype]
        w = _words(copy, name, loc, root, bits)
        first = int(_special(w, bits)[0].nonzero()[0, 0])  # only for the few bad tensors
        bad.append(StagedBad(name, loc.file.name, int(n_nan), int(n_special - n_nan), first))
    return bad
