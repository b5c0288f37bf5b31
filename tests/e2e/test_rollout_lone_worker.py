"""End to end: the embedded default's shape (one managed reference worker, `[rollout] mode` left
at its default, drain) keeps answering a steady client load through rollouts.

Draining the only worker of a group turned requests away while it updated (issue: 99 of 1,462
requests got 503 during three rollouts); the planner pauses such a batch instead, so requests
wait in the worker for the update and are then served. The load generator behaves like a load
balancer (bench.loadgen): with one worker there is nowhere else to send a request, so a 503
from it is a failed request.

A rollback to a retired version whose bytes changed since verify is refused by the worker; the
worker stays in rotation on what it serves (issue 21 item 1: it was left DRAINING, 503 to every
request for over 90 s, while /health said ok). bench.faults_watch measures it as the fault
matrix does: the worker's serving answers and /health at 10 Hz.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import DaemonProcess, hotswap_cli, wait_until
from support_check import flip_byte
from support_managed import close_managed
from support_rollout import aliases, publish_into, rollouts, worker_events, worker_paths, worker_row

from bench.faults_watch import Watch
from bench.loadgen import LoadGen
from daemon.formats.checkpoint import tensor_table

pytestmark = pytest.mark.timeout(600)

ROLLOUTS = 3
WHY = "only worker of group default: paused instead of drained"


def _seen(d: DaemonProcess, load: LoadGen | None = None) -> str:
    """What happened, for a failure message: the load's counters and errors, rollouts, worker events."""
    parts = []
    if load is not None:
        s = load.stats
        parts.append(f"load: sent={s.sent} ok={s.ok} failed={s.failed} retried_503={s.retried_503} "
                     f"versions={dict(s.versions)} errors[:10]={s.errors[:10]}")  # fmt: skip
    with contextlib.suppress(Exception):
        parts.append("rollouts: " + json.dumps([{k: r[k] for k in ("version", "outcome", "mode")} | {
            "batch_modes": r["detail"].get("batch_modes")} for r in rollouts(d.registry)]))  # fmt: skip
        parts.append("events: " + json.dumps([(e["worker"], e["from"], e["to"], e["detail"]) for e in worker_events(d.registry)]))
    parts.append("daemon log (tail):\n" + d.log()[-3000:])
    return "\n".join(parts)


def test_the_default_one_worker_shape_answers_every_request_through_three_rollouts(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = daemon_factory(
        f"sqlite:///{tmp_path / 'registry.db'}",
        daemon={"keep_workers_on_stop": False},  # stopping the daemon stops its worker too
        checks={"enabled": ["manifest", "headers", "crc32c", "compat", "finite"]},
        extra={
            "rollout": {"health_window_s": 0.5, "health_poll_s": 0.5},  # no `mode`: the default, drain
            "workers": [{"name": "local", "launch": "managed", "device": "cpu"}],
        },
        wait=False,
    )
    runtime = d.state_dir / "worker-local.json"
    load: LoadGen | None = None
    try:
        d.start(timeout=120)
        d.wait_status("tiny-seed", "deployed", timeout=120)
        port = wait_until(lambda: json.loads(runtime.read_text())["port"], 120, 0.1, "the managed worker's launch")
        url = f"http://127.0.0.1:{port}"
        probe = {"prompt": [1, 3, 5, 7], "max_tokens": 3, "ignore_eos": True}
        wait_until(lambda: httpx.post(f"{url}/v1/completions", json=probe, timeout=30).json()["weight_version"]
                   == "tiny-seed", 180, 0.2, "the managed worker to serve the seed")  # fmt: skip

        load = LoadGen([url], concurrency=3, max_seconds=500)
        with load:
            load.wait_requests(10, timeout=120)
            for i in range(1, ROLLOUTS + 1):
                publish_into(d.watch_dir, f"step-{i}", seed=i)
                d.wait_status(f"step-{i}", "deployed", timeout=180)
                load.wait_requests(5, timeout=120)  # traffic keeps flowing between rollouts too
        stats = load.stats
        assert stats.errors == [] and stats.failed == 0, (
            f"{stats.failed} of {stats.sent} requests failed during {ROLLOUTS} rollouts\n{_seen(d, load)}")
        versions = {"tiny-seed", *(f"step-{i}" for i in range(1, ROLLOUTS + 1))}
        assert versions <= set(stats.versions), f"the load did not span every version\n{_seen(d, load)}"

        by_version = {r["version"]: r for r in rollouts(d.registry)}
        paths = worker_paths(d.registry)
        for i in range(1, ROLLOUTS + 1):
            r = by_version[f"step-{i}"]
            assert (r["outcome"], r["mode"]) == ("succeeded", "pause"), _seen(d, load)
            assert r["detail"]["batch_modes"] == [{"group": "default", "workers": ["local"], "mode": "pause",
                                                   "reason": WHY}], _seen(d, load)  # fmt: skip
            assert paths[("local", f"step-{i}")] == [["RUNNING", "PAUSED", "UPDATED", "RUNNING"]], _seen(d, load)
            paused = [e for e in worker_events(d.registry, r["id"]) if e["to"] == "PAUSED"]
            assert [e["detail"].get("reason") for e in paused] == [WHY], _seen(d, load)
        assert d.stop() == 0
    finally:
        if load is not None:
            load.stop()
        close_managed(d)  # never leave the worker behind


def _lone_worker(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess], checks: list[str]) -> DaemonProcess:
    """The embedded default's shape: one managed worker, every [rollout] key but the fast ones at its default."""
    return daemon_factory(
        f"sqlite:///{tmp_path / 'registry.db'}",
        daemon={"keep_workers_on_stop": False},
        checks={"enabled": checks},
        extra={
            "rollout": {"health_window_s": 0.5, "health_poll_s": 0.5},
            "workers": [{"name": "local", "launch": "managed", "device": "cpu"}],
        },
        wait=False,
    )


def test_a_refused_rollback_keeps_the_lone_worker_serving_and_health_is_never_ok_while_it_does_not(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = _lone_worker(tmp_path, daemon_factory, ["manifest", "headers", "crc32c"])
    watch: Watch | None = None
    try:
        d.start(timeout=120)
        for i in (1, 2):
            publish_into(d.watch_dir, f"step-{i}", seed=i)
            d.wait_status(f"step-{i}", "deployed", timeout=180)
        d.wait_status("step-1", "retired", timeout=60)
        wait_until(lambda: aliases(d.registry).get("last_good") == "step-2", 60, 0.2, "step-2's health window")
        table, _ = tensor_table(d.watch_dir / "step-1")
        loc = table["lm_head.weight"]
        flip_byte(loc.file, loc.entry.start + loc.entry.nbytes // 3)  # step-1 no longer matches its verified digest

        port = json.loads((d.state_dir / "worker-local.json").read_text())["port"]
        watch = Watch(lambda: str(d.api_url), [f"http://127.0.0.1:{port}"]).start()
        prober = watch.probers[0]
        wait_until(lambda: prober.last_version == "step-2" and watch.health_seen and watch.health_seen[-1][1], 60, 0.1,
                   "the watch seeing the worker serve step-2 and /health ok")  # fmt: skip
        t0 = time.monotonic()
        out = hotswap_cli("rollback", "--to", "step-1", "-c", str(d.config_path), timeout=300)
        said = f"rc={out.returncode}\n{out.stdout}\n{out.stderr}"
        assert out.returncode != 0 or "failed" in out.stdout, said
        answered = prober.versions.get("step-2", 0)

        def back_at_rest() -> bool:
            st = d.get("/v1/rollout").json()
            return (prober.versions.get("step-2", 0) > answered + 3 and st.get("current") is None
                    and [w.get("state") for w in st.get("workers", [])] == ["RUNNING"])  # fmt: skip

        wait_until(back_at_rest, 120, 0.1, f"the worker answering on step-2 again, the daemon idle ({said})")
        t1 = time.monotonic()
        watch.stop()
        fig = watch.figures(t0, t1)
        seen = f"{fig}, versions answered {dict(prober.versions)}, load {watch.load.stats if watch.load else None}"
        seen += f"\n{said}\n{_seen(d)}"
        assert fig["outage_while_ok_s"] == 0.0, seen  # /health said ok while the worker did not serve
        assert watch.failed() == 0, seen  # the embedded default drops no request for a refused update
        assert set(prober.versions) == {"step-2"}, seen  # never a byte of the changed step-1 served

        (r,) = [r for r in rollouts(d.registry) if r["version"] == "step-1" and r["trigger"] == "rollback"]
        assert r["outcome"] == "failed" and "does not match the verified" in str(r["detail"]), seen
        states = [e["to"] for e in worker_events(d.registry, r["id"])]
        assert "UNHEALTHY" not in states and states[-1] == "RUNNING", (states, seen)  # refused is not a failure
        assert (aliases(d.registry)["serving"], worker_row(d.registry, "local")["state"]) == ("step-2", "RUNNING"), seen
        wait_until(lambda: d.get("/health").status_code == 200, 60, 0.2, "/health ok (the failed rollback is a warning)")
    finally:
        if watch is not None:
            watch.stop()
        close_managed(d)

