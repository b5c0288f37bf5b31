"""Checkpoint versions for bench/gpu_e2e.py, derived from one written base so an 8B run fits its budget.

Writing 16 GB of fresh random bf16 takes ~18 s on the H200 box; a derived version takes a
few: every shard but one is a hard link to the previous version's (never modified in place),
one shard (a different one each time) is copied and gets fresh values in its first large
tensor, config.json and the index are copied, then a new manifest is published. Every file is
still read in full by every check, the loader and the workers; the content digest differs.

The bad versions the same way: "nan" plants NaNs before publishing (the manifest agrees, so
only the finite scan can catch it), "corrupt" flips a byte after publishing (crc32c), and
"incompatible" ships a config.json whose intermediate_size does not match the tensors (the
forward canary).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.formats.safetensors import read_header
from daemon.manifest import publish

KINDS = ("good", "nan", "corrupt", "incompatible", "link")
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
FRESH_BYTES = 8 << 20


def _shards(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.suffix == ".safetensors")


def derive(prev: Path, dest: Path, *, seed: int, kind: str = "good", version: str | None = None) -> dict[str, str]:
    """Make `dest` (not yet in the watched view) from `prev`; returns what was changed where."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {KINDS}")
    dest.mkdir(parents=True)
    shards = _shards(prev)
    changed = shards[seed % len(shards)] if kind not in ("link", "incompatible") else None
    for f in prev.iterdir():
        if f.name == MANIFEST_NAME or f.name.startswith("."):
            continue
        if f == changed:
            shutil.copyfile(f, dest / f.name)
        elif f.suffix == ".safetensors":
            os.link(f, dest / f.name)
        else:
            shutil.copyfile(f, dest / f.name)
    what: dict[str, str] = {"kind": kind}
    if changed is not None:
        what.update(_freshen(dest / changed.name, seed, nan=kind == "nan"))
    if kind == "incompatible":
        cfg = json.loads((dest / "config.json").read_text())
        cfg["intermediate_size"] = int(cfg["intermediate_size"]) + 256
        (dest / "config.json").write_text(json.dumps(cfg, indent=2))
        what["config"] = f"intermediate_size {cfg['intermediate_size']} (tensors: {cfg['intermediate_size'] - 256})"
    publish(dest, version=version)
    if kind == "corrupt":
        assert changed is not None
        path = dest / changed.name
        pos = int(what["offset"]) + 101
        with open(path, "r+b") as fh:
            fh.seek(pos)
            b = fh.read(1)
            fh.seek(pos)
            fh.write(bytes([b[0] ^ 0x10]))
        what["flipped_byte"] = f"{changed.name}@{pos}"
    return what


def _freshen(path: Path, seed: int, *, nan: bool) -> dict[str, str]:
    """New values (N(0, 0.02)) over the first FRESH_BYTES of the shard's first large non-norm tensor."""
    header = read_header(path)
    entry = next(e for e in header.tensors if e.dtype in _DTYPES and not e.name.endswith("norm.weight"))
    dtype = _DTYPES[entry.dtype]
    size = torch.empty((), dtype=dtype).element_size()
    n = min(entry.nbytes, FRESH_BYTES) // size
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen).mul_(0.02).to(dtype)
    if nan:
        values[3] = float("nan")
    with open(path, "r+b") as fh:
        fh.seek(entry.start)
        fh.write(memoryview(values.view(torch.uint8).numpy()))
    return {"tensor": entry.name, "file": path.name, "offset": str(entry.start)}
