"""The served weights in one flat buffer, laid out as the staging loader lays out a version.

`pack_flat(params, order)` allocates one uint8 buffer on the parameters' device, lays the
tensors out with `layout_tensors` (checkpoint order: by file, then offset; each at a 256-byte
boundary, exactly as the loader stages a version) and points every parameter's `.data` at its
view, copying the current values in. Afterwards an ipc copy update between the loader's buffer
and this one is one or a few large copies (`daemon.transport.copyplan`) instead of one per
tensor; disk updates, swap mode and the engine see ordinary contiguous parameters.

Packing needs the buffer and the old storage at once, briefly (the old one is freed as each
tensor moves, and the CUDA cache is emptied at the end).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from daemon.formats import tensor_table
from daemon.handoff import ALIGN, layout_tensors
from daemon.transport import TORCH_TO_ST


def checkpoint_order(directory: str) -> list[str]:
    """Tensor names in the order the loader stages them: by file, then by offset in it."""
    table, _ = tensor_table(directory)
    return [loc.entry.name for loc in sorted(table.values(), key=lambda loc: (str(loc.file), loc.entry.start))]


def room_to_pack(params: dict[str, torch.Tensor], margin: int = 1 << 30) -> str | None:
    """None when the parameters' device can hold a second copy of them for a moment, else why not
    (then the worker keeps its weights where they are: packing must never make a start fail)."""
    device = next(iter(params.values())).device
    if device.type != "cuda":
        return None
    need = sum(t.numel() * t.element_size() for t in params.values()) + margin
    free, _total = torch.cuda.mem_get_info(device)
    return None if free >= need else f"{free >> 20} MiB free on {device}, {need >> 20} MiB needed to pack"


def pack_flat(params: dict[str, torch.Tensor], order: Sequence[str] = ()) -> torch.Tensor:
    """Move every parameter into one flat buffer (names in `order` first, then the rest by
    name); returns the buffer (1-D uint8). Values are kept; data_ptrs change once, here."""
    if not params:
        raise ValueError("no parameters to pack")
    names = [n for n in order if n in params] + sorted(n for n in params if n not in set(order))
    devices = {params[n].device for n in names}
    if len(devices) != 1:
        raise ValueError(f"parameters on several devices {sorted(map(str, devices))}: cannot pack")
    entries = []
    for n in names:
        dtype = TORCH_TO_ST.get(str(params[n].dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"tensor {n!r}: dtype {params[n].dtype} has no safetensors name")
        entries.append((n, dtype, tuple(params[n].shape)))
    slots, size = layout_tensors(entries)
    device = devices.pop()
    flat = torch.empty(max(size, ALIGN), dtype=torch.uint8, device=device)
    with torch.no_grad():
        for slot in slots:
            p = params[slot.name]
            view = flat[slot.offset : slot.offset + slot.nbytes].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the old per-tensor storage
    return flat
