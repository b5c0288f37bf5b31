"""A verified checkpoint waiting for a newer one still in verification does not hold the runner:
operator commands queued meanwhile are answered at once, and it deploys once the newer one fails.
The service over in-process fake workers (tests/fake_worker.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_until
from fake_worker import FAKES, FakeWorkerClient, Restarts

from daemon import engines
from daemon.config import RolloutSettings, WorkerSpec
from daemon.controller.service import RolloutService
from daemon.registry import Registry, status
from daemon.registry.journal import Journal
from daemon.registry.models import Checkpoint
from daemon.registry.status import CheckpointStatus as C

pytestmark = pytest.mark.quick

FAST = {"health_window_s": 0.0, "restart_timeout_s": 2.0, "drain_timeout_s": 1.0, "rejoin_s": 0.0}
PROMPT_S = 10.0  # far under the 600 s a waiting checkpoint may wait; far over a pin of a fake worker


@pytest.fixture
def reg(tmp_path: Path) -> Iterator[Registry]:
    r = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    r.upgrade()
    yield r
    r.close()


@pytest.fixture
def svc(reg: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RolloutService]:
    monkeypatch.setitem(engines.WORKER_KINDS, "fake", "fake_worker:connect")
    FAKES["w0"] = FakeWorkerClient("w0")
    spec = WorkerSpec(name="w0", url="http://fake/w0", kind="fake")
    service = RolloutService(reg, RolloutSettings(**FAST), [spec], tmp_path, restarter=Restarts(dict(FAKES)))  # type: ignore[arg-type]
    service.start()
    assert service.wait_ready(10)
    try:
        yield service
    finally:
        service.stop()
        FAKES.clear()


def checkpoint(reg: Registry, root: Path, version: str, *moves: C) -> int:
    local = root / version
    local.mkdir()
    with reg.session() as s:
        c = status.create(s, version=version, source="t", uri=f"file://{local}", local_path=str(local),
                          commit_signal="manifest")  # fmt: skip
        assert c is not None
        c.digest, c.tensor_count = None, 21
        for to in moves:
            status.move(s, c, to)
        return c.id


def test_operator_commands_are_answered_while_a_checkpoint_waits_for_a_newer_one(
    svc: RolloutService, reg: Registry, tmp_path: Path
) -> None:
    v0 = checkpoint(reg, tmp_path, "v0", C.VERIFYING, C.VERIFIED)
    svc.journal.set_alias("serving", v0)
    svc.journal.set_alias("last_good", v0)
    v1 = checkpoint(reg, tmp_path, "v1", C.VERIFYING, C.VERIFIED)
    v2 = checkpoint(reg, tmp_path, "v2", C.VERIFYING)  # newer, still being verified: v1 waits for it
    svc.submit(v1)
    # waiting, and saying so: the waiting version is pending, and no job claims to run
    wait_until(lambda: svc.status()["pending"] == "v1" and svc.status()["current"] is None, timeout=PROMPT_S,
               what="v1 waiting in the slot with no job running")  # fmt: skip

    pinned = svc.pin("v0").result(timeout=PROMPT_S)
    assert pinned["pinned"] == "v0" and pinned["outcome"] == "succeeded", pinned
    assert svc.rollback(to="v0").result(timeout=PROMPT_S)["outcome"] == "succeeded"
    assert svc.unpin().result(timeout=PROMPT_S) == {"unpinned": "v0", "outcome": "unpinned", "next": "v1"}
    row = Journal(reg).checkpoint(v1)
    assert row is not None and row.status == C.VERIFIED and FAKES["w0"].version == "v0"  # still waiting

    with reg.session() as s:  # the newer one fails its checks: v1's wait is over on the runner's next pass
        c = s.get(Checkpoint, v2)
        assert c is not None
        status.move(s, c, C.REJECTED, "a check failed")
    wait_until(lambda: (r := svc.journal.checkpoint(v1)) is not None and r.status == C.DEPLOYED, timeout=PROMPT_S,
               what="v1 deployed")  # fmt: skip
    assert FAKES["w0"].version == "v1" and svc.status()["serving"] == "v1"


def test_a_newer_checkpoint_verified_while_it_waits_supersedes_it(
    svc: RolloutService, reg: Registry, tmp_path: Path
) -> None:
    v0 = checkpoint(reg, tmp_path, "v0", C.VERIFYING, C.VERIFIED)
    svc.journal.set_alias("serving", v0)
    svc.journal.set_alias("last_good", v0)
    v1 = checkpoint(reg, tmp_path, "v1", C.VERIFYING, C.VERIFIED)
    v2 = checkpoint(reg, tmp_path, "v2", C.VERIFYING)
    svc.submit(v1)
    wait_until(lambda: svc.status()["pending"] == "v1", timeout=PROMPT_S, what="v1 waiting")
    with reg.session() as s:
        c = s.get(Checkpoint, v2)
        assert c is not None
        status.move(s, c, C.VERIFIED)
    svc.submit(v2)  # the coordinator's on_verified
    wait_until(lambda: (r := svc.journal.checkpoint(v2)) is not None and r.status == C.DEPLOYED, timeout=PROMPT_S,
               what="v2 deployed")  # fmt: skip
    row = svc.journal.checkpoint(v1)
    assert row is not None and row.status == C.SUPERSEDED and FAKES["w0"].version == "v2"
