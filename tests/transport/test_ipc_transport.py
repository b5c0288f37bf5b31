"""The ipc transport on shared host memory, against a real loader process: copy, swap, refusals, leaks."""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support_ipc import LoaderProcess, load_checkpoint, open_fds, segment_maps, shm_dir

from daemon.handoff.descriptor import DescriptorError
from daemon.tinymodel import make_tiny_checkpoint
from daemon.transport.base import TableMismatch, check_table
from daemon.transport.ipc import IpcTransport, LoaderRefused, point_params_at
from daemon.transport.ipc_open import OPENER

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    out = {"v1": make_tiny_checkpoint(root / "v1", seed=1), "v2": make_tiny_checkpoint(root / "v2", seed=2, shards=3)}
    out["wide"] = make_tiny_checkpoint(root / "wide", seed=3, config_overrides={"intermediate_size": 192})
    return out


@pytest.fixture(scope="module")
def loader(tmp_path_factory: pytest.TempPathFactory, ckpts: dict[str, Path]) -> Iterator[LoaderProcess]:
    with shm_dir() as d:
        lp = LoaderProcess(tmp_path_factory.mktemp("loader") / "loader.sock", d)
        for v in ("v1", "v2", "wide"):
            lp.client.stage(v, str(ckpts[v]))
        yield lp
        lp.stop()


@pytest.fixture
def model(ckpts: dict[str, Path]) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((ckpts["v1"] / "config.json").read_text())
    m = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    m.load_state_dict(load_checkpoint(ckpts["v1"]))
    params = dict(m.named_parameters())
    return m, params


def logits(m: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return m(torch.tensor([[1, 5, 9, 42, 7]])).logits


def disk_logits(m: torch.nn.Module, directory: Path) -> torch.Tensor:
    """What a plain disk reload of `directory` makes the model answer."""
    saved = {k: v.clone() for k, v in m.state_dict().items()}
    m.load_state_dict(load_checkpoint(directory))
    out = logits(m)
    m.load_state_dict(saved)
    return out


def test_copy_changes_outputs_exactly_as_a_disk_reload(loader: LoaderProcess, ckpts: dict[str, Path], model) -> None:
    m, params = model
    want = disk_logits(m, ckpts["v2"])
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    before = logits(m)
    with IpcTransport(loader.client.descriptor("v2"), device="cpu", worker="t") as tr:
        check_table(tr.table(), params)
        tr.write_into(params)
        assert loader.client.status()["versions"][1]["holders"] == {"t": 1}
    assert torch.equal(logits(m), want) and not torch.equal(before, want)
    assert {n: p.data_ptr() for n, p in params.items()} == ptrs  # written in place, no reallocation
    assert all(v["holders"] == {} for v in loader.client.status()["versions"])


def test_copy_checks_its_checksum_against_the_source_and_refuses_a_short_copy(
    loader: LoaderProcess, ckpts: dict[str, Path], model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan and the source's checksum are made before the pause (prepare_copy); the copy's
    bytes are summed after it and compared: a copy that missed a tensor raises, naming it."""
    from daemon.transport import ipc
    from daemon.transport.base import TransportError
    from daemon.transport.copyplan import CopyPlan

    m, params = model
    want = disk_logits(m, ckpts["v2"])
    with IpcTransport(loader.client.descriptor("v2"), device="cpu", worker="t") as tr:
        tr.prepare_copy(params)
        assert tr._prepared_copy is not None
        tr.write_into(params)
        assert tr.checked["copy_checksum"] == "equal" and tr._prepared_copy is None
    assert torch.equal(logits(m), want)
    real = ipc.run_copies

    def short(plan: CopyPlan, dst: torch.Tensor | None, src: torch.Tensor | None) -> None:
        real(CopyPlan(plan.runs, plan.singles[:-1]), dst, src)  # the last tensor never copied

    monkeypatch.setattr(ipc, "run_copies", short)
    with IpcTransport(loader.client.descriptor("v1"), device="cpu", worker="t") as tr:
        tr.prepare_copy(params)
        with pytest.raises(TransportError, match="checksum differs from the staged copy"):
            tr.write_into(params)


def test_swap_points_at_the_shared_buffer_and_rollback_flips_back(loader: LoaderProcess, ckpts: dict[str, Path], model) -> None:
    m, params = model
    before = logits(m)
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    tr = IpcTransport(loader.client.descriptor("v2"), device="cpu", worker="t")
    check_table(tr.table(), params)
    previous = point_params_at(params, tr.views())
    assert torch.equal(logits(m), disk_logits(m, ckpts["v2"]))
    assert all(p.data_ptr() != ptrs[n] for n, p in params.items())
    point_params_at(params, previous)  # rollback: a pointer flip
    assert torch.equal(logits(m), before)
    assert {n: p.data_ptr() for n, p in params.items()} == ptrs
    tr.close()
    assert segment_maps() == 0 and OPENER.open_versions() == {}


def test_bad_descriptors_are_refused_before_any_write(loader: LoaderProcess, model) -> None:
    m, params = model
    before = logits(m)
    good = loader.client.descriptor("v2")

    def refused(doc: dict, exc: type[Exception], message: str) -> None:
        with pytest.raises(exc, match=message):
            tr = IpcTransport(doc, device="cpu")
            check_table(tr.table(), params)
            tr.write_into(params)
        assert torch.equal(logits(m), before)

    bad = json.loads(json.dumps(good))
    bad["tensors"][0]["offset"] += 8
    refused(bad, DescriptorError, "not 256-byte aligned")
    bad = json.loads(json.dumps(good))
    bad["tensors"][0]["bytes"] += 4
    refused(bad, DescriptorError, "descriptor says")
    bad = json.loads(json.dumps(good))
    bad["tensors"][0]["dtype"] = "Q4_K"
    refused(bad, DescriptorError, "unknown dtype 'Q4_K'")
    bad = json.loads(json.dumps(good))
    bad["buffers"][0]["buffer_bytes"] += 4096  # the segment file is not that long
    refused(bad, DescriptorError, "has .* bytes, the descriptor says")
    refused(loader.client.descriptor("wide"), TableMismatch, r"shape \[192, 64\] != live \[128, 64\]")
    bad = json.loads(json.dumps(good))
    bad["tensors"][3]["shape"] = list(reversed(bad["tensors"][3]["shape"]))  # right bytes, wrong shape
    if bad["tensors"][3]["shape"] != good["tensors"][3]["shape"]:
        refused(bad, TableMismatch, "shape")
    assert OPENER.open_versions() == {}


def test_a_dead_loader_refuses_the_update_and_leaves_the_weights_whole(
    ckpts: dict[str, Path], tmp_path: Path, model
) -> None:
    m, params = model
    before = logits(m)
    with shm_dir() as d:
        lp = LoaderProcess(tmp_path / "l.sock", d)
        lp.client.stage("v2", str(ckpts["v2"]))
        desc = lp.client.descriptor("v2")
        lp.kill()
        tr = IpcTransport(desc, device="cpu")
        check_table(tr.table(), params)
        with pytest.raises(LoaderRefused, match="loader at .* acquire failed"):
            tr.write_into(params)
        assert torch.equal(logits(m), before)
        lp.stop()


def test_cuda_descriptor_is_refused_on_a_cpu_worker(loader: LoaderProcess) -> None:
    doc = loader.client.descriptor("v1")
    doc["kind"] = "cuda"
    doc["buffers"] = [{"device_uuid": "GPU-0", "buffer_bytes": doc["size"], "offset": 0, "handle": "A" * 86 + "=="}]
    with pytest.raises(DescriptorError, match="cannot feed a worker on cpu"):
        IpcTransport(doc, device="cpu")


def test_hundred_updates_leak_nothing(loader: LoaderProcess, model) -> None:
    m, params = model
    descs = {v: loader.client.descriptor(v) for v in ("v1", "v2")}
    with IpcTransport(descs["v1"], device="cpu") as tr:
        tr.write_into(params)
    gc.collect()  # what earlier tests left to the collector is closed before the count, not during it
    fds, maps, segments = open_fds(), segment_maps(), loader.segments()
    for i in range(100):
        tr = IpcTransport(descs["v2" if i % 2 == 0 else "v1"], device="cpu", worker="leak")
        if i % 4 < 2:
            tr.write_into(params)  # copy
        else:
            point_params_at(params, point_params_at(params, tr.views()))  # swap in, roll back
        tr.close()
    gc.collect()
    assert open_fds() - fds == set(), "descriptors opened by the updates and still open"
    assert (segment_maps(), loader.segments()) == (maps, segments)
    assert OPENER.open_versions() == {}
    assert all(v["holders"] == {} for v in loader.client.status()["versions"])
    assert os.path.exists(loader.socket_path)
