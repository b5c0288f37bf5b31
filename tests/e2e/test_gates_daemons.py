"""Gates with three real daemons on PostgreSQL (three hosts, each with its own real worker), a real
Prometheus (Debian's binary, on loopback) scraping the daemons and the workers, and a real eval
command scoring the canary's worker (daemon.gates; gate by gate: tests/gates/test_gates.py).

- a stage's prometheus gate (5xx answered by the host's workers, over the last seconds) passes and
  the rollout advances; the eval gate's score rises: promoted; then a version whose score drops
  below the last good one halts at its canary and no other host ever serves it;
- the same prometheus gate crosses its bound on the canary, whose worker answers 500s to the load
  (its version's embedding of token 200 is NaN): the rollout halts with no other host ever serving
  the version, the reason names the gate, and `hotswap show` and `fleet rollout status` print it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import POSTGRES_ENV, DaemonProcess, hotswap_cli, make_config_file, wait_until
from support_fleet_daemons import aliases_of, host_daemon
from support_prometheus import PrometheusServer, prometheus_binary
from support_rollout import WorkerPool, publish_into
from support_wait import free_port

from bench.loadgen import LoadGen
from tests.e2e.test_fleet_stages_daemons import hosts_that_rolled_out, query, status

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")]  # fmt: skip

# 5xx answered to clients (the serving routes) by the host's workers over the last 20 s
ERRORS_QUERY = 'sum(increase(hotswap_worker_errors_total{host="{host}",route=~"/v1/.*"}[20s])) or vector(0)'
# The eval: one completion on the canary's worker (it must be served by the version on trial),
# then the score the test wrote for that version.
EVAL_PY = """
import json, os, sys, urllib.request
req = urllib.request.Request(os.environ["HOTSWAP_WORKER_URL"] + "/v1/completions", method="POST",
    data=json.dumps({"prompt": [1, 3, 5], "max_tokens": 1}).encode(), headers={"content-type": "application/json"})
served = json.load(urllib.request.urlopen(req, timeout=30)).get("weight_version")
if served != os.environ["HOTSWAP_VERSION"]:
    sys.exit(f"served by {served!r}, not {os.environ['HOTSWAP_VERSION']!r}")
print(json.dumps({"score": json.load(open(os.environ["SCORES"]))[served]}))
"""


@pytest.fixture(scope="module")
def prom_bin() -> str:
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("no Prometheus server binary (scripts/check-metrics.sh --server needs apt-get or prometheus)")
    return binary


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path / "pool", n=3)
    yield p
    p.close()


def gates_table(prom_url: str, tmp_path: Path, scores: dict[str, float]) -> dict[str, Any]:
    (tmp_path / "eval.py").write_text(EVAL_PY)
    (tmp_path / "scores.json").write_text(json.dumps(scores))
    return {"prometheus_url": prom_url, "gate": [
        {"name": "worker-5xx", "kind": "prometheus", "query": ERRORS_QUERY, "condition": "< 1", "count": 4,
         "interval_s": 2.0, "failure_limit": 0, "on_error": "halt"},
        {"name": "score", "kind": "eval", "command": [sys.executable, str(tmp_path / "eval.py")], "max_drop": 0.0,
         "timeout_s": 60, "env": {"SCORES": str(tmp_path / "scores.json")}}]}  # fmt: skip


def start(tmp_path: Path, factory: Callable[..., DaemonProcess], url: str, pool: WorkerPool, prom_bin: str,
          stage_gates: list[str], scores: dict[str, float]) -> tuple[list[DaemonProcess], PrometheusServer]:  # fmt: skip
    prom = PrometheusServer(prom_bin, tmp_path / "prometheus", free_port())
    gates = gates_table(prom.url, tmp_path, scores)
    stages = [{"hosts": 1, "bake_s": 1.0, "gates": stage_gates}, {"hosts": 2, "bake_s": 1.0}]
    # the built-in error rate is left lenient: what must halt a bad canary here is the gate
    d = [host_daemon(factory, url, i, pool.workers[i], {}, rollout={"max_error_rate": 1.0},
                     sections={"gates": gates}, stages=stages) for i in range(3)]  # fmt: skip
    for x in d:
        x.start(timeout=120)
    for i in range(3):
        wait_until(lambda i=i: aliases_of(url, f"host-{i}") == {"serving": "v0", "last_good": "v0"}, 240, 0.2,
                   f"host-{i} on v0")  # fmt: skip
    targets = [(w.url, {"host": f"host-{i}", "role": "worker"}) for i, w in enumerate(pool.workers)]
    targets += [(str(x.api_url), {"host": f"host-{i}", "role": "daemon"}) for i, x in enumerate(d)]
    return d, prom.start(targets)


def publish_everywhere(d: list[DaemonProcess], version: str, seed: int, fault: str | None = None) -> None:
    publish_into(d[1].watch_dir, version, seed=seed, fault=fault)  # host-1 verifies it first: its canary
    wait_until(lambda: status(d[0].db_url).get("version") == version, 240, 0.05, f"the staged rollout of {version}")
    for i in (0, 2):
        publish_into(d[i].watch_dir, version, seed=seed, fault=fault)


def gate_rows(url: str, version: str) -> list[Any]:
    return query(url, "SELECT g.gate, g.kind, g.host, g.stage, g.verdict, g.value, g.reason FROM gate_runs g JOIN "
                      "checkpoints c ON c.id = g.checkpoint_id WHERE c.version = :v ORDER BY g.id", v=version)  # fmt: skip


def cli(tmp_path: Path, url: str, *args: str) -> str:
    cfg = make_config_file(tmp_path / "cli.toml", database={"url": url}, fleet={"host": "ops", "enabled": True},
                           daemon={"state_dir": str(tmp_path / "cli-state")})  # fmt: skip
    out = hotswap_cli(*args, "-c", str(cfg))
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_passing_gates_advance_the_stage_a_higher_score_promotes_and_a_lower_one_halts(
    tmp_path: Path, pg_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess], prom_bin: str
) -> None:
    d, prom = start(tmp_path, daemon_factory, pg_url, pool, prom_bin, ["worker-5xx", "score"],
                    {"v1": 0.70, "v2": 0.80, "v3": 0.75})  # fmt: skip
    body = {"prompt": [1, 200, 5], "max_tokens": 2, "temperature": 1.0, "ignore_eos": True}
    try:
        with LoadGen([w.url for w in pool.workers], concurrency=2, body=body, max_seconds=800) as load:
            load.wait_requests(10)
            wait_until(lambda: prom.query('sum(hotswap_worker_requests_total{host="host-1"})'), 60, 0.2,
                       "the canary worker's requests in Prometheus")  # fmt: skip
            for version, seed in (("v1", 1), ("v2", 2)):
                publish_everywhere(d, version, seed)
                wait_until(lambda: status(pg_url)["state"] in ("done", "halted"), 300, 0.3, f"{version}'s rollout over")
                errors = prom.query("hotswap_worker_errors_total")
                assert status(pg_url)["state"] == "done", (status(pg_url), errors, load.stats.errors[:3])
                rows = gate_rows(pg_url, version)
                ran = {(r.gate, r.host, r.stage, r.verdict) for r in rows if r.kind != "builtin"}
                assert ran == {("worker-5xx", "host-1", 0, "passed"), ("score", "host-1", 0, "passed")}, rows
                assert len([r for r in rows if r.gate == "worker-5xx"]) == 4  # count measurements, all taken
                for i in range(3):
                    assert aliases_of(pg_url, f"host-{i}") == {"serving": version, "last_good": version}
            v2_score = [r for r in gate_rows(pg_url, "v2") if r.gate == "score"]
            assert v2_score[0].value == 0.8, v2_score

            publish_everywhere(d, "v3", 3)  # scores 0.75: below v2's 0.80 (max_drop 0)
            wait_until(lambda: status(pg_url)["state"] == "halted", 300, 0.3, "the halt of v3")
            pool.workers[1].wait_running(120, version="v2")
            assert load.stats.errors == [], load.stats.errors[:3]
    finally:
        prom.stop()
    doc = status(pg_url)
    assert "gate score failed: score 0.75 is below >= 0.8 (last good v2 scored 0.8" in doc["reason"], doc
    assert hosts_that_rolled_out(pg_url, "v3") == {"host-1"}
    for i in (0, 2):
        assert aliases_of(pg_url, f"host-{i}")["serving"] == "v2"
    (why,) = query(pg_url, "SELECT gate, host, verdict, value FROM why_halted WHERE version = 'v3'")
    assert tuple(why) == ("score", "host-1", "failed", 0.75)
    out = cli(tmp_path, pg_url, "fleet", "rollout", "status")
    assert "gate score (eval) on host-1: failed, 1 failed" in out and "halted" in out, out
    assert "gate worker-5xx (prometheus) on host-1:" in out, out
    shown = cli(tmp_path, pg_url, "show", "v3")
    assert "stage 1: score (eval) on host-1: failed" in shown and "error_rate (builtin) on host-1/w1" in shown, shown


def test_a_canary_answering_500s_crosses_the_gate_and_halts_the_rollout(
    tmp_path: Path, pg_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess], prom_bin: str
) -> None:
    d, prom = start(tmp_path, daemon_factory, pg_url, pool, prom_bin, ["worker-5xx"], {})
    # Sampled requests whose prompt holds token 200: fine on v0; "bad"'s embedding row for 200 is NaN,
    # so on the canary they fail (HTTP 500) while the daemon's greedy probe (without 200) passes.
    body = {"prompt": [1, 200, 5], "max_tokens": 2, "temperature": 1.0, "ignore_eos": True}
    try:
        with LoadGen([w.url for w in pool.workers], concurrency=2, body=body, max_seconds=800) as load:
            load.wait_requests(10)
            assert load.stats.errors == []
            publish_everywhere(d, "bad", 1, fault="nan-token:200")
            wait_until(lambda: status(pg_url)["state"] == "halted", 300, 0.3, "the halt of bad")
            pool.workers[1].wait_running(120, version="v0")
            seen = prom.query('sum by (host) (hotswap_worker_errors_total)')
            # the daemons are scraped too: the canary's own count of the gate's failed measurements
            failed_runs = wait_until(lambda: prom.query('hotswap_gate_runs_total{gate="worker-5xx",verdict="failed"}'),
                                     30, 0.2, "the canary daemon's failed gate runs in Prometheus")  # fmt: skip
    finally:
        prom.stop()
    assert load.stats.errors, "the canary really answered 500s"
    assert {s["metric"]["host"] for s in seen} == {"host-1"}, seen  # only the canary's worker ever failed
    assert [(s["metric"]["host"], s["metric"]["role"]) for s in failed_runs] == [("host-1", "daemon")], failed_runs
    doc = status(pg_url)
    assert "gate worker-5xx failed" in doc["reason"] and "does not meet < 1" in doc["reason"], doc
    assert hosts_that_rolled_out(pg_url, "bad") == {"host-1"}
    for i in (0, 2):
        assert aliases_of(pg_url, f"host-{i}")["serving"] == "v0"
        assert pool.workers[i].info()["version"] == "v0"
    failed = [r for r in gate_rows(pg_url, "bad") if r.verdict == "failed"]
    assert [(r.gate, r.host, r.stage) for r in failed] == [("worker-5xx", "host-1", 0)], failed
    assert failed[0].value >= 1
    (st,) = query(pg_url, "SELECT status, status_message FROM checkpoints WHERE version = 'bad'")
    assert st.status == "rejected" and "gate worker-5xx failed" in st.status_message
