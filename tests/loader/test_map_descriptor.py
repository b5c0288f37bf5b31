"""The loader's `purpose="map"` descriptor (issue 41): a version's buffers while the loader still
fills them, so the daemon and its check process open them during the read, not after it. The
real GPU path is tests/transport/test_stage_verify_loader.py's CUDA test."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support_ipc import shm_dir
from support_wait import wait_until

from daemon.handoff import TensorSlot, parse_descriptor
from daemon.loader import store as store_module
from daemon.loader.store import LoaderStore, ShmBackend, StageCheck, StagedBuffer, StoreError
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.quick


class HeldFill(ShmBackend):
    """Shared memory whose fill waits for `go` (or whose allocation fails)."""

    def __init__(self, directory: Path, fail_allocate: bool = False) -> None:
        super().__init__(directory, threads=1)
        self.go = threading.Event()
        self.filling = threading.Event()
        self.fail_allocate = fail_allocate

    def allocate(self, name: str, nbytes: int) -> list[StagedBuffer]:
        if self.fail_allocate:
            assert self.go.wait(30)
            raise StoreError(f"cannot allocate {nbytes} bytes for {name}")
        return super().allocate(name, nbytes)

    def fill(self, buffers: list[StagedBuffer], table: dict[str, Any], slots: tuple[TensorSlot, ...],
             check: StageCheck) -> None:  # fmt: skip
        self.filling.set()
        assert self.go.wait(30)
        super().fill(buffers, table, slots, check)


@pytest.fixture
def shm() -> Iterator[Path]:
    with shm_dir() as d:
        yield d


def _stage_in_thread(store: LoaderStore, version: str, path: Path) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(store.stage(version, str(path), verify_alg="blake3"))
        except Exception as exc:  # noqa: BLE001  (the test reads it)
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_a_map_descriptor_names_the_buffers_while_the_loader_still_fills_them(shm: Path, tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "v1", seed=1)
    backend = HeldFill(shm)
    store = LoaderStore(backend)
    answered: list[dict[str, Any]] = []
    asker = threading.Thread(target=lambda: answered.append(store.descriptor("v1", purpose="map")))
    asker.start()  # before the stage: it waits for the version to be registered
    t, staged = _stage_in_thread(store, "v1", ckpt)
    try:
        assert backend.filling.wait(30)
        asker.join(30)
        assert answered, "no map descriptor while the loader was filling"
        desc = parse_descriptor(answered[0])
        assert store.status()["versions"][0]["state"] == "staging"  # answered before the bytes were in
        assert desc.files == () and desc.digest is None and not desc.checked
        assert desc.buffers[0].path == str(store._versions["v1"].buffers[0].ref().path)
        with pytest.raises(StoreError, match="still staging"):
            store.descriptor("v1", purpose="check")  # what may be read still waits for the stage
    finally:
        backend.go.set()
        t.join(30)
    assert isinstance(staged[0], dict) and staged[0]["staged_now"], staged
    assert parse_descriptor(store.descriptor("v1", purpose="map")).files == ()  # never the digests
    store.close()


def test_a_map_descriptor_of_a_stage_that_fails_or_never_comes_is_an_error(
        shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(store_module, "MAP_WAIT_S", 0.3)
    backend = HeldFill(shm, fail_allocate=True)
    store = LoaderStore(backend)
    with pytest.raises(StoreError, match="not staged"):
        store.descriptor("never", purpose="map")
    monkeypatch.setattr(store_module, "MAP_WAIT_S", 30.0)
    ckpt = make_tiny_checkpoint(tmp_path / "v1", seed=1)
    t, staged = _stage_in_thread(store, "v1", ckpt)
    wait_until(lambda: "v1" in store._versions, timeout=30, what="the stage to register v1")
    allocated = store._versions["v1"].allocated
    answered: list[Any] = []

    def ask() -> None:
        try:
            answered.append(store.descriptor("v1", purpose="map"))
        except StoreError as exc:
            answered.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    # CPython's Event keeps its waiters: the asker is waiting on the allocation before it fails
    wait_until(lambda: len(allocated._cond._waiters) > 0, timeout=30, what="the map descriptor to wait")  # type: ignore[attr-defined]
    backend.go.set()
    t.join(30)
    asker.join(30)
    assert isinstance(staged[0], StoreError), staged
    assert isinstance(answered[0], StoreError) and "no longer staging" in str(answered[0]), answered
    with pytest.raises(StoreError, match="unknown purpose"):
        store.descriptor("v1", purpose="read-early")
