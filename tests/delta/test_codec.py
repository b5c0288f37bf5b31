"""Delta codec: every encoding rebuilds bit-identical bytes for every dtype, and bad chunks are refused.

Property tests (hypothesis) on raw chunks and on real safetensors files (bf16, fp16, fp32, fp8)
with changed values, changed shapes, new and removed tensors and a changed header.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from daemon.delta.codec import Chunk, DeltaError, bounded_decompress, decode, encode
from daemon.delta.container import ChunkBuffers, Lent, encode_file, map_file, rebuild_file

pytestmark = pytest.mark.quick
POOL = ThreadPoolExecutor(2)
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f8": torch.float8_e4m3fn}


def _pair(seed: int, n: int, item: int, density: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * item, dtype=np.uint8)
    new = base.copy()
    hit = rng.random(n) < density
    view = new.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[item])
    view[hit] ^= rng.integers(1, 2 ** (8 * item) - 1, int(hit.sum()), dtype=np.uint64).astype(view.dtype) | 1
    return base, new


def _roundtrip(base: np.ndarray, new: np.ndarray, item: int, force: str | None) -> str:
    enc, payload, n, isize, z = encode(base, new, item, force)
    chunk = Chunk(0, len(new), enc, 0 if enc != "full" else -1, item, 0, len(payload), n, isize, z)
    out = np.empty(len(new), np.uint8)
    decode(chunk, base, memoryview(payload), out, "t")
    assert out.tobytes() == new.tobytes()
    return enc


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 3000), item=st.sampled_from([1, 2, 4]),
       density=st.sampled_from([0.0, 0.001, 0.05, 0.3, 1.0]),
       force=st.sampled_from([None, "sparse", "xor", "full"]))  # fmt: skip
def test_every_encoding_rebuilds_the_chunk_bit_identical(seed: int, n: int, item: int, density: float,
                                                         force: str | None) -> None:  # fmt: skip
    base, new = _pair(seed, n, item, density)
    enc = _roundtrip(base, new, item, force)
    if force is not None and (new != base).any():
        assert enc == force
    if force is None:  # the chosen encoding is never bigger than the raw bytes
        assert len(encode(base, new, item)[1]) <= len(new)


def test_the_smallest_encoding_is_chosen() -> None:
    base, new = _pair(1, 100_000, 2, 0.0)
    assert _roundtrip(base, new, 2, None) == "same"
    base, new = _pair(1, 100_000, 2, 0.001)
    assert _roundtrip(base, new, 2, None) == "sparse"
    zeros = np.zeros(200_000, np.uint8)
    assert _roundtrip(zeros, np.ones(200_000, np.uint8), 1, None) == "xor"
    base, new = _pair(2, 100_000, 2, 1.0)
    assert _roundtrip(base, new, 2, None) == "full"
    assert _roundtrip(None, new, 2, None) == "full"  # type: ignore[arg-type]


def _tensors(seed: int, dtype: torch.dtype, names: list[str]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(37, 11 + i, generator=g) * 0.02).to(dtype) for i, n in enumerate(names)}


def _step(t: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (v.float() + lr * torch.randn(v.shape, generator=g)).to(v.dtype) for n, v in t.items()}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(list(DTYPES)), lr=st.sampled_from([0.0, 1e-5, 1e-3, 1.0]), seed=st.integers(0, 1000),
       change=st.sampled_from(["none", "shape", "new", "removed", "metadata"]),
       force=st.sampled_from([None, "sparse", "xor", "full"]), chunk=st.sampled_from([64, 1000, 1 << 20]))  # fmt: skip
def test_a_safetensors_file_rebuilds_bit_identical(tmp_path: Path, dtype: str, lr: float, seed: int, change: str,
                                                   force: str | None, chunk: int) -> None:  # fmt: skip
    d = tmp_path / f"{dtype}-{seed}-{change}-{force}-{chunk}-{lr}"
    d.mkdir()
    base_t = _tensors(seed, DTYPES[dtype], ["a", "b", "c"])
    new_t = _step(base_t, lr, seed + 1)
    meta = None
    if change == "shape":
        new_t["b"] = torch.zeros(5, 3).to(DTYPES[dtype])
    elif change == "new":
        new_t["d"] = torch.ones(4).to(DTYPES[dtype])
    elif change == "removed":
        del new_t["c"]
    elif change == "metadata":
        meta = {"step": str(seed)}
    save_file(base_t, d / "base.safetensors")
    save_file(new_t, d / "model.safetensors", metadata=meta)
    base, new = map_file(d / "base.safetensors"), map_file(d / "model.safetensors")
    header, payloads, chunks = encode_file("model.safetensors", new, base, POOL, force, chunk)
    (d / "delta.hsd").write_bytes(header + b"".join(payloads))
    rebuild_file(d / "delta.hsd", base, d / "out.safetensors", POOL, "t")
    assert (d / "out.safetensors").read_bytes() == (d / "model.safetensors").read_bytes()
    if force is None:  # never larger than the full file plus a small header
        assert sum(len(p) for p in payloads) <= len(new)


def test_a_non_tensor_file_rebuilds_and_a_new_file_needs_no_base(tmp_path: Path) -> None:
    old, new = b'{"vocab": [1, 2, 3]}', b'{"vocab": [1, 2, 4]}'
    (tmp_path / "old").write_bytes(old)
    (tmp_path / "new").write_bytes(new)
    for base in (map_file(tmp_path / "old"), None):
        header, payloads, _ = encode_file("tokenizer.json", map_file(tmp_path / "new"), base, POOL)
        (tmp_path / "d").write_bytes(header + b"".join(payloads))
        rebuild_file(tmp_path / "d", base, tmp_path / "out", POOL, "t")
        assert (tmp_path / "out").read_bytes() == new


@pytest.mark.parametrize("hold", [False, True])
def test_chunk_buffers_are_reused_only_once_every_holder_gave_them_back(tmp_path: Path, hold: bool) -> None:
    """A chunk's buffer goes back to the pool after it was written and seen; one that `on_chunk`
    holds (as an in-order hash parks a chunk) keeps its bytes until released, never reused."""
    rng = np.random.default_rng(5)
    old = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    new = old.copy()
    new[rng.random(len(new)) < 0.01] ^= 1
    (tmp_path / "old").write_bytes(old.tobytes())
    (tmp_path / "new").write_bytes(new.tobytes())
    header, payloads, chunks = encode_file("f", map_file(tmp_path / "new"), map_file(tmp_path / "old"), POOL,
                                           chunk_bytes=4096)  # fmt: skip
    (tmp_path / "d").write_bytes(header + b"".join(payloads))
    held: list[tuple[Chunk, np.ndarray, Lent]] = []
    seen: list[Chunk] = []

    def on_chunk(c: Chunk, data: np.ndarray, lent: Lent) -> None:
        seen.append(c)
        if hold:
            lent.hold()
            held.append((c, data, lent))

    buffers = ChunkBuffers(4096)
    rebuild_file(tmp_path / "d", map_file(tmp_path / "old"), tmp_path / "out", POOL, "t", on_chunk, 4, buffers)
    assert (tmp_path / "out").read_bytes() == new.tobytes() and len(seen) == len(chunks) == 256
    if hold:
        assert buffers.made == len(chunks)  # every held buffer stayed out of the pool
        assert all(data.tobytes() == new[c.out : c.out + c.length].tobytes() for c, data, _ in held)
        for _c, _d, lent in held:
            lent.release()
    else:
        assert buffers.made <= 4  # no more than the window of chunks in flight


# --------------------------------------------------------------------------- refused


def test_a_decompression_bomb_is_refused_before_it_is_inflated() -> None:
    bomb = zstandard.ZstdCompressor(level=1).compress(b"\0" * (64 << 20))
    with pytest.raises(DeltaError, match="declares 67108864 bytes, the delta says 1024: refused"):
        bounded_decompress(bomb, 1024, "t")
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(b"\0" * 4096)
    with pytest.raises(DeltaError, match="declares no size"):
        bounded_decompress(unsized, 4096, "t")


def _sparse(gaps: list[int], values: bytes, length: int) -> tuple[Chunk, bytes]:
    index = zstandard.ZstdCompressor().compress(np.array(gaps, "<u4").tobytes())
    return Chunk(0, length, "sparse", 0, 2, 0, len(index) + len(values), len(gaps), len(index)), index + values


@pytest.mark.parametrize(("gaps", "why"), [([3, 0], "repeated"), ([3, 2, 100], "out of range")])
def test_sparse_indices_repeated_or_out_of_range_are_refused(gaps: list[int], why: str) -> None:
    chunk, payload = _sparse(gaps, b"\1\1" * len(gaps), 40)
    with pytest.raises(DeltaError, match=why):
        decode(chunk, np.zeros(40, np.uint8), memoryview(payload), np.empty(40, np.uint8), "t")


def test_a_delta_against_another_dtype_or_size_is_refused(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(8, 8, dtype=torch.bfloat16)}, tmp_path / "base.safetensors")
    save_file({"w": torch.ones(8, 8, dtype=torch.bfloat16)}, tmp_path / "new.safetensors")
    header, payloads, _ = encode_file("new.safetensors", map_file(tmp_path / "new.safetensors"),
                                      map_file(tmp_path / "base.safetensors"), POOL, "xor")  # fmt: skip
    (tmp_path / "d").write_bytes(header + b"".join(payloads))
    save_file({"w": torch.zeros(8, 4, dtype=torch.float32)}, tmp_path / "other.safetensors")  # same byte size
    with pytest.raises(DeltaError, match="dtype or size disagrees with the base"):
        rebuild_file(tmp_path / "d", map_file(tmp_path / "other.safetensors"), tmp_path / "out", POOL, "t")
    save_file({"w": torch.zeros(8, 9, dtype=torch.bfloat16)}, tmp_path / "bigger.safetensors")
    with pytest.raises(DeltaError, match="the base file has"):
        rebuild_file(tmp_path / "d", map_file(tmp_path / "bigger.safetensors"), tmp_path / "out", POOL, "t")


def test_chunks_that_do_not_tile_the_result_are_refused(tmp_path: Path) -> None:
    (tmp_path / "new").write_bytes(b"x" * 100)
    header, payloads, _ = encode_file("f", map_file(tmp_path / "new"), None, POOL, chunk_bytes=40)
    (tmp_path / "d").write_bytes(header.replace(b"[40,40,", b"[41,40,") + b"".join(payloads))
    with pytest.raises(DeltaError, match="do not tile"):
        rebuild_file(tmp_path / "d", None, tmp_path / "out", POOL, "t")
