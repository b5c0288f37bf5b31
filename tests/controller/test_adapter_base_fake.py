"""Holding adapters to the base before workers take it (daemon/controller/adapter_base.py,
`prepare` then `rebase`), in-process against in-memory adapter-serving workers and a real SQLite
registry. `checks.adapter_on_base_change = "unload"` decides without running a canary, so each
branch runs in milliseconds; the real-process proof (re-verify with the forward canary, and the
order of events against the base's rollout) is tests/e2e/test_adapters_base.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support_adapters import verified_row

from daemon.checks import CheckSettings
from daemon.config import RolloutSettings, WorkerSpec
from daemon.controller.adapter_rollout import AdapterRollout
from daemon.controller.adapters import AdapterDecisions
from daemon.controller.queue import RolloutState
from daemon.controller.served import ServedVersions
from daemon.engines.base import AdapterRequest, AdapterResult, Capabilities, ServedAdapter
from daemon.registry import Registry
from daemon.registry.adapters import AdapterJournal
from daemon.registry.journal import Journal
from daemon.registry.status import CheckpointStatus as C
from daemon.rollout.states import WorkerHandle, WorkerSet

pytestmark = pytest.mark.quick


class Worker:
    capabilities = Capabilities(adapters=True, adapter_swap_atomic=True)

    def __init__(self, name: str) -> None:
        self.name = name
        self.served: dict[str, tuple[str, str]] = {}

    def load_adapter(self, request: AdapterRequest) -> AdapterResult:
        self.served[request.name] = (request.version, request.path)
        return AdapterResult(request.name, request.version, 1.0)

    def unload_adapter(self, name: str) -> None:
        self.served.pop(name, None)

    def adapters(self) -> dict[str, ServedAdapter]:
        return {n: ServedAdapter(n, v, p) for n, (v, p) in self.served.items()}

    def adapter_probe(self, name: str) -> tuple[str | None, list[int]]:
        return self.served[name][0], [1]

    def adapter_counters(self, name: str) -> dict[str, int] | None:
        return {"requests_total": 0, "requests_failed": 0}


@pytest.fixture
def rig(registry: Registry, tmp_path: Path) -> tuple[AdapterDecisions, Journal, AdapterJournal, list[Worker], dict[str, int]]:
    reg = registry
    journal, aj = Journal(reg), AdapterJournal(reg)
    workers = [Worker("w0"), Worker("w1")]
    fleet = WorkerSet([WorkerHandle(WorkerSpec(name=w.name, url=f"http://fake/{w.name}"), w, f"http://fake/{w.name}")  # type: ignore[arg-type]
                       for w in workers])  # fmt: skip
    journal.register_workers((h.name, "builtin", h.url, "cpu") for h in fleet)
    served = ServedVersions(journal, aj, RolloutState(), lambda _keep: None)
    d = AdapterDecisions(journal, aj, AdapterRollout(journal, aj, fleet), RolloutSettings(health_window_s=0.0),
                         interrupted=lambda: False, served=served,
                         checks=CheckSettings(adapter_on_base_change="unload"))  # fmt: skip
    ids = {v: verified_row(reg, tmp_path, v) for v in ("b0", "b1")}
    journal.set_alias("serving", ids["b0"])
    ids["sql@1"] = verified_row(reg, tmp_path, "sql@1", "sql")
    aj.record_base_verified(ids["sql@1"], "b0", None, {})
    assert d.deploy_new(ids["sql@1"])["outcome"] == "succeeded"
    assert {w.served["sql"][0] for w in workers} == {"sql@1"}
    return d, journal, aj, workers, ids


Rig = tuple[AdapterDecisions, Journal, AdapterJournal, list[Worker], dict[str, int]]


def ref(journal: Journal, version: str):  # type: ignore[no-untyped-def]
    r = journal.checkpoint_by_version(version)
    assert r is not None
    return r


def test_an_adapter_that_does_not_fit_the_coming_base_is_off_every_worker_before_any_worker_takes_it(rig: Rig) -> None:
    d, journal, aj, workers, ids = rig
    d.binding.prepare(ref(journal, "b1"))
    assert [w.served for w in workers] == [{}, {}]  # unloaded before the base's first worker moves
    assert aj.aliases().get("sql", {}).get("serving") is None
    assert journal.checkpoint(ids["sql@1"]).status == C.RETIRED  # type: ignore[union-attr]
    assert [k for k, _ in d.binding.problems()] == ["sql"]
    journal.set_alias("serving", ids["b1"])  # the base's rollout succeeded
    assert d.binding.rebase() == {"sql": "unloaded"}  # no version of sql was verified on b1
    assert [w.served for w in workers] == [{}, {}] and not aj.aliases().get("sql")  # no serving, no last_good


def test_an_adapter_unloaded_for_a_base_that_never_came_serves_again_on_the_base_that_does(rig: Rig) -> None:
    d, journal, aj, workers, ids = rig
    d.binding.prepare(ref(journal, "b1"))
    assert [w.served for w in workers] == [{}, {}]
    # the base's rollout failed: b0 still serves, and sql@1 was verified on b0
    assert d.binding.rebase() == {"sql": "loaded again"}
    assert {w.served["sql"][0] for w in workers} == {"sql@1"}
    assert aj.aliases()["sql"] == {"serving": "sql@1", "last_good": "sql@1"}
    assert journal.checkpoint(ids["sql@1"]).status == C.DEPLOYED  # type: ignore[union-attr]
    assert d.binding.problems() == []
    assert d.binding.rebase() == {}  # nothing left to do: level, not an edge replayed


def test_an_adapter_already_verified_on_the_coming_base_is_left_alone(rig: Rig) -> None:
    d, journal, aj, workers, ids = rig
    aj.record_base_verified(ids["sql@1"], "b1", None, {})
    d.binding.prepare(ref(journal, "b1"))
    journal.set_alias("serving", ids["b1"])
    assert d.binding.rebase() == {}
    assert {w.served["sql"][0] for w in workers} == {"sql@1"} and d.binding.problems() == []
