"""The coordinator's rebuild step holds no registry session while it rebuilds (seconds for an 8B
version): on PostgreSQL an open transaction that long is a connection idle in transaction, and
through PgBouncer a server connection the whole fleet shares. In-process, on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import publish_tiny
from fake_source import FakeSource, FakeSourceConfig
from support_delta import step

from daemon.checks import CheckSettings
from daemon.client import publish_delta
from daemon.delta.anchors import AnchorRule
from daemon.pipeline import deltas
from daemon.pipeline.coordinator import Coordinator
from daemon.registry import Registry
from daemon.registry.journal import Journal
from daemon.registry.status import CheckpointStatus as C

CHEAP = CheckSettings(enabled=("manifest", "headers", "crc32c"))


def test_the_rebuild_runs_with_no_registry_connection_held(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    publish_tiny(store / "v1", seed=1, version="v1")
    step(store / "v1", tmp_path / "trainer" / "v2", 1e-4, 2)  # the trainer's full v2; only its delta is offered
    publish_delta(tmp_path / "trainer" / "v2", store / "v1", store / "v2", rule=AnchorRule(share=100.0))
    src = FakeSource(FakeSourceConfig(store=str(store)), emit=lambda item: None)
    coord = Coordinator(registry, CHEAP, sources={src.label: src})
    coord.delta_dir = tmp_path / "deltas"
    src.emit = coord.intake
    held: list[int] = []
    real = deltas.rebuild_delta

    def watched(*args: Any, **kwargs: Any) -> Any:
        held.append(registry.engine.pool.checkedout())  # connections out of the pool right now
        return real(*args, **kwargs)

    monkeypatch.setattr(deltas, "rebuild_delta", watched)
    for version in ("v1", "v2"):
        src.offer(version)
        coord.process(coord._queue.get_nowait())
    journal = Journal(registry)
    row = journal.checkpoint_by_version("v2")
    assert row is not None and row.status == C.VERIFIED, row
    assert row.local_path == str(tmp_path / "deltas" / "v2")
    assert held == [0], f"the rebuild ran with {held} registry connections checked out"
