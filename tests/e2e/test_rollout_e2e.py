"""End to end: the real daemon rolls checkpoints onto two real workers under continuous load.

The load generator behaves like a load balancer: it skips a worker whose /ready is 503 and
retries a request a draining worker rejected with 503 on the other worker (see LoadGen).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, hotswap_cli, make_config_file, wait_until
from support_docs_sql import documented_queries
from support_rollout import (
    WorkerPool,
    aliases,
    assert_fleet_on,
    publish_into,
    rollouts,
    start_fleet,
    worker_events,
    worker_paths,
)

from bench.loadgen import LoadGen

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path_factory.mktemp("pool"))
    yield p
    p.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["drain", "pause"])
def test_ten_rollouts_under_load_fail_no_request(
    mode: str, db_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = start_fleet(daemon_factory, db_url, pool, rollout={"mode": mode, "health_window_s": 0.3})
    workers = pool.workers
    versions = [f"{mode}-{i}" for i in range(1, 11)]
    with LoadGen([w.url for w in workers], concurrency=3, max_seconds=400) as load:
        load.wait_requests(10)
        for i, version in enumerate(versions, start=1):
            publish_into(d.watch_dir, version, seed=i)
            d.wait_status(version, "deployed", timeout=120)
            load.wait_requests(5)  # traffic keeps flowing between rollouts too
    stats = load.stats
    assert stats.errors == [], f"{len(stats.errors)} failed requests, e.g. {stats.errors[:3]}"
    assert stats.ok >= 60
    assert_fleet_on(workers, versions[-1])
    served = set(stats.versions)
    assert {"v0", versions[-1]} <= served

    begin = "DRAINING" if mode == "drain" else "PAUSED"
    paths = worker_paths(d.registry)
    for version in versions:
        for w in workers:
            assert paths[(w.name, version)] == [["RUNNING", begin, "UPDATED", "RUNNING"]], (w.name, version)
    outcomes = {r["version"]: (r["outcome"], r["mode"]) for r in rollouts(d.registry)}
    assert all(outcomes[v] == ("succeeded", mode) for v in versions)
    assert aliases(d.registry)["serving"] == versions[-1]

    history = {r["version"]: r for r in d.history()}
    for version in versions:
        row = history[version]
        assert row["discovered_at"] <= row["verified_at"] <= row["deployed_at"]
        assert row["status"] == ("deployed" if version == versions[-1] else "retired")
        per_worker = dict(item.split("=") for item in row["worker_update_ms"].split())
        assert set(per_worker) == {w.name for w in workers} and all(v.endswith("ms") for v in per_worker.values())
    # The same facts from the CLI.
    out = hotswap_cli("history", "-c", str(d.config_path), "--json", "-n", "0")
    assert out.returncode == 0, out.stderr
    rows = {r["version"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert rows[versions[0]]["deployed_at"] and rows[versions[0]]["worker_update_ms"].startswith("w0=")
    if mode == "drain":
        _documented_sql_answers(d, versions, [w.name for w in workers])


def _documented_sql_answers(d: DaemonProcess, versions: list[str], workers: list[str]) -> None:
    """Every query the docs give runs on this database as written, and the views they name hold
    what the docs say: `worker_updates` one row per rollout and worker, version_history's filters."""
    from sqlalchemy import text

    queries = documented_queries()
    assert len(queries) >= 6, queries  # the history page's, the adapters' and the fleet view's at least
    with d.registry.session() as s:
        for where, query in queries:
            try:
                s.execute(text(query)).all()
            except Exception as exc:  # noqa: BLE001 - named with the page it came from
                pytest.fail(f"{where}: {query!r} fails on {d.registry.engine.dialect.name}: {exc}")
        updates = [dict(r) for r in s.execute(text("SELECT * FROM worker_updates")).mappings()]
        deployed = s.execute(text("SELECT version, status FROM version_history WHERE status = 'deployed'")).all()
    for version in versions:
        mine = sorted((u for u in updates if u["version"] == version), key=lambda u: u["worker"])
        assert [u["worker"] for u in mine] == sorted(workers), (version, mine)
        for u in mine:
            assert u["outcome"] == "succeeded" and u["transitions"] == 3 and u["unhealthy"] == 0, u
            assert u["update_ms"] is not None and u["update_ms"] >= 0 and u["first_event_at"] <= u["last_event_at"], u
    assert [tuple(r) for r in deployed] == [(versions[-1], "deployed")]


@pytest.mark.slow
def test_in_drain_mode_the_next_worker_drains_only_rejoin_s_after_the_last_one_resumed(
    pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """rejoin_s: a load balancer sees a resumed worker ready only at its next health check, so the
    next batch drains that long after (the last CI flake of the round before: both out at once).
    The load generator skips unready workers, as a load balancer does: no request fails."""
    rejoin_s = 3.0
    d = start_fleet(daemon_factory, f"sqlite:///{tmp_path / 'registry.db'}", pool,
                    rollout={"mode": "drain", "health_window_s": 0.3, "rejoin_s": rejoin_s})  # fmt: skip
    with LoadGen([w.url for w in pool.workers], concurrency=2, max_seconds=300) as load:
        load.wait_requests(5)
        publish_into(d.watch_dir, "v1", seed=1)
        d.wait_status("v1", "deployed", timeout=120)
        load.wait_requests(5)
    assert load.stats.errors == [], load.stats.errors[:3]
    (r,) = [r for r in rollouts(d.registry) if r["version"] == "v1"]
    events = worker_events(d.registry, r["id"])
    first, second = pool.workers[0].name, pool.workers[1].name
    back = next(e["at"] for e in events if e["worker"] == first and e["to"] == "RUNNING")
    out = next(e["at"] for e in events if e["worker"] == second and e["to"] == "DRAINING")
    gap = (out - back).total_seconds()
    assert gap >= rejoin_s, f"{second} drained {gap:.2f} s after {first} resumed (rejoin_s = {rejoin_s})\n{events}"


def test_managed_worker_quickstart(tmp_path: Path) -> None:
    """The embedded default's fleet: the daemon makes a tiny seed, runs the worker itself, rolls
    dropped checkpoints onto it, adopts it after a SIGKILL and leaves it serving on SIGTERM."""
    import httpx

    watch = tmp_path / "checkpoints"
    state = tmp_path / "state"
    cfg = make_config_file(
        tmp_path / "config.toml",
        daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "log_level": "debug"},
        sources=[{"path": str(watch)}],
        rollout={"health_window_s": 0.3, "health_poll_s": 0.5},
        workers=[{"name": "local", "launch": "managed", "device": "cpu"}],
    )
    d = DaemonProcess(tmp_path, cfg, f"sqlite:///{state / 'hotswap.db'}", watch, state, {})
    try:
        d.start(timeout=90)
        seed = d.wait_status("tiny-seed", "deployed", timeout=30)
        assert seed["source"] == "embedded"
        runtime = wait_until(lambda: json.loads((state / "worker-local.json").read_text()), 60, what="the launch")
        url = f"http://127.0.0.1:{runtime['port']}"
        admin_socket = runtime["admin_socket"]  # the admin API is on a private socket, not the TCP port

        def info() -> dict[str, Any]:
            token = (state / "worker-local.token").read_text().strip()  # a fresh one at every launch
            with httpx.Client(transport=httpx.HTTPTransport(uds=admin_socket), timeout=5) as c:
                return c.get("http://w/weight_info", headers={"Authorization": f"Bearer {token}"}).json()

        wait_until(lambda: info()["version"] == "tiny-seed", 180, what="the managed worker to serve the seed")
        assert (os.stat(admin_socket).st_mode & 0o777) == 0o600
        assert (os.stat(os.path.dirname(admin_socket)).st_mode & 0o777) == 0o700
        # a newcomer's first text prompt and chat message work: the seed ships a tokenizer
        for path, body in (("/v1/completions", {"prompt": "Hello", "max_tokens": 4}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})):
            r = httpx.post(f"{url}{path}", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["weight_version"] == "tiny-seed", r.text
        publish_into(watch, "step-1", seed=1)
        d.wait_status("step-1", "deployed", timeout=120)
        assert info()["version"] == "step-1" and info()["state"] == "RUNNING"
        assert httpx.get(f"{url}/weight_info", timeout=5).status_code == 404  # no admin route on TCP
        first_token = (state / "worker-local.token").read_text()
        first_pid = runtime["pid"]
        back = hotswap_cli("rollback", "-c", str(cfg))  # to the seed, the one version before
        assert back.returncode == 0 and "tiny-seed succeeded (from step-1)" in back.stdout, back.stderr
        assert info()["version"] == "tiny-seed"

        d.kill()  # SIGKILL: the child keeps serving; the next daemon adopts it
        assert info()["version"] == "tiny-seed"
        d.start(timeout=90)
        publish_into(watch, "step-2", seed=2)
        d.wait_status("step-2", "deployed", timeout=120)
        assert json.loads((state / "worker-local.json").read_text())["pid"] == first_pid
        # `deployed` is written before the health window runs: crash the worker only once the
        # window has passed step-2 (last_good), so this checks the relaunch, not the window
        wait_until(lambda: httpx.get(f"{d.api_url}/v1/rollout", timeout=5).json()["last_good"] == "step-2",
                   30, what="step-2's health window")  # fmt: skip

        os.kill(first_pid, signal.SIGKILL)  # the worker crashes: the health poll relaunches it
        relaunched = wait_until(lambda: (p := json.loads((state / "worker-local.json").read_text())["pid"]) != first_pid and p,
                                30, what="the relaunch")  # fmt: skip
        wait_until(lambda: info()["state"] == "RUNNING" and info()["version"] == "step-2", 180, what="step-2 again")
        assert relaunched != first_pid
        assert (state / "worker-local.token").read_text() != first_token  # per-launch secret

        assert d.stop() == 0  # SIGTERM: the daemon goes, its worker keeps serving (keep_workers_on_stop)
        assert info()["version"] == "step-2" and info()["state"] == "RUNNING"
    finally:
        d.close()
        with contextlib.suppress(OSError, ValueError, TypeError):  # never leave the child behind
            os.kill(json.loads((state / "worker-local.json").read_text())["pid"], signal.SIGKILL)


@pytest.mark.parametrize("update_mode", ["copy", "swap"])
def test_ipc_transport_stages_once_and_restores_by_ipc(
    update_mode: str, tmp_path: Path, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    """transport = "ipc": the loader stages each version before any worker leaves RUNNING, workers
    copy from its shared buffer (host shared memory here; CUDA IPC on GPUs) or, with update_mode =
    "swap", point their parameters at it, and a failed worker is restored to the last good version
    by ipc too."""
    from support_ipc import LoaderProcess, shm_dir

    with shm_dir() as shm:
        loader = LoaderProcess(tmp_path / "loader.sock", shm, "--max-versions", "4")
        try:
            d = start_fleet(
                daemon_factory, f"sqlite:///{tmp_path / 'registry.db'}", pool,
                # the probe inside the pause: the NaN version (past these few checks) never serves a request
                rollout={"transport": "ipc", "update_mode": update_mode, "mode": "pause", "health_window_s": 0.3,
                         "probe_after_resume": False},
                checks={"enabled": ["manifest", "headers", "crc32c"]},
                extra={"loader": {"socket": str(loader.socket_path)}},
            )  # fmt: skip
            workers = pool.workers
            own_storage = {w.name: w.info()["storage_id"] for w in workers}  # v0, loaded from disk
            with LoadGen([w.url for w in workers], concurrency=2, max_seconds=300) as load:
                for i in (1, 2):
                    publish_into(d.watch_dir, f"v{i}", seed=i)
                    d.wait_status(f"v{i}", "deployed", timeout=120)
                publish_into(d.watch_dir, "v3", seed=3, fault="nan")  # its probe fails
                row = d.wait_status("v3", "rejected", timeout=120)
                load.wait_requests(5)
            assert load.stats.errors == []
            assert_fleet_on(workers, "v2")
            assert all(w.info()["transport"] == "ipc" for w in workers)
            assert "non-finite" in row["status_message"]
            by_version = {r["version"]: r for r in rollouts(d.registry) if r["trigger"] == "new"}
            assert {r["transport"] for r in by_version.values()} == {"ipc"}
            restored = [e for e in worker_events(d.registry, by_version["v3"]["id"]) if e["detail"].get("action") == "restored"]
            assert restored and restored[0]["detail"]["how"] == "update to v2 (ipc)"
            updated = [e for e in worker_events(d.registry, by_version["v2"]["id"]) if e["to"] == "UPDATED"]
            assert {e["detail"]["transport"] for e in updated} == {"ipc"} and len(updated) == 2
            # copy writes the worker's own tensors in place; swap repoints them at the loader's buffer
            moved = {w.name: w.info()["storage_id"] != own_storage[w.name] for w in workers}
            assert moved == {w.name: update_mode == "swap" for w in workers}, (update_mode, moved)
            staged = {v["version"] for v in loader.client.status()["versions"]}
            assert {"v2"} <= staged and "v0" not in staged  # versions no worker can need are dropped
            with sqlite3.connect(tmp_path / "registry.db") as c:  # verify read v2 once, into the loader
                (detail,) = c.execute("SELECT c.detail FROM checks c JOIN checkpoints k ON k.id = c.checkpoint_id "
                                      "WHERE k.version = 'v2' AND c.name = 'crc32c'").fetchone()  # fmt: skip
            assert json.loads(detail)["staged"].startswith("in the loader")
        finally:
            loader.stop()
