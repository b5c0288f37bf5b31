"""Disk updates read ahead (daemon/transport/ahead.py): the version is read and checked into a
buffer of its own before the pause, and the pause only copies those verified bytes in; files
changed afterwards are never read. CPU here (host buffer); CUDA uses a cuMemAlloc'd one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support_check import expect_of, flip_byte

from daemon.formats.checkpoint import tensor_table, weight_files
from daemon.tinymodel import make_tiny_checkpoint
from daemon.transport.base import TransportError
from daemon.transport.disk import DiskTransport
from daemon.worker.flat import checkpoint_order, pack_flat

pytestmark = pytest.mark.quick


def params_like(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(directory):
        out.update({n: torch.full_like(t, 7.0) for n, t in load_file(f).items()})
    return out


def file_values(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(directory):
        out.update({n: t.clone() for n, t in load_file(f).items()})  # copies: the files change later
    return out


def middle_of_first_tensor(directory: Path) -> tuple[Path, int]:
    table, _ = tensor_table(directory)
    loc = min(table.values(), key=lambda x: (str(x.file), x.entry.start))
    return loc.file, loc.entry.start + loc.entry.nbytes // 2


@pytest.mark.parametrize("flat", [True, False])
def test_staged_bytes_are_what_the_pause_writes_even_if_the_files_change(tmp_path: Path, flat: bool) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=21, shards=2)
    want = file_values(d)
    params = params_like(d)
    buf = pack_flat(params, checkpoint_order(str(d))) if flat else None
    tr = DiskTransport(d, staged=True, chunk_bytes=4096, readers=3, expect=expect_of(d))
    tr.stage_ahead, tr.flat = "on", buf
    tr.stage(params)
    assert tr.ahead is not None and all(torch.equal(p, torch.full_like(p, 7.0)) for p in params.values())
    file, off = middle_of_first_tensor(d)
    flip_byte(file, off)  # after the check: the pause must not read it
    tr.write_into(params)
    for n, t in want.items():
        assert torch.equal(params[n], t), n
    st = tr.stats()
    assert st["read_path"] == "ahead" and st["checked_files"] == 2
    if flat:
        assert tr.last_stats is not None and tr.last_stats.chunks == 1  # the whole version in one copy
    tr.close()
    assert tr.ahead is None


def test_a_changed_byte_fails_the_stage_and_keeps_nothing(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=22, shards=2)
    expect = expect_of(d)
    flip_byte(*middle_of_first_tensor(d))
    params = params_like(d)
    tr = DiskTransport(d, staged=True, chunk_bytes=4096, readers=3, expect=expect)
    tr.stage_ahead = "on"
    with pytest.raises(TransportError, match="does not match the verified"):
        tr.stage(params)
    assert tr.ahead is None and all(torch.equal(p, torch.full_like(p, 7.0)) for p in params.values())


def test_auto_reads_nothing_ahead_for_cpu_parameters(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=23)
    src = tmp_path / "copy"
    shutil.copytree(d, src)
    params = params_like(src)
    tr = DiskTransport(src, expect=expect_of(src))
    tr.stage(params)  # "auto": CUDA only
    assert tr.ahead is None
    tr.write_into(params)
    assert tr.stats()["read_path"] == "direct"
