"""The daemon's post-check uses the probe the worker ran itself at the end of its update (no
generation round trip while requests are held); workers whose answer has none are probed as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fake_worker import FakeWorkerClient
from support_rollout import worker_events

from daemon.engines.base import UpdateRequest, UpdateResult
from daemon.registry import Registry
from daemon.registry.status import RolloutOutcome
from tests.rollout.test_rollout_fake import reg, rig, verified  # noqa: F401 - reg is a fixture

pytestmark = pytest.mark.quick


class ProbingFake(FakeWorkerClient):
    """Answers updates as the reference worker does: with its own probe under the new weights."""

    def __init__(self, name: str, probe: dict[str, Any] | None = None) -> None:
        super().__init__(name)
        self.probe_override = probe
        self.http_probes = 0

    def update(self, request: UpdateRequest) -> UpdateResult:
        result = super().update(request)
        result.detail["probe"] = self.probe_override or {"weight_version": request.version, "finite": True,
                                                         "token_ids": [5]}  # fmt: skip
        return result

    def probe(self) -> str:
        self.http_probes += 1
        return super().probe()


def test_post_check_takes_the_workers_own_probe_and_sends_none(reg: Registry, tmp_path: Path) -> None:  # noqa: F811
    w0, plain = ProbingFake("w0"), FakeWorkerClient("w1")
    r = rig(reg, tmp_path, w0, plain, mode="pause")
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    res = r.deploy(v1, v0)
    assert res.outcome == RolloutOutcome.SUCCEEDED and r.on() == {("RUNNING", "v1")}
    assert w0.http_probes == 0 and "probe" not in w0.calls
    assert "probe" in plain.calls  # an engine whose update answer has no probe is probed as before
    done = {e["worker"]: e["detail"] for e in worker_events(reg, res.rollout_id) if e["to"] == "RUNNING"}
    assert done["w0"]["probe_by"] == "worker" and done["w0"]["probe_version"] == "v1"
    assert done["w1"]["probe_by"] == "daemon"


def test_a_non_finite_in_worker_probe_fails_the_post_check_and_restores(reg: Registry, tmp_path: Path) -> None:  # noqa: F811
    w0 = ProbingFake("w0", probe={"weight_version": "v1", "finite": False, "token_ids": [0]})
    r = rig(reg, tmp_path, w0, mode="pause")
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    res = r.deploy(v1, v0)
    assert res.outcome == RolloutOutcome.FAILED and r.on() == {("RUNNING", "v0")}
    failed = [e for e in worker_events(reg, res.rollout_id) if e["to"] == "UNHEALTHY"]
    assert failed and failed[0]["detail"]["step"] == "post_check" and "non-finite" in failed[0]["detail"]["error"]


def test_an_in_worker_probe_under_another_version_is_a_mismatch(reg: Registry, tmp_path: Path) -> None:  # noqa: F811
    w0 = ProbingFake("w0", probe={"weight_version": "v0", "finite": True, "token_ids": [1]})
    r = rig(reg, tmp_path, w0, mode="pause")
    v0, v1 = verified(reg, "v0"), verified(reg, "v1")
    res = r.deploy(v1, v0)
    assert res.outcome == RolloutOutcome.FAILED and res.kind.value == "mismatch"
    assert r.on() == {("RUNNING", "v0")}
