"""A version read, checked and held on the parameters' device before the pause (disk, copy mode).

`DiskTransport.stage(params)` (called by the worker's `prepare`, while it still serves) reads the
checkpoint into an `Ahead` buffer instead of the live parameters: the same reader threads, the
same check while loading, so the buffer holds exactly the bytes that matched the registry's
digests. Inside the pause `write_into` is then one device-to-device copy of that buffer (a few
copies: `copyplan`, since the buffer mirrors the worker's flat weight buffer), whatever happens
to the files meanwhile. The buffer is freed when the transport closes (after resume).

On CUDA the buffer is a plain `cuMemAlloc` allocation (`daemon.handoff.cuda.DeviceBuffer`), outside torch's
caching allocator, so freeing it gives the memory back to the device at once; it is only made
when the device has room for it (`room_for`). On the CPU it is host memory (tests exercise the
whole path there).
"""

from __future__ import annotations

from typing import Any

import torch

from daemon.handoff import ALIGN, DeviceBuffer, layout_tensors
from daemon.transport.base import TORCH_TO_ST
from daemon.transport.copyplan import plan_copies, run_copies

MARGIN_BYTES = 2 << 30  # what must stay free on the device besides the buffer


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


def layout_like(params: dict[str, torch.Tensor], flat: torch.Tensor | None) -> tuple[dict[str, int], int]:
    """Byte offsets of every tensor in the buffer, and its size: the flat buffer's own offsets when
    every parameter lies in it (then a copy back is one run), else a fresh 256-byte-aligned layout."""
    if flat is not None:
        base, size = int(flat.data_ptr()), int(flat.numel())
        offsets = {n: int(p.data_ptr()) - base for n, p in params.items()}
        if all(off >= 0 and off + _nbytes(params[n]) <= size for n, off in offsets.items()):
            return offsets, size
    entries = [(n, TORCH_TO_ST[str(p.dtype).removeprefix("torch.")], tuple(p.shape)) for n, p in sorted(params.items())]
    slots, size = layout_tensors(entries)
    return {s.name: s.offset for s in slots}, max(size, ALIGN)


def room_for(device: torch.device, nbytes: int) -> str | None:
    """None when `device` can hold another `nbytes` (plus a margin), else why not."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    if free < nbytes + MARGIN_BYTES:
        return f"{free >> 20} MiB free on {device}, {(nbytes + MARGIN_BYTES) >> 20} MiB needed"
    return None


class Ahead:
    """The buffer and a view of it per tensor (same names, shapes and dtypes as `params`)."""

    def __init__(self, params: dict[str, torch.Tensor], flat: torch.Tensor | None) -> None:
        self.device = next(iter(params.values())).device
        self.offsets, self.nbytes = layout_like(params, flat)
        self._owner: Any = None
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self._owner = DeviceBuffer(index, self.nbytes)
            self.base: torch.Tensor | None = self._owner.tensor()
        else:
            self.base = torch.empty(self.nbytes, dtype=torch.uint8)
        views: dict[str, torch.Tensor] = {}
        for n, p in params.items():
            off = self.offsets[n]
            views[n] = self.base[off : off + _nbytes(p)].view(p.dtype).view(p.shape)
        self._views: dict[str, torch.Tensor] | None = views

    def views(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            raise RuntimeError("the staged copy was freed")
        return self._views

    def copy_into(self, params: dict[str, torch.Tensor], flat: torch.Tensor | None) -> int:
        """Every parameter from its view (in place); returns how many copies it took."""
        views = self.views()
        pairs = [(p.data, views[n]) for n, p in params.items()]
        with torch.no_grad():
            plan = plan_copies(pairs, flat, self.base)
            run_copies(plan, flat, self.base)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return plan.copies

    def free(self) -> None:
        self._views = None
        self.base = None
        if self._owner is not None:
            owner, self._owner = self._owner, None
            owner.free()
