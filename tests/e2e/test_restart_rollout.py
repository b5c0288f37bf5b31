"""Restart rollouts end to end (daemon/rollout/relaunch.py): a real daemon with two managed
reference workers in drain mode behind the project's load generator (bench/loadgen.py, a load
balancer that follows /ready and retries a 503 on the other worker).

1. A checkpoint with a resized vocabulary (256 -> 320 tokens) cannot be written in place; it is
   verified as needing a restart rollout and rolled out by relaunching the workers one at a time
   on it (drained first, the serving port kept: the daemon holds its listening socket): 0 failed
   requests, every worker on the new version in a new process on its old port, serving token ids
   only the new vocabulary has.
2. A failing one (vocab 384; its files change after the first worker was relaunched on it, so the
   second worker's relaunch is refused before its old process is stopped) ends with both workers
   on the previous version (the first relaunched back), the version rejected with the reason,
   0 failed requests.
3. An external worker is relaunched on the new version by its restart_command ({path}, {version}).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import DaemonProcess, wait_until
from support_engines import corrupt_bytes, publish_ckpt
from support_rollout import WorkerPool, rollouts, start_fleet, worker_events

from bench.loadgen import LoadGen
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(900)
WORKERS = ("w1", "w2")


def _seen(d: DaemonProcess, load: LoadGen | None = None) -> str:
    parts = []
    if load is not None:
        s = load.stats
        parts.append(f"load: sent={s.sent} ok={s.ok} failed={s.failed} retried_503={s.retried_503} "
                     f"versions={dict(s.versions)} errors[:10]={s.errors[:10]}")  # fmt: skip
    with contextlib.suppress(Exception):
        parts.append("events: " + json.dumps([(e["rollout_id"], e["worker"], e["from"], e["to"],
                                                e["detail"].get("how") or e["detail"].get("error"))
                                               for e in worker_events(d.registry)]))  # fmt: skip
    parts.append("daemon log (tail):\n" + d.log()[-4000:])
    return "\n".join(parts)


def runtime(d: DaemonProcess, name: str) -> dict[str, Any]:
    return dict(json.loads((d.state_dir / f"worker-{name}.json").read_text()))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, dict[str, str]]]:
    from conftest import make_config_file

    root = tmp_path_factory.mktemp("restart")
    watch, state = root / "checkpoints", root / "state"
    watch.mkdir()
    cfg = make_config_file(
        root / "config.toml",
        daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "keep_workers_on_stop": False},
        database={"url": f"sqlite:///{root / 'hotswap.db'}"},
        sources=[{"path": str(watch), "rescan_interval_s": 1.0, "quiet_period_s": 0.3}],
        checks={"enabled": ["manifest", "headers", "crc32c", "compat", "finite", "forward"]},
        rollout={"mode": "drain", "max_unavailable": 1, "rejoin_s": 0.5, "health_window_s": 1.0,
                 "health_poll_s": 1.0, "restart_timeout_s": 120.0},
        workers=[{"name": n, "launch": "managed", "device": "cpu"} for n in WORKERS],
    )  # fmt: skip
    # held after w1 is relaunched on vocab-384 (the failing rollout) until the test changed its files
    env = {"HOTSWAP_TEST_HOLD_STATE": "UPDATED", "HOTSWAP_TEST_HOLD_WORKER": "w1",
           "HOTSWAP_TEST_HOLD_VERSION": "vocab-384", "HOTSWAP_TEST_HOLD_RELEASE": str(root / "release")}  # fmt: skip
    d = DaemonProcess(root, cfg, f"sqlite:///{root / 'hotswap.db'}", watch, state, env, hooked=True)
    try:
        d.start(timeout=120)
        d.wait_status("tiny-seed", "deployed", timeout=120)
        urls = {n: f"http://127.0.0.1:{wait_until(lambda n=n: runtime(d, n)['port'], 120, 0.1, 'launch')}"
                for n in WORKERS}  # type: ignore[misc]
        for url in urls.values():
            wait_until(lambda u=url: httpx.get(u + "/ready", timeout=5).status_code == 200, 180, 0.2, "the workers")  # type: ignore[misc]
        yield d, urls
    finally:
        (root / "release").touch()
        d.close()
        for n in WORKERS:  # never leave a managed worker behind
            with contextlib.suppress(OSError, ValueError, KeyError):
                pid = int(runtime(d, n)["pid"])
                if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


def vocab(n: int, seed: int) -> Callable[[Path], Path]:
    return lambda d: make_tiny_checkpoint(d, seed=seed, config_overrides={"vocab_size": n})


def completes_with_token(url: str, token: int) -> bool:
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 3, token], "max_tokens": 2, "ignore_eos": True}, timeout=60)
    return r.status_code == 200


def test_a_resized_vocabulary_is_rolled_out_by_relaunching_each_worker_with_no_failed_request(
    fleet: tuple[DaemonProcess, dict[str, str]],
) -> None:
    d, urls = fleet
    before = {n: runtime(d, n) for n in WORKERS}
    assert not completes_with_token(urls["w1"], 300)  # 300 is past the seed's vocabulary
    load = LoadGen(list(urls.values()), concurrency=2, max_seconds=600)
    with load:
        load.wait_requests(10, timeout=120)
        publish_ckpt(d.watch_dir, "vocab-320", vocab(320, seed=5))
        row = d.wait_status("vocab-320", ("deployed", "rejected"), timeout=600)
        load.wait_requests(10, timeout=120)
    assert row["status"] == "deployed", f"{row['status_message']}\n{_seen(d, load)}"
    assert load.stats.failed == 0, f"{load.stats.failed} of {load.stats.sent} requests failed\n{_seen(d, load)}"
    assert {"tiny-seed", "vocab-320"} <= set(load.stats.versions), _seen(d, load)
    r = next(r for r in rollouts(d.registry) if r["version"] == "vocab-320")
    assert r["outcome"] == "succeeded" and r["mode"] == "drain", _seen(d)
    events = worker_events(d.registry, r["id"])
    for n in WORKERS:
        path = [(e["from"], e["to"]) for e in events if e["worker"] == n]
        assert path == [("RUNNING", "DRAINING"), ("DRAINING", "UPDATED"), ("UPDATED", "RUNNING")], _seen(d)
        updated = next(e for e in events if e["worker"] == n and e["to"] == "UPDATED")
        assert updated["detail"]["how"] == "managed relaunch" and "model.embed_tokens.weight" in updated["detail"]["restart"]
        now = runtime(d, n)
        assert now["port"] == before[n]["port"] and now["pid"] != before[n]["pid"] and now["version"] == "vocab-320"
        assert completes_with_token(urls[n], 300)  # the new vocabulary serves
    # one at a time: w1 was RUNNING on the new version before w2 left RUNNING (max_unavailable = 1)
    order = [(e["worker"], e["to"]) for e in events]
    assert order.index(("w1", "RUNNING")) < order.index(("w2", "DRAINING")), order


def test_a_failing_restart_rollout_ends_on_the_previous_version(fleet: tuple[DaemonProcess, dict[str, str]]) -> None:
    d, urls = fleet
    previous = d.get("/v1/rollout").json()["serving"]
    load = LoadGen(list(urls.values()), concurrency=2, max_seconds=600)
    with load:
        load.wait_requests(10, timeout=120)
        bad = publish_ckpt(d.watch_dir, "vocab-384", vocab(384, seed=6))
        wait_until(lambda: "test_hold_begin" in d.log(), 600, 0.2, "w1 to be relaunched on vocab-384")
        corrupt_bytes(bad)  # after w1 loaded it: w2's relaunch hashes it first and refuses
        (d.workdir / "release").touch()
        row = d.wait_status("vocab-384", ("rejected", "deployed"), timeout=600)
        wait_until(lambda: all(runtime(d, n)["version"] == previous for n in WORKERS), 300, 0.2,
                   "both workers back on the previous version")  # fmt: skip
        load.wait_requests(10, timeout=120)
    assert row["status"] == "rejected" and "changed since it was verified" in row["status_message"], row["status_message"]
    assert load.stats.failed == 0, f"{load.stats.failed} of {load.stats.sent} requests failed\n{_seen(d, load)}"
    r = next(r for r in rollouts(d.registry) if r["version"] == "vocab-384")
    assert r["outcome"] == "failed" and r["detail"]["rolled_back"] == ["w1"] and r["detail"]["unrecovered"] == [], r
    for n in WORKERS:
        info = httpx.post(urls[n] + "/v1/completions", json={"prompt": [1, 3, 5], "max_tokens": 2}, timeout=60).json()
        assert info["weight_version"] == previous
    w1 = [(e["from"], e["to"], e["detail"].get("how")) for e in worker_events(d.registry, r["id"]) if e["worker"] == "w1"]
    assert w1[-2:] == [("DRAINING", "UPDATED", "managed relaunch"), ("UPDATED", "RUNNING", None)], w1  # relaunched back


def test_an_external_worker_is_relaunched_through_its_restart_command_on_the_new_path(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    pool = WorkerPool(tmp_path / "pool", n=1)
    try:
        d = start_fleet(daemon_factory, f"sqlite:///{tmp_path / 'r.db'}", pool,
                        rollout={"health_window_s": 0.5, "restart_timeout_s": 180.0},
                        checks={"enabled": ["manifest", "headers", "crc32c", "compat"]})  # fmt: skip
        (w,) = pool.workers
        pid = w.pid
        new = publish_ckpt(d.watch_dir, "vocab-320", vocab(320, seed=5))
        row = d.wait_status("vocab-320", ("deployed", "rejected"), timeout=300)
        assert row["status"] == "deployed", f"{row['status_message']}\n{_seen(d)}"
        info = w.info()
        assert (info["version"], Path(info["path"]).resolve()) == ("vocab-320", new.resolve())
        assert w.pid != pid and completes_with_token(w.url, 300)
        r = next(r for r in rollouts(d.registry) if r["version"] == "vocab-320")
        events = [(e["from"], e["to"], e["detail"].get("how")) for e in worker_events(d.registry, r["id"])]
        assert events == [("RUNNING", "DRAINING", None), ("DRAINING", "UPDATED", "restart_command"),
                          ("UPDATED", "RUNNING", None)], events  # fmt: skip
        drained = next(e for e in worker_events(d.registry, r["id"]) if e["to"] == "DRAINING")
        assert "a pause cannot outlive its process" in drained["detail"]["reason"]  # a lone worker's group pauses
    finally:
        pool.close()


def test_a_lone_managed_worker_is_relaunched_while_its_port_holds_new_connections(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """The embedded default's shape: one managed worker, so its group pauses rather than drains.
    The relaunch is the pause: the daemon keeps the listening socket, the old child finishes what it
    holds and exits, connections made meanwhile wait in the backlog for the new child."""
    d = daemon_factory(
        f"sqlite:///{tmp_path / 'registry.db'}",
        daemon={"keep_workers_on_stop": False},
        checks={"enabled": ["manifest", "headers", "crc32c", "compat", "finite"]},
        extra={"rollout": {"health_window_s": 0.5, "health_poll_s": 0.5, "restart_timeout_s": 120.0},
               "workers": [{"name": "local", "launch": "managed", "device": "cpu"}]},  # fmt: skip
        wait=False,
    )
    try:
        d.start(timeout=120)
        d.wait_status("tiny-seed", "deployed", timeout=120)
        url = f"http://127.0.0.1:{wait_until(lambda: runtime(d, 'local')['port'], 120, 0.1, 'launch')}"
        wait_until(lambda: httpx.get(url + "/ready", timeout=5).status_code == 200, 180, 0.2, "the worker")
        before = runtime(d, "local")
        load = LoadGen([url], concurrency=2, max_seconds=500)
        with load:
            load.wait_requests(10, timeout=120)
            publish_ckpt(d.watch_dir, "vocab-320", vocab(320, seed=5))
            row = d.wait_status("vocab-320", ("deployed", "rejected"), timeout=300)
            load.wait_requests(10, timeout=120)
        assert row["status"] == "deployed", f"{row['status_message']}\n{_seen(d, load)}"
        assert load.stats.failed == 0, f"{load.stats.failed} of {load.stats.sent} requests failed\n{_seen(d, load)}"
        assert {"tiny-seed", "vocab-320"} <= set(load.stats.versions), _seen(d, load)
        r = next(r for r in rollouts(d.registry) if r["version"] == "vocab-320")
        path = [(e["from"], e["to"]) for e in worker_events(d.registry, r["id"])]
        assert path == [("RUNNING", "PAUSED"), ("PAUSED", "UPDATED"), ("UPDATED", "RUNNING")], _seen(d)
        now = runtime(d, "local")
        assert now["port"] == before["port"] and now["pid"] != before["pid"]
    finally:
        d.close()
        with contextlib.suppress(OSError, ValueError, KeyError):
            pid = int(runtime(d, "local")["pid"])
            if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
