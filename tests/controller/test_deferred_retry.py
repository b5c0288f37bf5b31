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


def _processed(registry, tmp_path: Path, settings: CheckSettings) -> Coordinator:
    """step-1 published, registered and through the checks once."""
    ckpt_dir = tmp_path / "step-1"
    publish_tiny(ckpt_dir, seed=1, version="step-1")
    coordinator = Coordinator(registry, settings)
    ckpt_id = coordinator.register(
        DiscoveredCheckpoint("test", ckpt_dir, "step-1", "manifest", str(ckpt_dir), datetime.now(UTC))
    )
    assert ckpt_id is not None
    coordinator.process(ckpt_id)
    return coordinator


def test_deferred_checkpoint_is_verified_once_memory_frees(registry, tmp_path: Path) -> None:
    # a factor no host can satisfy stands in for "not enough RAM right now"
    settings = CheckSettings(enabled=("manifest", "headers", "headroom"), headroom_factor=1e15)
    coordinator = _processed(registry, tmp_path, settings)
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


def test_a_check_that_runs_out_of_gpu_memory_defers_the_version_instead_of_rejecting_it(
    registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen on an 80 GB H100 (2026-12-07): the forward canary could not get 1 GB because the workers'
    read-ahead buffers held the GPU, and a good version was rejected for it. Out of memory is the
    host's state: the version is deferred, retried once headroom passes, and then verified. The
    canary's fallback (build the whole model) is not tried on out of memory: it would need more."""
    import torch

    from daemon.checks import forward

    calls = {"canary": 0, "build": 0}
    real_canary, real_build = forward._canary_logits, forward.build_model

    def canary(*a: object, **kw: object) -> object:
        calls["canary"] += 1
        if calls["canary"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1002.00 MiB")
        return real_canary(*a, **kw)  # type: ignore[arg-type]

    def build(*a: object, **kw: object) -> object:
        calls["build"] += 1
        return real_build(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(forward, "_canary_logits", canary)
    monkeypatch.setattr(forward, "build_model", build)
    settings = CheckSettings(enabled=("manifest", "headers", "crc32c", "headroom", "forward"), isolate_checks=False)
    coordinator = _processed(registry, tmp_path, settings)
    status, message = _status(registry, "step-1")
    assert status == "deferred", (status, message)
    assert message is not None and "forward check ran out of memory (OutOfMemoryError: CUDA out of memory" in message
    assert calls == {"canary": 1, "build": 0}

    assert coordinator.retry_deferred() == ["step-1"]  # headroom passes: back through every check
    coordinator.process(coordinator._queue.get_nowait())
    assert _status(registry, "step-1") == ("verified", None)


def test_the_check_process_answers_out_of_memory_as_deferred_and_other_faults_as_crashes() -> None:
    import torch

    from daemon.checks.isolation import crash_answer

    kind, (reason, detail, deferred) = crash_answer("forward", torch.OutOfMemoryError("CUDA out of memory."))
    assert (kind, deferred, detail) == ("failed", True, {"out_of_memory": True})
    assert reason.startswith("forward check ran out of memory (OutOfMemoryError: CUDA out of memory.)")
    assert crash_answer("forward", MemoryError())[0] == "failed"
    assert crash_answer("forward", ValueError("a bug")) == ("crashed", "ValueError: a bug")


def test_any_check_out_of_memory_in_the_daemon_defers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from daemon.checks import run_checks
    from daemon.checks import runner as runner_module

    real = runner_module._run_one

    def run_one(name: str, *a: object) -> object:
        if name == "finite":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(name, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(runner_module, "_run_one", run_one)
    ckpt_dir = tmp_path / "v"
    publish_tiny(ckpt_dir, seed=1, version="v")
    report = run_checks(ckpt_dir, CheckSettings(enabled=("manifest", "headers", "crc32c", "finite"), isolate_checks=False))
    assert not report.ok and report.deferred
    assert report.results[-1].status == "deferred"
    assert report.reason is not None and report.reason.startswith("finite: finite check ran out of memory")


def test_a_version_out_of_memory_three_times_in_a_row_is_rejected_and_reverify_starts_the_count_over(
    registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version whose own config asks the forward check for more memory than the device has would
    otherwise be deferred for ever, read and hashed again every `deferred_retry_s`."""
    import torch

    from daemon.checks import forward
    from daemon.pipeline.deferrals import OUT_OF_MEMORY_ATTEMPTS

    def canary(*a: object, **kw: object) -> object:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 900.00 GiB")

    monkeypatch.setattr(forward, "_canary_logits", canary)
    settings = CheckSettings(enabled=("manifest", "headers", "crc32c", "headroom", "forward"), isolate_checks=False)
    coordinator = _processed(registry, tmp_path, settings)
    for _ in range(OUT_OF_MEMORY_ATTEMPTS - 2):
        assert _status(registry, "step-1")[0] == "deferred"
        assert coordinator.retry_deferred() == ["step-1"]
        coordinator.process(coordinator._queue.get_nowait())
    assert _status(registry, "step-1")[0] == "deferred"  # the second in a row
    assert coordinator.retry_deferred() == ["step-1"]
    coordinator.process(coordinator._queue.get_nowait())
    status, message = _status(registry, "step-1")
    assert status == "rejected" and message is not None, (status, message)
    assert f"out of memory on {OUT_OF_MEMORY_ATTEMPTS} attempts in a row: rejected" in message
    assert coordinator.retry_deferred() == []  # rejected: no longer retried

    coordinator.reverify("step-1")  # an operator's retry: a fresh count
    coordinator.process(coordinator._queue.get_nowait())
    assert _status(registry, "step-1")[0] == "deferred"
