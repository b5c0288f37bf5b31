"""Fewer, larger copies: coalesce per-tensor copies between two flat buffers (ipc copy mode).

A staged version is one flat buffer (the loader's), and the reference worker keeps its weights
in one flat buffer too (`daemon.worker.flat`), both laid out by `layout_tensors` in checkpoint
order. Then most tensors sit at the same distance from each other in source and destination,
and the whole version moves in one or a few large copies instead of one per tensor (291 for
the 8B layout), which is what keeps a copy near the device's memory bandwidth (issue 15).

`plan_copies(pairs, dst_base, src_base)` walks the destinations in address order and joins a
tensor to the run before it when

* both lie inside the flat bases (`dst_base`, `src_base`: 1-D uint8 tensors), and
* its source offset minus its destination offset equals the run's (same relative layout), its
  source starts at or after the run's source end, and no other destination lies in between.

A run's copy also covers the gaps between its tensors: in the destination those bytes belong to
no tensor (alignment padding of the worker's own buffer: nothing is between two neighbours in
address order), in the source they are read only. Everything else is copied tensor by tensor.
The result is bit for bit what one `copy_` per tensor gives (tests/transport/test_copyplan.py).

`checksum` is what the ipc copy compares after the copy (issue 41): the source's is taken before
the pause, the destination's inside it; `parameter_places` says whether a plan made before the
pause still fits the parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class Run:
    """`nbytes` bytes from `src_base[src:]` to `dst_base[dst:]`, covering `tensors` tensors."""

    dst: int
    src: int
    nbytes: int
    tensors: int


@dataclass(slots=True)
class CopyPlan:
    runs: list[Run]
    singles: list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source) copied one by one

    @property
    def copies(self) -> int:
        return len(self.runs) + len(self.singles)


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


def _offset_in(t: torch.Tensor, base: torch.Tensor | None) -> int | None:
    """Byte offset of contiguous `t` inside 1-D uint8 `base` (same device), or None."""
    if base is None or t.device != base.device or not t.is_contiguous():
        return None
    off = int(t.data_ptr() - base.data_ptr())
    if off < 0 or off + _nbytes(t) > base.numel():
        return None
    return off


def plan_copies(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], dst_base: torch.Tensor | None, src_base: torch.Tensor | None
) -> CopyPlan:
    """The copies that move every `(dst, src)` pair (same shape and dtype each); see the module doc."""
    placed: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []  # (dst_off, src_off, nbytes, d, s)
    singles: list[tuple[torch.Tensor, torch.Tensor]] = []
    for d, s in pairs:
        d_off, s_off = _offset_in(d, dst_base), _offset_in(s, src_base)
        if d_off is None or s_off is None or _nbytes(d) != _nbytes(s):
            singles.append((d, s))
        else:
            placed.append((d_off, s_off, _nbytes(d), d, s))
    placed.sort(key=lambda x: x[0])
    if _overlapping(placed):
        # two destinations share bytes (aliased parameters): keep the per-tensor order exactly
        return CopyPlan([], list(pairs))
    runs: list[Run] = []
    start: tuple[int, int] | None = None  # (dst, src) of the open run
    dst_end = src_end = count = 0
    for d_off, s_off, n, _d, _s in placed:
        joins = (
            start is not None
            and s_off - d_off == start[1] - start[0]
            and s_off >= src_end
        )
        if not joins:
            if start is not None:
                runs.append(Run(start[0], start[1], dst_end - start[0], count))
            start, count = (d_off, s_off), 0
        dst_end, src_end, count = d_off + n, s_off + n, count + 1
    if start is not None:
        runs.append(Run(start[0], start[1], dst_end - start[0], count))
    return CopyPlan(runs, singles)


def _overlapping(placed: list[tuple[int, int, int, torch.Tensor, torch.Tensor]]) -> bool:
    end = -1
    for d_off, _s, n, _d, _t in placed:
        if d_off < end:
            return True
        end = max(end, d_off + n)
    return False


def run_copies(plan: CopyPlan, dst_base: torch.Tensor | None, src_base: torch.Tensor | None) -> None:
    """Issue the plan's copies (asynchronous on CUDA: the caller synchronizes)."""
    if plan.runs:
        assert dst_base is not None and src_base is not None
        for r in plan.runs:
            dst_base[r.dst : r.dst + r.nbytes].copy_(src_base[r.src : r.src + r.nbytes])
    for d, s in plan.singles:
        d.copy_(s)


def parameter_places(params: Mapping[str, torch.Tensor]) -> tuple[tuple[str, int], ...]:
    """Where each parameter's storage is: a prepared copy plan holds while this is unchanged."""
    return tuple((n, p.data_ptr()) for n, p in params.items())


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def checksum(segments: list[torch.Tensor], words: list[bool], unit: int) -> torch.Tensor | int:
    """A checksum of `segments` (uint8 views): the same bytes give the same value, and a copy that
    skipped, truncated or misplaced a run does not, short of a coincidence. On a GPU the wrapping
    sum of 8-byte words (int64, on the device, no synchronisation: one reduction kernel per segment;
    int64 in, int64 out, so it runs at memory speed: summing 4-byte words into int64 measured 21 ms
    for 8B on an H200, inside the pause); on a CPU the XOR of 8-byte words with numpy (torch's CPU
    byte sums run at a fraction of memory speed). `words[i]` False: segment i is read byte by byte."""
    if segments[0].device.type == "cpu":
        x = 0
        for seg, w in zip(segments, words, strict=True):
            a = seg.numpy()
            x ^= int(np.bitwise_xor.reduce(a.view(np.uint64) if w else a)) if a.size else 0
        return x
    return torch.stack([seg.view(torch.int64).sum() if w else seg.sum(dtype=torch.int64)
                        for seg, w in zip(segments, words, strict=True)]).sum()  # fmt: skip
