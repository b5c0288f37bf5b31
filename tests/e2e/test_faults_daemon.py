"""Faults of issue 21's matrix inside an update, with real processes: a daemon (the test entry point,
tests/hooked_daemon.py, holding the engine right after it records the worker PAUSED) and its one
managed worker, the embedded default's shape (a lone worker is paused, not drained).

- a worker hung inside its update (SIGSTOPped while paused) is not serving, and /health says so
  while the update is still in flight (a pause counted as serving forever before);
- the SQLite file made read-only mid-rollout: the rollout goes on (the worker is not left paused),
  /health says the registry takes no writes, and once it does every transition is recorded.

One daemon serves both (each test holds its own version once); each waits on conditions only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import DaemonProcess, make_config_file, publish_tiny, wait_until
from sqlalchemy import text
from support_managed import close_managed

HOLD = ("stop-v2", "ro-v3")


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    root = tmp_path_factory.mktemp("faults")
    state, watch = root / "state", root / "checkpoints"
    watch.mkdir()
    publish_tiny(watch / "seed-v1", seed=1)
    cfg = make_config_file(
        root / "config.toml",
        daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "keep_workers_on_stop": False},
        sources=[{"path": str(watch), "rescan_interval_s": 1.0}],
        checks={"enabled": ["manifest", "headers", "crc32c"]},
        rollout={"health_window_s": 0.3, "health_poll_s": 0.5, "update_timeout_s": 60.0, "request_timeout_s": 5.0},
        workers=[{"name": "local", "launch": "managed", "device": "cpu"}],
    )
    env = {"HOTSWAP_TEST_HOLD_STATE": "PAUSED", "HOTSWAP_TEST_HOLD_VERSION": ",".join(HOLD),
           "HOTSWAP_TEST_HOLD_RELEASE": str(root / "RELEASE")}  # fmt: skip
    d = DaemonProcess(root, cfg, f"sqlite:///{state / 'hotswap.db'}", watch, state, env, hooked=True)
    try:
        d.start(timeout=120)
        wait_until(lambda: serves(d) == "seed-v1", 180, 0.2, "the worker serving seed-v1")
        yield d
    finally:
        pid = worker_pid(d)
        if pid:
            os.kill(pid, signal.SIGCONT)
        close_managed(d)


def worker_doc(d: DaemonProcess) -> dict[str, Any]:
    try:
        return dict(json.loads((d.state_dir / "worker-local.json").read_text()))
    except (OSError, ValueError):
        return {}


def worker_pid(d: DaemonProcess) -> int | None:
    pid = worker_doc(d).get("pid")
    return int(pid) if pid else None


def serves(d: DaemonProcess) -> str | None:
    """The version the worker's serving port answers a completion with (None: no answer in 3 s)."""
    url = f"http://127.0.0.1:{worker_doc(d)['port']}/v1/completions"
    try:
        r = httpx.post(url, json={"prompt": [1, 2, 3], "max_tokens": 1, "ignore_eos": True}, timeout=3)
    except httpx.HTTPError:
        return None
    return str(r.json()["weight_version"]) if r.status_code == 200 else None


def health(d: DaemonProcess) -> tuple[int, dict[str, Any]]:
    r = d.get("/health")
    return r.status_code, r.json()


def held_at(d: DaemonProcess, version: str) -> bool:
    return any("test_hold_begin" in line and version in line for line in d.log().splitlines())


def recorded(d: DaemonProcess, version: str) -> bool:
    """The registry agrees with the worker: serving alias, the workers row, RUNNING."""
    with d.registry.engine.connect() as c:
        alias = c.execute(text("SELECT c.version FROM aliases a JOIN checkpoints c ON c.id = a.checkpoint_id "
                               "WHERE a.name = 'serving'")).scalar()  # fmt: skip
        row = c.execute(text("SELECT state, weight_version FROM workers WHERE name = 'local'")).one()
    return alias == version and tuple(row) == ("RUNNING", version)


def test_a_worker_hung_inside_its_update_is_no_worker_serving_while_the_update_is_in_flight(held: DaemonProcess) -> None:
    publish_tiny(held.watch_dir / "stop-v2", seed=2)
    wait_until(lambda: held_at(held, "stop-v2"), 120, 0.1, "the engine held with the worker PAUSED")
    pid = worker_pid(held)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        (held.workdir / "RELEASE.stop-v2").touch()  # the update call now waits on a stopped worker

        def paused_and_said() -> bool:
            code, doc = health(held)
            found = [p for p in doc.get("problems", []) if p["kind"] == "no_worker_serving"]
            return code == 503 and bool(found) and "PAUSED" in found[0]["reason"]

        wait_until(paused_and_said, 50, 0.1, "/health 503: no worker serving, the worker PAUSED in its update")
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: serves(held) in ("seed-v1", "stop-v2"), 180, 0.2, "the worker serving a whole version again")
    wait_until(lambda: health(held)[0] == 200, 180, 0.2, "/health ok again")
    wait_until(lambda: recorded(held, serves(held) or "?"), 60, 0.2, "the registry on what the worker serves")


@pytest.mark.skipif(shutil.which("chattr") is None, reason="needs chattr (e2fsprogs)")
def test_the_registry_made_read_only_mid_rollout_holds_up_no_worker_and_loses_no_transition(held: DaemonProcess) -> None:
    wait_until(lambda: health(held)[0] == 200 and serves(held) is not None, 180, 0.2, "the host at rest")
    publish_tiny(held.watch_dir / "ro-v3", seed=3)
    wait_until(lambda: held_at(held, "ro-v3"), 120, 0.1, "the engine held with the worker PAUSED")
    db = held.state_dir / "hotswap.db"
    files = [p for p in (db, db.with_name(db.name + "-wal")) if p.exists()]
    if subprocess.run(["chattr", "+i", str(db)], capture_output=True).returncode != 0:
        (held.workdir / "RELEASE.ro-v3").touch()
        pytest.skip("this filesystem has no immutable flag")
    try:
        for p in files:
            subprocess.run(["chattr", "+i", str(p)], check=True)
        (held.workdir / "RELEASE.ro-v3").touch()
        # the update finishes and the worker is resumed although nothing of it can be recorded now
        wait_until(lambda: serves(held) == "ro-v3", 120, 0.2, "the worker serving ro-v3 with the registry read-only")
        wait_until(lambda: "database_unwritable" in str(health(held)), 60, 0.2, "/health: database_unwritable")
        assert health(held)[0] == 503
    finally:
        for p in files:
            subprocess.run(["chattr", "-i", str(p)], check=False)
    wait_until(lambda: recorded(held, "ro-v3") and health(held)[0] == 200, 120, 0.2,
               "ro-v3 recorded as serving on the worker, /health ok")  # fmt: skip
    with held.registry.engine.connect() as c:
        rid = c.execute(text("SELECT r.id FROM rollouts r JOIN checkpoints c ON c.id = r.checkpoint_id "
                             "WHERE c.version = 'ro-v3'")).scalar()  # fmt: skip
        path = [r[0] for r in c.execute(text("SELECT to_state FROM events WHERE rollout_id = :r AND worker = 'local' "
                                             "ORDER BY id"), {"r": rid})]  # fmt: skip
        outcome = c.execute(text("SELECT outcome FROM rollouts WHERE id = :r"), {"r": rid}).scalar()
    assert path == ["PAUSED", "UPDATED", "RUNNING"] and outcome == "succeeded", (path, outcome)
