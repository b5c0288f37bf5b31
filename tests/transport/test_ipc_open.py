"""The worker's buffer cache (daemon.transport.ipc_open.IpcOpener): a buffer is mapped outside the
cache's lock, so an open ahead of the next version (map_ahead, ~80 ms for 8B over CUDA IPC) never
holds up the open of another version, and never twice at once: a second open of the same buffer
waits for the first and shares its mapping."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from support_wait import wait_until

from daemon.handoff import BufferRef, Descriptor, TensorSlot
from daemon.transport import ipc_open
from daemon.transport.ipc_open import IpcOpener

pytestmark = pytest.mark.quick


class SlowMaps:
    """Stands in for the mapping: each buffer's map waits for its gate, and is counted."""

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}
        self.maps: list[str] = []

    def __call__(self, desc: Descriptor, buf: BufferRef) -> Any:
        assert buf.path is not None
        self.maps.append(buf.path)
        self.started.setdefault(buf.path, threading.Event()).set()
        assert self.gates.setdefault(buf.path, threading.Event()).wait(30)
        return _Mapping()


class _Mapping:
    def tensor(self) -> torch.Tensor:
        return torch.zeros(64, dtype=torch.uint8)

    def close(self) -> bool:
        return True


def _desc(version: str) -> tuple[Descriptor, BufferRef]:
    buf = BufferRef("host", 64, 0, path=f"/dev/shm/{version}")
    return Descriptor(version, "shm", 64, (TensorSlot("w", "F32", (16,), 0, 64),), (buf,)), buf


def test_a_slow_map_holds_up_no_other_buffer_and_a_second_open_of_it_shares_the_first(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    maps = SlowMaps()
    monkeypatch.setattr(ipc_open, "_map_buffer", maps)
    opener = IpcOpener()
    got: dict[str, Any] = {}
    ahead = threading.Thread(target=lambda: got.setdefault("ahead", opener.open(*_desc("v2"))))
    ahead.start()
    assert maps.started.setdefault("/dev/shm/v2", threading.Event()).wait(30)  # v2 is being mapped
    maps.gates["/dev/shm/v1"] = threading.Event()
    maps.gates["/dev/shm/v1"].set()
    v1 = opener.open(*_desc("v1"))  # not held up by v2's map
    assert v1.version == "v1" and "ahead" not in got
    second = threading.Thread(target=lambda: got.setdefault("second", opener.open(*_desc("v2"))))
    second.start()
    opening = opener._opening[("v2", "/dev/shm/v2")]
    wait_until(lambda: len(opening._cond._waiters) > 0, timeout=30, what="the second open to wait for the first")  # type: ignore[attr-defined]
    maps.gates["/dev/shm/v2"].set()
    ahead.join(30)
    second.join(30)
    assert got["ahead"] is got["second"] and got["ahead"].refs == 2
    assert maps.maps.count("/dev/shm/v2") == 1  # mapped once
    assert opener.open_versions() == {"v1": 1, "v2": 2}
