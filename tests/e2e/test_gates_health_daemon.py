"""An eval gate in a single host's health window (`[gates] health`), with a real daemon and worker:
a version scoring above the last good one is promoted (last_good), one scoring below is rolled
back and rejected, and one whose command hangs is killed at its timeout, fails, and is rolled
back too; every verdict is a gate_runs row (and `hotswap show` prints it). The fleet stages:
tests/e2e/test_gates_daemons.py."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, hotswap_cli
from support_rollout import WorkerPool, aliases, publish_into, start_fleet
from support_wait import wait_until

pytestmark = pytest.mark.timeout(600)

EVAL_PY = """
import json, os, time
score = json.load(open(os.environ["SCORES"]))[os.environ["HOTSWAP_VERSION"]]
if score == "hang":
    print("hanging", flush=True)
    time.sleep(3600)
print(json.dumps({"score": score}))
"""


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path / "pool", n=1)
    yield p
    p.close()


def gate_rows(d: DaemonProcess, version: str) -> list[Any]:
    from sqlalchemy import text

    with d.registry.engine.connect() as c:
        return list(c.execute(text("SELECT g.gate, g.kind, g.verdict, g.value, g.reason, g.output FROM gate_runs g "
                                   "JOIN checkpoints c ON c.id = g.checkpoint_id WHERE c.version = :v ORDER BY g.id"),
                              {"v": version}))  # fmt: skip


def test_an_eval_gate_promotes_a_higher_score_and_rolls_back_a_lower_one_or_a_hang(
    tmp_path: Path, db_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    (tmp_path / "eval.py").write_text(EVAL_PY)
    (tmp_path / "scores.json").write_text(json.dumps({"v0": 0.5, "v1": 0.6, "v2": 0.4, "v3": "hang"}))
    gates = {"health": ["score"], "gate": [
        {"name": "score", "kind": "eval", "command": [sys.executable, str(tmp_path / "eval.py")], "max_drop": 0.0,
         "timeout_s": 5.0, "env": {"SCORES": str(tmp_path / "scores.json")}}]}  # fmt: skip
    d = start_fleet(daemon_factory, db_url, pool, rollout={"health_window_s": 0.3, "restart_rollouts": False},
                    checks={"enabled": ["manifest", "headers", "crc32c"]}, extra={"gates": gates})  # fmt: skip
    assert [(r.gate, r.verdict, r.value) for r in gate_rows(d, "v0") if r.kind == "eval"] == [("score", "passed", 0.5)]

    publish_into(d.watch_dir, "v1", seed=1)
    wait_until(lambda: aliases(d.registry).get("last_good") == "v1", 180, 0.1, "v1 promoted (0.6 > 0.5)")

    publish_into(d.watch_dir, "v2", seed=2)
    row = d.wait_status("v2", "rejected", timeout=180)
    assert "gate score failed: score 0.4 is below >= 0.6 (last good v1 scored 0.6" in row["status_message"], row
    wait_until(lambda: aliases(d.registry) == {"serving": "v1", "last_good": "v1"}, 120, 0.1, "back on v1")
    pool.workers[0].wait_running(60, version="v1")

    publish_into(d.watch_dir, "v3", seed=3)
    row = d.wait_status("v3", "rejected", timeout=180)
    assert "gate score failed: killed at its timeout (5 s)" in row["status_message"], row
    wait_until(lambda: aliases(d.registry) == {"serving": "v1", "last_good": "v1"}, 120, 0.1, "back on v1")
    (hang,) = [r for r in gate_rows(d, "v3") if r.kind == "eval"]
    assert hang.verdict == "failed" and "hanging" in hang.output
    builtin = {r.gate for r in gate_rows(d, "v1") if r.kind == "builtin"}
    assert "error_rate" in builtin, builtin

    out = hotswap_cli("show", "v2", "-c", str(d.config_path))
    assert out.returncode == 0, out.stderr
    assert "score (eval) on" in out.stdout and "failed, 1 failed; last value 0.4" in out.stdout, out.stdout
