"""A checkpoint deferred for lack of memory is retried, not lost, once headroom returns."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from conftest import publish_tiny

from daemon.checks import CheckSettings
from daemon.pipeline.coordinator import Coordinator
from daemon.registry import queries as q
from daemon.sources.commit import DiscoveredCheckpoint

pytestmark = pytest.mark.quick


def _status(registry, version: str) -> tuple[str, str | None]:
    with registry.session() as s:
        ckpt = q.get_checkpoint(s, version)
        assert ckpt is not None
        return ckpt.status, ckpt.status_message


def test_deferred_checkpoint_is_verified_once_memory_frees(registry, tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "step-1"
    publish_tiny(ckpt_dir, seed=1, version="step-1")
    # a factor no host can satisfy stands in for "not enough RAM right now"
    settings = CheckSettings(enabled=("manifest", "headers", "headroom"), headroom_factor=1e15)
    coordinator = Coordinator(registry, settings)
    ckpt_id = coordinator.register(
        DiscoveredCheckpoint("test", ckpt_dir, "step-1", "manifest", str(ckpt_dir), datetime.now(UTC))
    )
    assert ckpt_id is not None
    coordinator.process(ckpt_id)
    status, message = _status(registry, "step-1")
    assert status == "deferred"
    assert message is not None and "host RAM available" in message

    assert coordinator.retry_deferred() == []  # still no room: stays deferred, nothing queued
    assert _status(registry, "step-1")[0] == "deferred"

    settings.headroom_factor = 1.5  # memory frees
    assert coordinator.retry_deferred() == ["step-1"]
    assert _status(registry, "step-1")[0] == "discovered"
    coordinator.process(coordinator._queue.get_nowait())
    assert _status(registry, "step-1") == ("verified", None)
