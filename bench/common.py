"""Shared benchmark helpers: the Llama-3-8B tensor layout, a fast safetensors shard writer,
page-cache control, and table/JSON output.

The writer generates tensor data on the GPU when there is one (CPU otherwise) and writes the
safetensors header plus raw bytes itself, so 16 GB of shards take seconds, not minutes.
Used by bench/disk_reload.py and bench/ipc_update.py; nothing here needs transformers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class Layout:
    """Shapes of a Llama-style decoder; `tensors()` lists them with Hugging Face names."""

    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    dtype: str = "BF16"  # safetensors dtype string
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                (p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (self.intermediate, h)),
                (p + "mlp.up_proj.weight", (self.intermediate, h)),
                (p + "mlp.down_proj.weight", (h, self.intermediate)),
            ]
        out.append(("model.norm.weight", (h,)))
        if not self.tie_embeddings:
            out.append(("lm_head.weight", (self.vocab, h)))
        return out

    @property
    def element_size(self) -> int:
        return ST_DTYPES[self.dtype][1]

    @property
    def total_bytes(self) -> int:
        return sum(math.prod(s) for _, s in self.tensors()) * self.element_size

    def hf_config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": str(ST_DTYPES[self.dtype][0]).removeprefix("torch."),
        }


# safetensors dtype -> (torch dtype, bytes per element)
ST_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "F32": (torch.float32, 4),
}

# Llama-3-8B: 291 bf16 tensors, 16.06 GB
LLAMA3_8B = Layout("llama3-8b", vocab=128256, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8)
# same structure, a few MB: for dry runs on a laptop / CI box
TINY = Layout("tiny", vocab=1024, hidden=256, intermediate=512, layers=4, heads=8, kv_heads=2)
SMALL = Layout("small", vocab=32000, hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4)
LAYOUTS: dict[str, Layout] = {x.name: x for x in (LLAMA3_8B, SMALL, TINY)}


@dataclass(frozen=True, slots=True)
class WrittenCheckpoint:
    directory: Path
    files: list[Path]
    total_bytes: int
    tensors: int
    seconds: float


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def split_into_shards(
    tensors: Sequence[tuple[str, tuple[int, ...]]], element_size: int, shards: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Contiguous groups in layout order, each about total/shards bytes (like save_pretrained)."""
    total = sum(math.prod(s) for _, s in tensors) * element_size
    target = total / max(shards, 1)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    acc = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * element_size
        if groups[-1] and acc + nbytes / 2 > target * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append((name, shape))
        acc += nbytes
    return groups


def safetensors_header(
    entries: Sequence[tuple[str, tuple[int, ...]]], dtype: str, element_size: int
) -> bytes:
    """Header bytes (8-byte length + JSON padded to 8 bytes) for tensors laid out back to back."""
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape in entries:
        n = math.prod(shape) * element_size
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def write_checkpoint(
    directory: str | Path,
    layout: Layout,
    *,
    shards: int = 4,
    seed: int = 0,
    device: torch.device | str | None = None,
    chunk_elems: int = 64 * 1024 * 1024,
) -> WrittenCheckpoint:
    """Write `layout` as a sharded safetensors checkpoint (index + config.json) with random data.

    Data is drawn on `device` (the GPU when present) in chunks of `chunk_elems` elements and
    written raw after a hand-made header; different seeds give different bytes everywhere.
    """
    t0 = time.perf_counter()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device) if device is not None else _default_device()
    tdtype, esize = ST_DTYPES[layout.dtype]
    gen = torch.Generator(device=dev).manual_seed(seed)
    groups = split_into_shards(layout.tensors(), esize, shards)
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        path = d / fname
        with open(path, "wb", buffering=0) as f:
            f.write(safetensors_header(group, layout.dtype, esize))
            for name, shape in group:
                weight_map[name] = fname
                numel = math.prod(shape)
                is_norm = name.endswith("norm.weight")
                for lo in range(0, numel, chunk_elems):
                    n = min(chunk_elems, numel - lo)
                    t = torch.randn(n, generator=gen, device=dev, dtype=torch.float32).mul_(0.02)
                    if is_norm:
                        t.add_(1.0)
                    host = t.to(tdtype).cpu()
                    f.write(memoryview(host.view(torch.uint8).numpy()))
        files.append(path)
    (d / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": layout.total_bytes}, "weight_map": weight_map}, indent=1)
    )
    (d / "config.json").write_text(json.dumps(layout.hf_config(), indent=2))
    return WrittenCheckpoint(d, files, layout.total_bytes, len(weight_map), time.perf_counter() - t0)


def alloc_params(layout: Layout, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Uninitialised parameters with the layout's names and shapes, as a model would hold them."""
    tdtype, _ = ST_DTYPES[layout.dtype]
    return {n: torch.empty(s, dtype=tdtype, device=device) for n, s in layout.tensors()}


def drop_page_cache(files: Iterable[Path]) -> str:
    """Evict `files` from the page cache. Returns the method that worked.

    `drop_caches` (root: sync; echo 3 > /proc/sys/vm/drop_caches) empties the whole cache;
    else posix_fadvise(DONTNEED) per file after fsync, which the kernel may honour partly.
    """
    files = list(files)
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def cached_fraction(files: Iterable[Path]) -> float | None:
    """Share of the files' pages resident in the page cache (mmap + mincore), None if unknown."""
    try:
        import ctypes
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page = mmap.PAGESIZE
        resident = total = 0
        for p in files:
            size = os.path.getsize(p)
            if size == 0:
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                npages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * npages)()
                rc = libc.mincore(addr, size, vec)
                libc.munmap(addr, size)
            finally:
                os.close(fd)
            if rc != 0:
                return None
            resident += sum(b & 1 for b in bytes(vec))
            total += npages
        return resident / total if total else None
    except Exception:
        return None


def sync_device(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain fixed-width table (rich is optional on the GPU machine)."""
    cells = [[str(c) for c in columns]] + [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  ".join(v.rjust(w) if j else v.ljust(w) for v, w in zip(r, widths, strict=True)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def write_json(path: str | Path, doc: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2, default=_json_default))


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def machine_description() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kb"] = int(f.readline().split()[1])
    except OSError:
        pass
    return info
