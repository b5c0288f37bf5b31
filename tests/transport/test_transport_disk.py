"""Disk transport: in-place writes from real safetensors shards, refusals before any write."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from daemon.formats.checkpoint import LayoutError, tensor_table, weight_files
from daemon.formats.safetensors import HeaderError
from daemon.tinymodel import make_tiny_checkpoint
from daemon.transport.base import TableMismatch, TransportError, check_table
from daemon.transport.disk import DiskTransport
from daemon.transport.disk_read import plan_chunks

# reported as skipped where there is no GPU, never silently left out of the collection
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))]


def load_reference(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(directory):
        out.update(load_file(f))
    return out


def live_params(directory: Path, device: str) -> dict[str, torch.Tensor]:
    """Parameters shaped like the checkpoint, filled with a constant (so any write shows)."""
    return {n: torch.full_like(t, 7.0, device=device) for n, t in load_reference(directory).items()}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("disk")
    return {
        "one": make_tiny_checkpoint(root / "one", seed=1),
        "sharded": make_tiny_checkpoint(root / "sharded", seed=2, shards=3),
        "bf16": make_tiny_checkpoint(root / "bf16", seed=3, shards=2, dtype="bfloat16"),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["one", "sharded", "bf16"])
@pytest.mark.parametrize(("staged", "chunk"), [(None, 64 << 20), (True, 4096), (True, 10_000), (True, 64 << 20)])
def test_write_into_fills_existing_storage(
    ckpts: dict[str, Path], which: str, device: str, staged: bool | None, chunk: int
) -> None:
    d = ckpts[which]
    params = live_params(d, device)
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    tr = DiskTransport(d, staged=staged, chunk_bytes=chunk, readers=3)
    check_table(tr.table(), params)
    tr.write_into(params)
    ref = load_reference(d)
    for name, want in ref.items():
        assert params[name].data_ptr() == ptrs[name], f"{name} was reallocated"
        assert torch.equal(params[name].cpu(), want), name
    assert tr.last_stats is not None
    assert tr.last_stats.bytes == sum(t.numel() * t.element_size() for t in ref.values())


def test_plan_chunks_covers_every_byte_once(ckpts: dict[str, Path]) -> None:
    locs, _ = tensor_table(ckpts["sharded"])
    for chunk in (1, 7, 4096, 50_000, 1 << 30):
        chunks = plan_chunks(list(locs.values()), chunk)
        covered: dict[str, list[tuple[int, int]]] = {}
        for c in chunks:
            assert 0 < c.nbytes <= chunk
            assert sum(s.nbytes for s in c.segments) == c.nbytes
            for s in c.segments:
                covered.setdefault(s.name, []).append((s.dst_offset, s.dst_offset + s.nbytes))
        for name, loc in locs.items():
            spans = sorted(covered[name])
            assert spans[0][0] == 0 and spans[-1][1] == loc.entry.nbytes
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_wrong_shape_is_refused_by_table_check(tmp_path: Path, ckpts: dict[str, Path]) -> None:
    live = live_params(ckpts["one"], "cpu")
    before = {n: t.clone() for n, t in live.items()}
    other = make_tiny_checkpoint(tmp_path / "wide", seed=5, config_overrides={"intermediate_size": 96})
    with pytest.raises(TableMismatch, match=r"mlp\.(down|gate|up)_proj\.weight.*shape"):
        check_table(DiskTransport(other).table(), live)
    assert all(torch.equal(before[n], live[n]) for n in live)


def test_truncated_shard_is_refused_at_header_time(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=1, shards=2)
    shard = weight_files(d)[1]
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(HeaderError, match=shard.name):
        DiskTransport(d).table()


def test_missing_shard_names_the_file(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=1, shards=2)
    gone = weight_files(d)[0]
    gone.unlink()
    with pytest.raises(LayoutError, match=gone.name):
        DiskTransport(d).table()


def test_missing_directory_is_a_transport_error(tmp_path: Path) -> None:
    with pytest.raises(TransportError, match="does not exist"):
        DiskTransport(tmp_path / "nope").table()


@pytest.mark.parametrize("staged", [False, True])
def test_truncation_after_header_read_fails_with_file_and_offset(tmp_path: Path, staged: bool) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=1)
    params = live_params(d, "cpu")
    tr = DiskTransport(d, staged=staged)
    check_table(tr.table(), params)
    shard = weight_files(d)[0]
    os.truncate(shard, shard.stat().st_size // 2)  # the file shrinks between table() and write
    with pytest.raises(TransportError, match=rf"{shard.name}.*short read at offset \d+"):
        tr.write_into(params)


def test_non_contiguous_parameter_is_refused_before_writing(ckpts: dict[str, Path]) -> None:
    d = ckpts["one"]
    params = live_params(d, "cpu")
    name = "model.layers.0.mlp.down_proj.weight"
    params[name] = params[name].t().contiguous().t()  # same shape, transposed strides
    before = {n: t.clone() for n, t in params.items()}
    with pytest.raises(TransportError, match="down_proj.*not contiguous"):
        DiskTransport(d).write_into(params)
    assert all(torch.equal(before[n], params[n]) for n in params)
