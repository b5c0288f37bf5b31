"""Delta checkpoint tests: a training-like step on a real checkpoint (tests/delta/)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from daemon.formats.checkpoint import MANIFEST_NAME


def step(src: Path, dst: Path, lr: float, seed: int, share: float = 0.02) -> None:
    """dst: src's checkpoint after a small update of `share` of the elements of every float tensor."""
    dst.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            t = load_file(f)
            save_file({k: (v.float() + lr * torch.randn(v.shape, generator=g) * (torch.rand(v.shape, generator=g) < share)
                           ).to(v.dtype) if v.is_floating_point() else v for k, v in t.items()}, dst / f.name)  # fmt: skip
        elif f.name != MANIFEST_NAME:
            (dst / f.name).write_bytes(f.read_bytes())
