"""CUDA IPC between a real `hotswap loader` and a real worker on the GPU (the H200 run; CI has no
GPU and reports these skipped): an update lands, and a descriptor whose `buffer_bytes` claims more
than the allocation behind its handle is refused before any byte is read (the worker asks the
driver how big the allocation is: daemon.handoff.cuda.check_imported_range), the worker
keeping what it served."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support_ipc import LoaderProcess, shm_dir
from support_worker import WorkerProcess, start_worker, write_token

from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the H200 run)")
PROMPT = [1, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("ipc-cuda")
    for name, seed in (("v1", 1), ("v2", 2)):
        make_tiny_checkpoint(r / name, seed=seed)
    write_token(r)
    return r


@pytest.fixture(scope="module")
def loader(root: Path) -> Iterator[LoaderProcess]:
    with shm_dir() as d:
        lp = LoaderProcess(root / "loader.sock", d, "--max-versions", "4", device="cuda:0")
        for v in ("v1", "v2"):
            lp.client.stage(v, str(root / v))
        yield lp
        lp.stop()


@pytest.fixture(scope="module")
def worker(root: Path) -> Iterator[WorkerProcess]:
    w = start_worker(root / "v1", root / "token", extra=["--version", "v1", "--device", "cuda:0"])
    yield w
    w.stop()


def _update(w: WorkerProcess, version: str, descriptor: dict[str, Any], mode: str = "copy") -> Any:
    return w.post("/admin/update", {"version": version, "transport": "ipc", "descriptor": descriptor, "mode": mode},
                  admin=True)  # fmt: skip


def test_a_cuda_ipc_update_lands_and_a_lying_buffer_size_is_refused_before_any_read(
    worker: WorkerProcess, loader: LoaderProcess
) -> None:
    assert worker.info()["device"].startswith("cuda")
    good = loader.client.descriptor("v2")
    assert good["kind"] == "cuda", good["kind"]
    r = _update(worker, "v2", good)
    assert r.status_code == 200, r.text
    v2_tokens = worker.greedy(PROMPT)
    before = worker.info()
    for mode in ("copy", "swap"):
        lying = json.loads(json.dumps(loader.client.descriptor("v1")))
        lying["buffers"][0]["buffer_bytes"] += 64 << 20  # far past any rounding of the allocation
        r = _update(worker, "v1", lying, mode)
        assert r.status_code == 422 and "allocation behind the handle" in r.json()["error"], r.text
    after = worker.info()
    assert (after["version"], after["update_count"]) == ("v2", before["update_count"])
    assert worker.greedy(PROMPT) == v2_tokens
