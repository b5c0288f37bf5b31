"""Check while loading with the hash off the readers' path: each file is hashed on its own thread
from the buffers the readers filled (they read on meanwhile), and a changed byte anywhere is
still refused before anything is committed."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support_check import expect_of, flip_byte

from daemon.formats.checkpoint import tensor_table, weight_files
from daemon.tinymodel import make_tiny_checkpoint
from daemon.transport import check, disk_read
from daemon.transport.base import TransportError
from daemon.transport.disk import DiskTransport

pytestmark = pytest.mark.quick


def params_like(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(directory):
        out.update({n: torch.full_like(t, 7.0) for n, t in load_file(f).items()})
    return out


@pytest.fixture
def slow_hash(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every hash update sleeps a little (so readers run ahead of it) and records its thread."""
    seen: list[str] = []
    real = check.OrderedHasher._update

    def slow(self: check.OrderedHasher, data: Any) -> None:
        seen.append(threading.current_thread().name)
        time.sleep(0.002)
        real(self, data)

    monkeypatch.setattr(check.OrderedHasher, "_update", slow)
    return seen


def test_hashing_runs_on_per_file_threads_and_the_load_is_exact(tmp_path: Path, slow_hash: list[str]) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=11, shards=3)
    params = params_like(d)
    tr = DiskTransport(d, staged=True, chunk_bytes=4096, readers=4, expect=expect_of(d))
    tr.write_into(params)
    assert tr.stats()["checked_files"] == 3
    for f in weight_files(d):
        for n, t in load_file(f).items():
            assert torch.equal(params[n], t), n
    # no reader thread hashed: every chunk was hashed by its file's own thread
    assert slow_hash and all(name.startswith("hash-") for name in slow_hash), set(slow_hash)
    assert {name for name in slow_hash} == {f"hash-{f.name}" for f in weight_files(d)}


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_changed_byte_is_refused_wherever_it_is(tmp_path: Path, slow_hash: list[str], where: str) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=12, shards=3)
    expect = expect_of(d)
    table, _ = tensor_table(d)
    locs = sorted(table.values(), key=lambda x: (str(x.file), x.entry.start))
    loc = locs[0] if where == "first" else locs[-1]
    flip_byte(loc.file, loc.entry.start + loc.entry.nbytes - 1)
    tr = DiskTransport(d, staged=True, chunk_bytes=4096, readers=4, expect=expect)
    with pytest.raises(TransportError, match="does not match the verified .*nothing committed"):
        tr.write_into(params_like(d))
    assert tr.stats().get("checked_files") is None  # nothing reported as checked


def test_a_reader_error_stops_the_hashing_threads_without_hanging(
    tmp_path: Path, slow_hash: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=13, shards=2)
    tr = DiskTransport(d, staged=True, chunk_bytes=4096, readers=3, expect=expect_of(d))
    params = params_like(d)
    real = disk_read._read_exact
    calls = [0]

    def failing(fd: int, buf: memoryview, offset: int, file: Path, what: str) -> None:
        calls[0] += 1
        if calls[0] == 6:  # a read in the middle fails: later chunks of its file never arrive
            raise TransportError(f"{file}: {what}: injected read failure")
        real(fd, buf, offset, file, what)

    monkeypatch.setattr(disk_read, "_read_exact", failing)
    done: list[BaseException] = []

    def run() -> None:
        try:
            tr.write_into(params)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            done.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "write_into hung after a reader failed"
    assert done and isinstance(done[0], TransportError) and "injected read failure" in str(done[0])
    assert not [th for th in threading.enumerate() if th.name.startswith("hash-")]
