"""Delta versions for bench/gpu_e2e.py (issue 38): commit -> both serving when only a delta moves.

`--delta-updates N --delta-density D`: after the full versions, N more versions each change a
share D of every bf16/fp16 tensor's elements (a random 1-3 ulp step, never a NaN or Inf) across
every shard of the previous full version. The new full files are written outside the watched
folder (the trainer's copy); `publish_delta` encodes them against the previous version (as
`hotswap publish --delta-from` does) into `<watch>/.stage-V`, which is renamed into the watched
folder: the commit. The daemon fetches only the delta, rebuilds the full version from its own
verified copy of the base, verifies the result and rolls it out like any version, so the same
commit -> both-serving clock and phase table apply.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.delta import ALWAYS_DELTA
from daemon.delta.build import publish_delta
from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.formats.safetensors import read_header

_HALF = ("BF16", "F16")


def _step_file(src: Path, dst: Path, seed: int, density: float) -> tuple[int, int]:
    """Copy `src` to `dst` with `density` of each half-precision tensor's elements stepped by 1-3
    ulp (the low mantissa bits flipped: the exponent, so finiteness, is kept). Returns (elements
    changed, elements)."""
    header = read_header(src)
    data = np.fromfile(src, dtype=np.uint8)
    rng = np.random.default_rng(seed)
    changed = total = 0
    for e in header.tensors:
        if e.dtype not in _HALF:
            continue
        view = data[e.start : e.end].view(np.uint16)
        total += view.size
        k = view.size if density >= 1 else int(round(density * view.size))
        if not k:
            continue
        if density >= 1:
            view ^= rng.integers(1, 4, view.size, dtype=np.uint16)
            changed += view.size
            continue
        if density >= 0.05:  # a mask: indices of a dense share would outweigh the tensor
            idx = np.flatnonzero(rng.integers(0, 1 << 16, view.size, dtype=np.uint16) < int(density * 65536))
        else:
            idx = np.unique(rng.integers(0, view.size, k))
        view[idx] ^= rng.integers(1, 4, idx.size, dtype=np.uint16)
        changed += int(idx.size)
    data.tofile(dst)
    return changed, total


def make_delta(prev_full: Path, trainer: Path, stage: Path, *, version: str, seed: int,
               density: float) -> tuple[Path, dict[str, Any]]:  # fmt: skip
    """The next full version in `trainer` (returned: the next delta's base) and its delta in `stage`."""
    new = trainer / version
    new.mkdir(parents=True)
    t = time.perf_counter()
    shards = sorted(p for p in prev_full.iterdir() if p.suffix == ".safetensors")
    for f in prev_full.iterdir():
        if f.suffix != ".safetensors" and f.name != MANIFEST_NAME and not f.name.startswith("."):
            shutil.copyfile(f, new / f.name)
    with ThreadPoolExecutor(len(shards) or 1) as pool:
        counts = list(pool.map(lambda i: _step_file(shards[i], new / shards[i].name, seed * 100 + i, density),
                               range(len(shards))))  # fmt: skip
    t_write = time.perf_counter() - t
    t = time.perf_counter()
    p = publish_delta(new, prev_full, stage, version=version, rule=ALWAYS_DELTA)
    assert p.spec is not None
    return new, {
        "delta": True, "density": density, "write_s": t_write, "publish_s": time.perf_counter() - t,
        "elements_changed": sum(c for c, _ in counts), "elements": sum(n for _, n in counts),
        "delta_bytes": p.spec.delta_bytes, "full_bytes": p.spec.full_bytes, "ratio": p.spec.ratio,
    }  # fmt: skip


def commit_delta(watch: Path, trainer: Path, prev_full: Path, version: str, seed: int,
                 density: float) -> tuple[datetime, float, dict[str, Any], Path]:  # fmt: skip
    """Make and commit one delta version; (commit time, its perf_counter, what was made, the new full)."""
    stage = watch / f".stage-{version}"
    new, made = make_delta(prev_full, trainer, stage, version=version, seed=seed, density=density)
    # The trainer runs on another machine in practice: its 16 GB of new files must not sit in this
    # host's dirty page cache, where the daemon's rebuild writes would pay for their write-back.
    t = time.perf_counter()
    os.sync()
    made["sync_s"] = time.perf_counter() - t
    os.rename(stage, watch / version)
    return datetime.now(UTC), time.perf_counter(), made, new
