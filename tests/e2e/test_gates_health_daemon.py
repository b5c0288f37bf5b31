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


def test_an_eval_command_that_is_missing_holds_the_version_on_trial_with_a_problem_until_it_runs(
    tmp_path: Path, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    script = tmp_path / "late" / "score.py"  # not there yet: the gate cannot run
    gates = {"health": ["score"], "gate": [
        {"name": "score", "kind": "eval", "command": [str(script)], "min_score": 0.5, "interval_s": 1.0,
         "on_error": "wait", "timeout_s": 30.0}]}  # fmt: skip
    d = daemon_factory(f"sqlite:///{tmp_path / 'registry.db'}", checks={"enabled": ["manifest", "headers", "crc32c"]},
                       extra={"rollout": {"health_window_s": 0.3, "restart_rollouts": False}, "gates": gates,
                              "workers": [w.spec() for w in pool.workers]}, wait=False)  # fmt: skip
    d.watch_dir.mkdir(parents=True)
    pool.reset(publish_into(d.watch_dir, "v0", seed=0), "v0")
    d.start(timeout=90)

    def gate_problem() -> dict[str, Any] | None:
        problems = d.get("/health").json().get("problems", [])
        return next((p for p in problems if p["kind"] == "gate_cannot_run"), None)

    problem = wait_until(gate_problem, 180, 0.2, "the problem gate_cannot_run")
    assert problem["subject"] == "score" and "could not start" in problem["reason"], problem
    assert "v0 held on trial" in problem["reason"] and problem["severity"] == "warning"
    assert aliases(d.registry).get("last_good") is None  # never promoted while it cannot run
    assert {r.verdict for r in gate_rows(d, "v0") if r.kind == "eval"} == {"error"}
    status = hotswap_cli("status", "-c", str(d.config_path))
    assert "gate_cannot_run" in status.stdout + status.stderr, status.stdout

    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nprint(0.9)\n")
    script.chmod(0o755)
    wait_until(lambda: aliases(d.registry).get("last_good") == "v0", 120, 0.2, "v0 promoted once its gate ran")
    wait_until(lambda: gate_problem() is None, 60, 0.2, "the problem over")
    assert [r.verdict for r in gate_rows(d, "v0") if r.kind == "eval"][-1] == "passed"
