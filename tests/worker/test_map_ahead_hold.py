"""The worker's opened-ahead buffer (daemon.worker.map_ahead.MappedAhead) is let go when no update
took it within its hold, and an open that finishes after a newer ask is let go at once."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from support_wait import wait_until

from daemon.worker import map_ahead as module
from daemon.worker.map_ahead import MappedAhead

pytestmark = pytest.mark.quick


class Opener:
    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, opened: Any) -> bool:
        self.released.append(opened)
        return True


def test_an_opened_ahead_buffer_is_let_go_after_its_hold_and_a_late_open_after_a_newer_ask(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    opener, gates = Opener(), {"v1": threading.Event(), "v2": threading.Event(), "v3": threading.Event()}
    monkeypatch.setattr(module, "OPENER", opener)
    monkeypatch.setattr(module, "map_ahead", lambda loader, version, device: gates[version].wait(30) and version)
    events: list[tuple[str, dict[str, Any]]] = []
    ahead = MappedAhead(torch.device("cpu"), lambda name, **kw: events.append((name, kw)), hold_s=0.0)
    gates["v1"].set()
    ahead.want("v1", "/run/loader.sock")
    wait_until(lambda: ahead.version() == "v1", timeout=30, what="v1 opened ahead")
    ahead.expire()  # held past its hold (0 s here): let go
    assert ahead.version() is None and opener.released == ["v1"] and events[-1] == ("map_ahead_released", {"version": "v1", "why": "expired"})
    ahead.want("v2", "/run/loader.sock")  # its open is slow ...
    ahead.want("v3", "/run/loader.sock")  # ... and a newer version is asked for meanwhile
    gates["v3"].set()
    wait_until(lambda: ahead.version() == "v3", timeout=30, what="v3 opened ahead")
    gates["v2"].set()
    wait_until(lambda: "v2" in opener.released, timeout=30, what="the late v2 open to be let go")
    assert ahead.version() == "v3"
