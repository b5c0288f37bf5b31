"""The GPU apply micro for bench/delta.py (issue 38): a delta applied to a base already on the GPU.

The base's files sit on the device (staged, as the loader holds a serving version). Applying a
delta there is a device copy of the base plus either a scatter of the changed elements (uploaded
as flat indices + new values) or, for dense deltas, an upload of the XOR bytes and an in-place
XOR. Timed: copy + upload + scatter/XOR, synchronised. Not timed: decoding the delta on the host
(the changed positions are found here by comparing base and result). This measures the device
side of the path only; the loader does not build results on the GPU yet.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

DENSE = 0.2  # above this share of changed elements, upload XOR bytes instead of indices + values


def _host_side(base: Path, result: Path) -> tuple[np.ndarray, Any, bool, int]:
    """(the base's bytes, the payload, dense?, changed elements): decoding stands in, not timed."""
    old = np.fromfile(base, dtype=np.uint8)
    new = np.fromfile(result, dtype=np.uint8)
    if old.size != new.size or old.size % 2:
        raise ValueError(f"{base.name}: sizes differ or are odd ({old.size}, {new.size})")
    o16, n16 = old.view(np.uint16), new.view(np.uint16)
    diff = np.flatnonzero(o16 != n16)
    dense = diff.size > DENSE * o16.size
    return old, ((o16 ^ n16) if dense else (diff, n16[diff])), dense, int(diff.size)


def gpu_apply(base_dir: Path, result_dir: Path, device: str) -> dict[str, Any]:
    dev = torch.device(device)
    total_ms, changed, dense_files = 0.0, 0, 0
    equal = True
    files = sorted(base_dir.glob("*.safetensors"))
    with ThreadPoolExecutor(len(files) or 1) as pool:
        prepared = list(pool.map(lambda f: _host_side(f, result_dir / f.name), files))
    for f, (old, payload, dense, n) in zip(files, prepared, strict=True):
        staged = torch.from_numpy(old).to(dev)  # the base as the loader holds it
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = staged.clone()  # the serving copy stays untouched until the result is checked
        out16 = out.view(torch.int16)
        if dense:
            out16.bitwise_xor_(torch.from_numpy(payload.view(np.int16)).to(dev))
        else:
            idx, vals = payload
            out16[torch.from_numpy(idx).to(dev)] = torch.from_numpy(vals.view(np.int16)).to(dev)
        torch.cuda.synchronize(dev)
        total_ms += (time.perf_counter() - t0) * 1e3
        equal = equal and bool(torch.equal(out.cpu(), torch.from_numpy(np.fromfile(result_dir / f.name, np.uint8))))
        changed += n
        dense_files += int(dense)
        del staged, out, out16
        torch.cuda.empty_cache()
    return {"apply_ms": round(total_ms, 1), "changed_elements": changed, "dense_files": dense_files,
            "equal": equal, "device": device}  # fmt: skip
