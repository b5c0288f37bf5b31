"""The daemon side of opening the loader's buffer while it fills (issue 41): `Premap` opens a CUDA
buffer once, the version's `LoaderStaged` takes that mapping instead of opening again, and what no
view took is let go; `MapAhead` hands the premap on, and after `abandon` lets everything go. CUDA IPC
is stood in for here by a mapping that counts its opens and closes; the GPU test is in
tests/transport/test_stage_verify_loader.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from daemon.handoff import BufferRef, Descriptor, TensorSlot
from daemon.transport import ipc_verify
from daemon.transport.ipc_verify import OPENED_AHEAD, LoaderStaged, MapAhead, Premap

pytestmark = pytest.mark.quick


class Mapping:
    opened: list[Mapping] = []

    def __init__(self, uuid: str, handle: bytes, nbytes: int) -> None:
        self.handle, self.nbytes, self.closed = handle, nbytes, False
        Mapping.opened.append(self)

    def tensor(self) -> torch.Tensor:
        return torch.zeros(self.nbytes, dtype=torch.uint8)

    def close(self) -> bool:
        self.closed = True
        return True


@pytest.fixture(autouse=True)
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    Mapping.opened = []
    monkeypatch.setattr(ipc_verify, "ImportedBuffer", Mapping)
    monkeypatch.setattr(ipc_verify, "device_uuid", lambda index: "GPU-test")
    monkeypatch.setattr(ipc_verify, "device_index", lambda uuid: 0)


def _desc(version: str = "v1", handle: bytes = b"h" * 64, nbytes: int = 4096) -> Descriptor:
    slot = TensorSlot("w", "F32", (16,), 0, 64)
    return Descriptor(version, "cuda", 64, (slot,), (BufferRef("GPU-test", nbytes, 0, handle=handle),))


def test_a_premap_is_taken_by_its_versions_view_instead_of_a_second_open() -> None:
    premap = Premap(_desc(), "cuda:0")
    assert len(Mapping.opened) == 1 and OPENED_AHEAD.held() == 1
    view = LoaderStaged(_desc(), "cuda:0")
    assert view.opened_ahead and len(Mapping.opened) == 1 and OPENED_AHEAD.held() == 0
    premap.discard()  # taken: the view's mapping is not closed under it
    assert not Mapping.opened[0].closed
    other = LoaderStaged(_desc("v2"), "cuda:0")  # same handle bytes, another version: opened afresh
    assert not other.opened_ahead and len(Mapping.opened) == 2


def test_a_premap_no_view_took_is_closed_and_a_size_mismatch_is_not_taken() -> None:
    Premap(_desc(), "cuda:0").discard()
    assert Mapping.opened[0].closed and OPENED_AHEAD.held() == 0
    Premap(_desc(nbytes=4096), "cuda:0")
    view = LoaderStaged(_desc(nbytes=8192), "cuda:0")  # the descriptor claims another size
    assert not view.opened_ahead and Mapping.opened[1].closed and len(Mapping.opened) == 3


class Loader:
    """Answers the map descriptor once `go` is set."""

    socket_path = "/run/hotswap/loader.sock"

    def __init__(self) -> None:
        self.go = threading.Event()

    def descriptor(self, version: str, device: str | None = None, purpose: str | None = None) -> dict[str, Any]:
        assert purpose == "map" and self.go.wait(30)
        return _desc(version).to_json()


def test_map_ahead_hands_the_premap_on_and_lets_it_go_when_abandoned() -> None:
    loader, handed = Loader(), list[Premap | None]()
    ahead = MapAhead(loader, "v1", "cuda:0", handed.append)  # type: ignore[arg-type]
    ahead.start()
    loader.go.set()
    ahead.join(30)
    assert len(handed) == 1 and isinstance(handed[0], Premap) and OPENED_AHEAD.held() == 1
    ahead.abandon()
    assert handed[1:] == [None] and Mapping.opened[0].closed and OPENED_AHEAD.held() == 0
    ahead.abandon()  # once is enough
    assert handed[1:] == [None]


def test_map_ahead_abandoned_before_its_open_lets_it_go_and_hands_nothing_on() -> None:
    loader, handed = Loader(), list[Premap | None]()
    ahead = MapAhead(loader, "v1", "cuda:0", handed.append)  # type: ignore[arg-type]
    ahead.start()
    ahead.abandon()  # the stage failed before the loader allocated
    loader.go.set()
    ahead.join(30)
    assert handed == [] and len(Mapping.opened) == 1 and Mapping.opened[0].closed and OPENED_AHEAD.held() == 0


@pytest.mark.parametrize("passed", [True, False])
def test_the_workers_are_asked_to_open_a_cuda_buffer_and_let_it_go_only_if_the_version_failed(passed: bool) -> None:
    loader, asked = Loader(), list[tuple[str | None, str | None]]()
    ahead = MapAhead(loader, "v1", "cuda:0", None, lambda v, s: asked.append((v, s)))  # type: ignore[arg-type]
    ahead.start()
    loader.go.set()
    ahead.join(30)
    assert asked == [("v1", Loader.socket_path)]
    ahead.abandon(workers_keep=passed)  # passed: their prepare takes the buffer next
    assert asked[1:] == ([] if passed else [(None, None)])
