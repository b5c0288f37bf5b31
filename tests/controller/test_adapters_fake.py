"""The adapter jobs (daemon/controller/adapters.py, adapter_rollout.py) in-process, against
in-memory adapter-serving workers and a real SQLite registry: each failure branch in
milliseconds. The real-process proof is test_adapters_daemon.py and test_adapters_vllm.py.

The promise: after any failure every worker serves one version of the name (the previous one, or
none when there was none), never a mix; the version is rejected with the reason, except when a
worker did not answer (then it stays verified, to be tried again).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from support_adapters import verified_row

from daemon.config import RolloutSettings, WorkerSpec
from daemon.controller.adapter_rollout import AdapterRollout
from daemon.controller.adapters import AdapterDecisions
from daemon.controller.queue import RolloutState
from daemon.controller.served import ServedVersions
from daemon.engines.base import (
    AdapterRequest,
    AdapterResult,
    Capabilities,
    ServedAdapter,
    UpdateRefused,
    WorkerUnreachable,
)
from daemon.registry import Registry
from daemon.registry.adapters import AdapterJournal
from daemon.registry.journal import Journal
from daemon.registry.models import Checkpoint, Event
from daemon.registry.status import CheckpointStatus as C
from daemon.rollout.states import WorkerHandle, WorkerSet

pytestmark = pytest.mark.quick

WINDOW = {"health_window_s": 0.6, "health_sample_s": 0.05, "health_probe_s": 0.1, "min_window_requests": 5}


class FakeAdapterWorker:
    """Serves adapters by name in memory; `refuse`, `unreachable` and `bad` make it fail."""

    capabilities = Capabilities(adapters=True, adapter_swap_atomic=True)

    def __init__(self, name: str) -> None:
        self.name = name
        self.served: dict[str, tuple[str, str]] = {}
        self.refuse: set[str] = set()  # versions it refuses to load
        self.unreachable = False
        self.bad: str | None = None  # a version whose requests fail once it serves
        self.dies_with: str | None = None  # a version under which it stops answering its counters
        self.total = self.failed = 0

    def load_adapter(self, request: AdapterRequest) -> AdapterResult:
        if self.unreachable:
            raise WorkerUnreachable(f"worker {self.name}: load adapter: no answer")
        if request.version in self.refuse:
            raise UpdateRefused(f"worker {self.name}: load adapter: lora_A shape [8, 63] != [8, 64]")
        self.served[request.name] = (request.version, request.path)
        return AdapterResult(request.name, request.version, 1.0)

    def unload_adapter(self, name: str) -> None:
        self.served.pop(name, None)

    def adapters(self) -> dict[str, ServedAdapter]:
        if self.unreachable:
            raise WorkerUnreachable(f"worker {self.name}: adapters: no answer")
        return {n: ServedAdapter(n, v, p) for n, (v, p) in self.served.items()}

    def adapter_probe(self, name: str) -> tuple[str | None, list[int]]:
        version = self.served[name][0]
        return version, [sum(map(ord, version)) % 97]

    def adapter_counters(self, name: str) -> dict[str, int] | None:
        if self.dies_with is not None and self.served.get(name, ("",))[0] == self.dies_with:
            raise WorkerUnreachable(f"worker {self.name}: adapter counters: no answer")
        if self.bad is not None and self.served.get(name, ("",))[0] == self.bad:
            self.total, self.failed = self.total + 10, self.failed + 5  # half of its requests fail
        return {"requests_total": self.total, "requests_failed": self.failed}


@pytest.fixture
def reg(db_url: str) -> Iterator[Registry]:  # SQLite, and PostgreSQL with HOTSWAP_TEST_POSTGRES_URL
    r = Registry(db_url)
    r.upgrade()
    yield r
    r.close()


def adapter(reg: Registry, tmp_path: Path, version: str, name: str = "sql") -> int:
    return verified_row(reg, tmp_path, version, name)


def rig(reg: Registry, *workers: FakeAdapterWorker, **settings: float) -> tuple[AdapterDecisions, AdapterJournal]:
    journal, aj = Journal(reg), AdapterJournal(reg)
    fleet = WorkerSet([WorkerHandle(WorkerSpec(name=w.name, url=f"http://fake/{w.name}"), w, f"http://fake/{w.name}")  # type: ignore[arg-type]
                   for w in workers])  # fmt: skip
    journal.register_workers((h.name, "builtin", h.url, "cpu") for h in fleet)
    cfg = RolloutSettings(**{"health_window_s": 0.0, **settings})  # type: ignore[arg-type]
    served = ServedVersions(journal, aj, RolloutState(), lambda _keep: None)  # only adapter aliases here
    return AdapterDecisions(journal, aj, AdapterRollout(journal, aj, fleet), cfg, interrupted=lambda: False,
                            served=served), aj  # fmt: skip


def status_of(reg: Registry, checkpoint_id: int) -> tuple[str, str]:
    with reg.session() as s:
        row = s.get(Checkpoint, checkpoint_id)
        assert row is not None
        return row.status, row.status_message or ""


def served(*workers: FakeAdapterWorker) -> set[str | None]:
    return {w.served.get("sql", (None,))[0] for w in workers}


def test_a_version_reaches_every_worker_and_replaces_the_previous_one(reg: Registry, tmp_path: Path) -> None:
    w0, w1 = FakeAdapterWorker("w0"), FakeAdapterWorker("w1")
    d, aj = rig(reg, w0, w1)
    v1 = adapter(reg, tmp_path, "sql@1")
    assert d.deploy_new(v1)["outcome"] == "succeeded" and served(w0, w1) == {"sql@1"}
    v2 = adapter(reg, tmp_path, "sql@2")
    assert d.deploy_new(v2)["outcome"] == "succeeded" and served(w0, w1) == {"sql@2"}
    assert aj.aliases() == {"sql": {"serving": "sql@2", "last_good": "sql@2"}}
    assert aj.served_by_workers() == {"w0": {"sql": "sql@2"}, "w1": {"sql": "sql@2"}}
    with reg.engine.connect() as c:  # the SQL view readers use
        rows = c.execute(text("SELECT worker, adapter, version, version_status, serving FROM worker_adapter_versions "
                              "ORDER BY worker")).all()  # fmt: skip
    assert [tuple(r) for r in rows] == [("w0", "sql", "sql@2", "deployed", "sql@2"), ("w1", "sql", "sql@2", "deployed", "sql@2")]
    assert Journal(reg).checkpoint(v1).status == C.RETIRED  # type: ignore[union-attr]


def test_a_refusal_on_the_second_worker_puts_the_first_back_and_rejects_the_version(reg: Registry, tmp_path: Path) -> None:
    w0, w1 = FakeAdapterWorker("w0"), FakeAdapterWorker("w1")
    d, aj = rig(reg, w0, w1)
    d.deploy_new(adapter(reg, tmp_path, "sql@1"))
    w1.refuse.add("sql@2")
    v2 = adapter(reg, tmp_path, "sql@2")
    out = d.deploy_new(v2)
    assert out["outcome"] == "failed" and "lora_A shape" in out["reason"]
    assert served(w0, w1) == {"sql@1"}  # w0 was moved, then put back
    ckpt = Journal(reg).checkpoint(v2)
    assert ckpt is not None and ckpt.status == C.REJECTED
    assert aj.alias("sql", "serving").version == "sql@1"  # type: ignore[union-attr]


def test_a_failure_of_a_first_version_leaves_the_name_unloaded_everywhere(reg: Registry, tmp_path: Path) -> None:
    w0, w1 = FakeAdapterWorker("w0"), FakeAdapterWorker("w1")
    d, _ = rig(reg, w0, w1)
    w1.refuse.add("sql@1")
    assert d.deploy_new(adapter(reg, tmp_path, "sql@1"))["outcome"] == "failed"
    assert served(w0, w1) == {None}


def test_an_unreachable_worker_keeps_the_version_verified_and_the_reconcile_deploys_it(reg: Registry, tmp_path: Path) -> None:
    w0, w1 = FakeAdapterWorker("w0"), FakeAdapterWorker("w1")
    d, _ = rig(reg, w0, w1)
    d.deploy_new(adapter(reg, tmp_path, "sql@1"))
    w1.unreachable = True
    v2 = adapter(reg, tmp_path, "sql@2")
    assert d.deploy_new(v2)["outcome"] == "failed"
    assert Journal(reg).checkpoint(v2).status == C.VERIFIED  # type: ignore[union-attr]  # not its fault
    assert served(w0) == {"sql@1"}
    w1.unreachable = False
    d.reconcile()
    assert served(w0, w1) == {"sql@2"} and Journal(reg).checkpoint(v2).status == C.DEPLOYED  # type: ignore[union-attr]


def test_the_health_window_of_the_adapter_rolls_it_back_on_its_error_rate(reg: Registry, tmp_path: Path) -> None:
    w0, w1 = FakeAdapterWorker("w0"), FakeAdapterWorker("w1")
    d, aj = rig(reg, w0, w1, **WINDOW)
    assert d.deploy_new(adapter(reg, tmp_path, "sql@1"))["health_window"] == "ok"
    w1.bad = "sql@2"
    v2 = adapter(reg, tmp_path, "sql@2")
    out = d.deploy_new(v2)
    assert out["health_window"] == "failed" and "worker w1 error rate" in out["reason"], out
    assert served(w0, w1) == {"sql@1"} and out["rolled_back"] == "sql@1"
    ckpt = Journal(reg).checkpoint(v2)
    assert ckpt is not None and ckpt.status == C.REJECTED
    assert aj.aliases()["sql"]["serving"] == "sql@1" == aj.aliases()["sql"]["last_good"]


def test_a_deploy_that_holds_its_window_leaves_it_open_for_the_runner_to_step(reg: Registry, tmp_path: Path) -> None:
    """The runner's adapter deploy (AdapterDeploy) returns with the window open; each `settle` is a
    step, and the version is last_good (or rolled back) only at the verdict."""
    w0, w1 = FakeAdapterWorker("w0"), FakeAdapterWorker("w1")
    d, aj = rig(reg, w0, w1, **WINDOW)
    assert d.deploy_new(adapter(reg, tmp_path, "sql@1"))["health_window"] == "ok"
    w1.bad = "sql@2"
    out = d.deploy_new(adapter(reg, tmp_path, "sql@2"), hold=True)
    assert out["health_window"] == "open" and d.window is not None
    assert aj.aliases()["sql"] == {"serving": "sql@2", "last_good": "sql@1"}  # served, not trusted yet
    steps = 1
    while (verdict := d.settle()) is None:
        steps += 1
        time.sleep(0.01)
    assert steps > 1 and verdict["health_window"] == "failed" and "worker w1 error rate" in verdict["reason"], verdict
    assert d.window is None and served(w0, w1) == {"sql@1"} and aj.aliases()["sql"]["serving"] == "sql@1"


@pytest.mark.parametrize("bad", [True, False])
def test_an_adapter_window_cut_short_is_watched_again_by_the_next_reconcile(reg: Registry, tmp_path: Path,
                                                                            bad: bool) -> None:  # fmt: skip
    """The daemon stopped (or a command cut in) inside an adapter's health window: the version
    serves but was never trusted. The next reconcile (one is queued at every start) watches it
    again: a bad version is rolled back, a good one becomes last_good; neither stays in between."""
    w0, w1 = FakeAdapterWorker("w0"), FakeAdapterWorker("w1")
    d, aj = rig(reg, w0, w1, **WINDOW)
    assert d.deploy_new(adapter(reg, tmp_path, "sql@1"))["health_window"] == "ok"
    if bad:
        w1.bad = "sql@2"
    cut = [True]
    d.health_window.interrupted = lambda: cut[0]
    v2 = adapter(reg, tmp_path, "sql@2")
    assert d.deploy_new(v2)["health_window"] == "aborted"
    assert aj.aliases()["sql"] == {"serving": "sql@2", "last_good": "sql@1"}
    cut[0] = False
    assert d.reconcile()["windows"] == {"sql": "failed" if bad else "ok"}
    now = "sql@1" if bad else "sql@2"
    assert served(w0, w1) == {now} and aj.aliases()["sql"] == {"serving": now, "last_good": now}
    ckpt = Journal(reg).checkpoint(v2)
    assert ckpt is not None and ckpt.status == (C.REJECTED if bad else C.DEPLOYED)
    assert d.reconcile()["windows"] == {}  # trusted now: nothing to watch again


def test_a_worker_that_stops_answering_in_the_window_is_not_the_adapters_fault_until_it_keeps_happening(
        reg: Registry, tmp_path: Path) -> None:  # fmt: skip
    """As for the base model: the window fails and the name goes back, but the version stays
    verified and the next reconcile deploys it again; after `max_infra_retries` such windows it is
    rejected (it may be what kills the worker). Before, the first lost worker rejected it."""
    w0, w1 = FakeAdapterWorker("w0"), FakeAdapterWorker("w1")
    d, aj = rig(reg, w0, w1, **WINDOW, max_infra_retries=1)
    submitted: list[int] = []
    d.submit = submitted.append  # the service queues an AdapterDeploy of it
    assert d.deploy_new(adapter(reg, tmp_path, "sql@1"))["health_window"] == "ok"
    w1.dies_with = "sql@2"
    v2 = adapter(reg, tmp_path, "sql@2")
    out = d.deploy_new(v2)
    assert out["health_window"] == "failed" and "did not answer" in out["reason"], out
    assert status_of(reg, v2)[0] == C.VERIFIED.value and "not the checkpoint's fault" in status_of(reg, v2)[1]
    assert served(w0, w1) == {"sql@1"} and aj.aliases()["sql"] == {"serving": "sql@1", "last_good": "sql@1"}
    assert submitted == [v2]  # deployed again after the rollback, as the base model's is
    d.deploy_new(submitted.pop())  # and it fails the same way: now it may be what kills the worker
    assert status_of(reg, v2)[0] == C.REJECTED.value and "gave up after 1 retries" in status_of(reg, v2)[1]
    assert served(w0, w1) == {"sql@1"} and submitted == []


def test_a_first_version_failing_its_health_window_is_rejected_and_unloaded_everywhere(reg: Registry, tmp_path: Path) -> None:
    w0, w1 = FakeAdapterWorker("w0"), FakeAdapterWorker("w1")
    d, aj = rig(reg, w0, w1, **WINDOW)
    w1.bad = "sql@1"
    v1 = adapter(reg, tmp_path, "sql@1")
    out = d.deploy_new(v1)
    assert (out["health_window"], out["rolled_back"], out["rollback_outcome"]) == ("failed", None, "unloaded"), out
    assert served(w0, w1) == {None} and aj.alias("sql", "serving") is None
    with reg.session() as s:
        row = s.get(Checkpoint, v1)
        assert row is not None and row.status == C.REJECTED.value
        assert row.status_message == f"adapter sql: rolled back to none after deploy: {out['reason']}"
        events = [e.detail for e in s.query(Event).filter(Event.checkpoint_id == v1, Event.to_state == "rolled_back")]
    assert events == [{"to": None, "by": "health_window", "reason": out["reason"]}]


def test_an_older_waiting_version_is_superseded_by_a_newer_one_of_the_same_name(reg: Registry, tmp_path: Path) -> None:
    w0 = FakeAdapterWorker("w0")
    d, _ = rig(reg, w0)
    v1, v2 = adapter(reg, tmp_path, "sql@1"), adapter(reg, tmp_path, "sql@2")  # both verified before either runs
    assert d.deploy_new(v1) == {"version": "sql@1", "outcome": "superseded", "by": "sql@2"}
    assert d.deploy_new(v2)["outcome"] == "succeeded" and served(w0) == {"sql@2"}
    assert Journal(reg).checkpoint(v1).status == C.SUPERSEDED  # type: ignore[union-attr]


def test_a_pinned_name_holds_new_versions_until_unpinned(reg: Registry, tmp_path: Path) -> None:
    w0 = FakeAdapterWorker("w0")
    d, aj = rig(reg, w0)
    d.deploy_new(adapter(reg, tmp_path, "sql@1"))
    d.deploy_new(adapter(reg, tmp_path, "sql@2"))
    assert served(w0) == {"sql@2"}
    assert d.pin("sql@1")["pinned"] == "sql@1" and served(w0) == {"sql@1"}
    v3 = adapter(reg, tmp_path, "sql@3")
    assert d.deploy_new(v3)["outcome"] == "waiting" and served(w0) == {"sql@1"}
    out = d.unpin("sql")
    assert out["next"] == "sql@3" and served(w0) == {"sql@3"} and aj.alias("sql", "pinned") is None


def test_who_pinned_and_unpinned_an_adapter_is_recorded(reg: Registry, tmp_path: Path) -> None:
    """As for the base model: the API token's name is in the `pinned` and `unpinned` events."""
    w0 = FakeAdapterWorker("w0")
    d, _ = rig(reg, w0)
    d.deploy_new(adapter(reg, tmp_path, "sql@1"))
    d.deploy_new(adapter(reg, tmp_path, "sql@2"))
    d.pin("sql@1", by="alice")
    d.unpin("sql", by="bob")
    with reg.session() as s:
        rows = s.execute(text("SELECT c.version, e.to_state, e.detail FROM events e JOIN checkpoints c "
                              "ON c.id = e.checkpoint_id WHERE e.to_state IN ('pinned', 'unpinned') ORDER BY e.id")).all()  # fmt: skip
    got = [(v, to, (det if isinstance(det, dict) else json.loads(det)).get("by")) for v, to, det in rows]
    assert got == [("sql@1", "pinned", "alice"), ("sql@1", "unpinned", "bob")]


def test_the_reconcile_deploys_a_verified_version_of_a_name_no_worker_serves_yet(reg: Registry, tmp_path: Path) -> None:
    """The daemon stopped after verifying a new adapter name, before its job ran: the reconcile at
    start-up (level-triggered) deploys it."""
    w0 = FakeAdapterWorker("w0")
    d, aj = rig(reg, w0)
    adapter(reg, tmp_path, "sql@1")
    assert aj.names() == [] and d.reconcile()["outcome"] == "in sync"
    assert served(w0) == {"sql@1"} and aj.alias("sql", "serving").version == "sql@1"  # type: ignore[union-attr]
