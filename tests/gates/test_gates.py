"""Gates one by one (daemon.gates): eval commands run for real (scores, a hang killed at its
timeout, a missing command), a prometheus gate whose Prometheus is down, the runner's limits and
`on_error`, and every measurement written to `gate_runs` (SQLite, and PostgreSQL when given).
The gates inside real daemons and a real Prometheus: tests/e2e/test_gates_daemons.py."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import make_config_file
from sqlalchemy import text
from support_wait import free_port, wait_until

from daemon.config import ConfigError, load_config
from daemon.gates.base import Condition, Trial
from daemon.gates.evalcmd import EvalGate
from daemon.gates.prometheus import PrometheusGate, fill
from daemon.gates.runner import GateRunner
from daemon.gates.settings import GateSettings, GateSpec
from daemon.registry import Registry
from daemon.registry.gate_runs import last_good_score, runs_of
from daemon.registry.journal import Journal
from daemon.registry.models import Checkpoint

SCORE_PY = "import os, json; print('evaluating', os.environ['HOTSWAP_VERSION']); print(json.dumps({'score': float(os.environ['SCORE'])}))"


def trial(ckpt_id: int = 1, previous: tuple[str, float] | None = None, host: str = "h1") -> Trial:
    return Trial(ckpt_id, "v2", "/models/v2", host, 0, (("w0", "http://127.0.0.1:9"),), lambda _g: previous)


def eval_spec(score: float | str, **kw: Any) -> GateSpec:
    return GateSpec(name="score", kind="eval", command=[sys.executable, "-c", SCORE_PY], env={"SCORE": str(score)},
                    **({"max_drop": 0.0} | kw))  # fmt: skip


def test_conditions_hold_as_written() -> None:
    assert Condition.parse("< 0.01").holds(0.001) and not Condition.parse("<0.01").holds(0.01)
    assert Condition.parse(">= 2").holds(2) and str(Condition.parse("!= 1e3")) == "!= 1000"
    with pytest.raises(ValueError, match="operator and a number"):
        Condition.parse("below 3")
    assert fill('x{host="{host}",v="{version}"}', host='a"b', version="v1") == 'x{host="a\\"b",v="v1"}'


def test_an_eval_scoring_below_the_last_good_score_fails_and_a_higher_one_passes() -> None:
    low = EvalGate(eval_spec(0.6)).measure(trial(previous=("v1", 0.7)))[0]
    assert low.verdict == "failed" and low.value == 0.6, low
    assert "below >= 0.7 (last good v1 scored 0.7" in low.reason
    assert "evaluating v2" in (low.output or "")  # the stdout tail is kept
    high = EvalGate(eval_spec(0.8)).measure(trial(previous=("v1", 0.7)))[0]
    assert high.verdict == "passed" and high.value == 0.8, high
    first = EvalGate(eval_spec(0.1)).measure(trial(previous=None))[0]  # no baseline yet: nothing to drop from
    assert first.verdict == "passed" and first.condition == "no last good score yet"
    floor = EvalGate(eval_spec(0.1, min_score=0.5)).measure(trial(previous=None))[0]
    assert floor.verdict == "failed" and ">= 0.5" in floor.condition


def test_an_eval_that_exits_non_zero_or_prints_no_score_fails() -> None:
    bad = GateSpec(name="s", kind="eval", command=[sys.executable, "-c", "import sys; print('{\"score\": 9}'); "
                                                   "print('boom', file=sys.stderr); sys.exit(3)"], min_score=0)  # fmt: skip
    m = EvalGate(bad).measure(trial())[0]
    assert (m.verdict, m.value, m.reason) == ("failed", 9.0, "exited with status 3") and "boom" in (m.output or "")
    none = GateSpec(name="s", kind="eval", command=[sys.executable, "-c", "print('fine')"], min_score=0)
    assert "no score on stdout" in EvalGate(none).measure(trial())[0].reason


def test_an_eval_that_hangs_is_killed_with_its_children_at_its_timeout(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    hang = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(pidfile)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(600)")  # fmt: skip
    spec = GateSpec(name="hang", kind="eval", command=[sys.executable, "-c", hang], timeout_s=2.0, min_score=0)
    m = EvalGate(spec).measure(trial())[0]
    assert m.verdict == "failed" and m.reason == "killed at its timeout (2 s)", m
    assert "started" in (m.output or "")
    child = int(pidfile.read_text())
    wait_until(lambda: not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2],
               10, 0.05, "the eval's child killed with it")  # fmt: skip


def test_a_missing_command_is_an_error_not_a_verdict() -> None:
    spec = GateSpec(name="s", kind="eval", command=["/nonexistent/score"], min_score=0)
    m = EvalGate(spec).measure(trial())[0]
    assert m.verdict == "error" and "could not start" in m.reason


def test_the_eval_environment_carries_the_trial_and_not_the_daemons_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cret")
    env = EvalGate(eval_spec(1)).environment(trial())
    assert env["HOTSWAP_WORKER_URL"] == "http://127.0.0.1:9" and env["HOTSWAP_VERSION_DIR"] == "/models/v2"
    assert env["SCORE"] == "1" and "AWS_SECRET_ACCESS_KEY" not in env


def test_prometheus_down_is_an_error() -> None:
    spec = GateSpec(name="p", kind="prometheus", query="up", condition="> 0", timeout_s=2)
    (m,) = PrometheusGate(spec, f"http://127.0.0.1:{free_port()}").measure(trial())
    assert m.verdict == "error" and "did not answer" in m.reason


def _version(reg: Registry, version: str) -> int:
    with reg.session() as s:
        c = Checkpoint(version=version, source="t", uri=f"u/{version}", status="verified")
        s.add(c)
        s.flush()
        return c.id


def test_the_runner_records_every_measurement_and_fails_past_the_failure_limit(registry: Registry) -> None:
    v1, v2 = _version(registry, "v1"), _version(registry, "v2")
    settings = GateSettings(gate=[eval_spec(0.9, count=3, interval_s=0.0, failure_limit=1)])
    runner = GateRunner(registry, settings)
    (ok,) = runner.run(settings.gate, trial(v1, host=registry.host), lambda: False)
    assert ok.verdict == "passed", ok
    Journal(registry).set_alias("last_good", v1)
    with registry.session() as s:
        assert last_good_score(s, registry.host, "score") == ("v1", 0.9)
    low = GateSettings(gate=[eval_spec(0.5, count=3, interval_s=0.0, failure_limit=1)])
    t = Trial(v2, "v2", "", registry.host, 1, (), runner.previous_score)
    (bad,) = GateRunner(registry, low).run(low.gate, t, lambda: False)
    assert bad.verdict == "failed" and "2 of 2 measurements failed, failure_limit 1" in bad.reason, bad
    with registry.session() as s:
        rows = runs_of(s, v2)
        halted = s.execute(text("SELECT gate, host, stage, verdict, value FROM why_halted WHERE version = 'v2'")).all()
    assert [(r["measurement"], r["verdict"]) for r in rows] == [(1, "failed"), (2, "failed")]
    assert rows[0]["condition"].startswith(">= 0.9 (last good v1") and rows[0]["stage"] == 1
    assert [tuple(h) for h in halted] == [("score", registry.host, 1, "failed", 0.5)] * 2


def test_a_gate_that_cannot_run_halts_or_waits_with_a_problem_never_passes(registry: Registry) -> None:
    v = _version(registry, "v1")
    down = f"http://127.0.0.1:{free_port()}"
    halt = GateSpec(name="p", kind="prometheus", query="up", condition="> 0", on_error="halt", timeout_s=1)
    settings = GateSettings(prometheus_url=down, gate=[halt])
    (v_halt,) = GateRunner(registry, settings).run([halt], trial(v, host=registry.host), lambda: False)
    assert v_halt.verdict == "failed" and "could not run" in v_halt.reason and "on_error = halt" in v_halt.reason
    wait = GateSpec(name="p", kind="prometheus", query="up", condition="> 0", on_error="wait", timeout_s=1,
                    interval_s=0.2)  # fmt: skip
    runner = GateRunner(registry, GateSettings(prometheus_url=down, gate=[wait]))
    stop = threading.Event()
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.extend(runner.run([wait], trial(v, host=registry.host), stop.is_set)))
    th.start()
    (name, why), = wait_until(runner.problems, 30, 0.05, "the problem gate_cannot_run")
    assert name == "p" and "did not answer" in why and "held on trial" in why
    stop.set()
    th.join(30)
    assert out[0].verdict == "aborted" and runner.problems() == []
    with registry.session() as s:
        assert {r["verdict"] for r in runs_of(s, v)} == {"error"}


def test_an_inconclusive_gate_ends_as_configured(registry: Registry) -> None:
    v = _version(registry, "v1")
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Empty(BaseHTTPRequestHandler):  # a Prometheus with no series for the query
        def do_GET(self) -> None:  # noqa: N802
            body = b'{"status":"success","data":{"resultType":"vector","result":[]}}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_a: Any) -> None:
            pass

    srv = HTTPServer(("127.0.0.1", 0), Empty)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_port}"
        for outcome, verdict in (("fail", "failed"), ("pass", "passed")):
            g = GateSpec(name=f"nodata-{outcome}", kind="prometheus", query="x", condition="< 1", count=3,
                         interval_s=0, inconclusive_limit=1, on_inconclusive=outcome)  # type: ignore[arg-type]  # fmt: skip
            (r,) = GateRunner(registry, GateSettings(prometheus_url=url, gate=[g])).run([g], trial(v, host=registry.host),
                                                                                      lambda: False)  # fmt: skip
            assert r.verdict == verdict and "2 of 2 measurements inconclusive" in r.reason, r
    finally:
        srv.shutdown()


def test_config_names_the_key_of_a_bad_gate(tmp_path: Path) -> None:
    good = {"prometheus_url": "http://127.0.0.1:9090", "health": ["errs"],
            "gate": [{"name": "errs", "kind": "prometheus", "query": "up", "condition": "< 1"}]}  # fmt: skip
    cfg = load_config(make_config_file(tmp_path / "a.toml", gates=good))
    assert cfg.gates.gate[0].condition == "< 1" and cfg.gates.health == ["errs"]
    cases = [
        ({**good, "gate": [{"name": "errs", "kind": "prometheus", "query": "up", "condition": "small"}]},
         "gates.gate[0].condition"),
        ({**good, "health": ["nope"]}, "gates.health: no gate named 'nope'"),
        ({"gate": [{"name": "e", "kind": "eval", "command": ["x"]}]}, "needs min_score, max_drop or both"),
        ({"gate": [{"name": "e", "kind": "prometheus", "query": "up", "condition": "< 1"}]}, "gates.prometheus_url"),
    ]  # fmt: skip
    for table, message in cases:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_config(make_config_file(tmp_path / "b.toml", gates=table))
    with pytest.raises(ConfigError, match=r"fleet.stages\[0\].gates: no gate named 'other'"):
        load_config(make_config_file(tmp_path / "c.toml", gates=good, database={"url": "postgresql+psycopg://x@h/d"},
                                     fleet={"enabled": True, "stages": [{"hosts": 1, "gates": ["other"]}]}))  # fmt: skip

