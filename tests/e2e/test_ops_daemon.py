"""The daemon as systemd runs it: one per state directory, sd_notify in order, a watchdog fed by
the coordinator's own loop, SIGTERM that leaves workers serving, SIGHUP that reloads the config.

Real daemon processes throughout; the notify socket is a real AF_UNIX datagram socket, as
systemd's. `tests/hooked_daemon.py`'s holds only freeze the daemon at a step.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import REPO, DaemonProcess, make_config_file, wait_until
from support_rollout import WorkerPool, publish_into, rollouts, start_fleet

pytestmark = pytest.mark.timeout(600)


class NotifySocket:
    """What systemd's NOTIFY_SOCKET receives: (monotonic time, message) in arrival order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def kinds(self) -> list[str]:
        """The first key of every message (READY, STATUS, WATCHDOG, STOPPING)."""
        return [m.split("\n")[0].split("=")[0] for _, m in self.messages]

    def watchdog_times(self) -> list[float]:
        return [t for t, m in self.messages if "WATCHDOG=1" in m]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    n = NotifySocket(tmp_path / "notify.sock")
    yield n
    n.close()


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path_factory.mktemp("pool"))
    yield p
    p.close()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'registry.db'}"


def test_second_daemon_on_a_held_state_dir_exits_2_with_one_line(
    sqlite_url: str, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    first = daemon_factory(sqlite_url)
    runtime = (first.state_dir / "daemon.json").read_text()
    second = subprocess.run(
        [sys.executable, "-m", "daemon.cli.main", "daemon", "-c", str(first.config_path)],
        cwd=first.workdir, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert second.returncode == 2, second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pid {first.pid}" in lines[0] and str(first.state_dir) in lines[0], second.stderr
    # the first daemon is untouched: still alive, its runtime file still its own
    assert first.alive() and (first.state_dir / "daemon.json").read_text() == runtime
    assert first.get("/health").status_code == 200
    # the lock dies with its holder: after a SIGKILL a new daemon starts on the same state dir
    first.kill()
    first.start()


def test_sd_notify_ready_status_watchdog_stopping_in_order(
    sqlite_url: str, notify: NotifySocket, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = daemon_factory(sqlite_url, env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"})
    wait_until(lambda: len(notify.watchdog_times()) >= 3, 120, what="three watchdog pings")
    assert d.stop() == 0
    wait_until(lambda: "STOPPING" in notify.kinds(), 10, what="STOPPING")
    kinds = notify.kinds()
    assert kinds[0] == "READY", notify.messages
    assert "STATUS=" in notify.messages[0][1], "READY carries a STATUS line"
    assert kinds[-1] == "STOPPING" and kinds.index("WATCHDOG") > 0, notify.messages


def test_a_blocked_coordinator_loop_stops_the_watchdog_pings(
    sqlite_url: str, notify: NotifySocket, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    # the hooked daemon sleeps 8 s on the coordinator's thread once a checkpoint is `verifying`
    d = daemon_factory(sqlite_url, hooked=True, env={
        "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000", "HOTSWAP_TEST_VERIFY_DELAY_S": "8"})  # fmt: skip
    wait_until(lambda: len(notify.watchdog_times()) >= 3, 120, what="pings while idle")
    d.watch_dir.mkdir(parents=True, exist_ok=True)
    publish_into(d.watch_dir, "v1", seed=1)
    d.wait_status("v1", "verifying", timeout=60)
    blocked_at = time.monotonic()
    # positive signal: the blocked step ended (the status moved on) and pings came back after it
    d.wait_status("v1", ("verified", "rejected", "deployed"), timeout=60)
    after = len(notify.watchdog_times())
    wait_until(lambda: len(notify.watchdog_times()) >= after + 2, 20, what="pings once the loop runs again")
    # pinged every ~0.5 s when free: the 8 s block shows as one gap of several seconds after it began
    times = [t for t in notify.watchdog_times() if t > blocked_at - 1.0]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert gaps and max(gaps) >= 5.0, f"pings went on while the coordinator was blocked: gaps {gaps}"


def test_sighup_applies_changes_and_keeps_the_old_config_when_the_new_one_is_broken(
    tmp_path: Path, sqlite_url: str, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = daemon_factory(sqlite_url, extra={"rollout": {"max_error_rate": 0.01}})
    good = d.config_path.read_text()
    d.config_path.write_text(good + "\n[[[ not toml\n")
    d.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    wait_until(lambda: "config reload refused" in d.log(), 20, what="the refusal")
    assert d.alive() and d.get("/health").status_code == 200
    # a second source and a changed threshold: both applied without a restart
    extra = tmp_path / "more-checkpoints"
    extra.mkdir()
    d.config_path.write_text(good.replace("max_error_rate = 0.01", "max_error_rate = 0.5")
                             + f'\n[[sources]]\npath = "{extra}"\nname = "more"\n')  # fmt: skip
    pid = d.pid
    d.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    wait_until(lambda: "rollout.max_error_rate: 0.01 -> 0.5" in d.log(), 20, what="the applied threshold")
    assert "sources: started more" in d.log()
    publish_into(extra, "from-more", seed=3)
    row = d.wait_status("from-more", ("verified", "deployed"), timeout=120)
    assert row["source"] == "more" and d.pid == pid


def test_sigterm_during_a_rollout_leaves_every_worker_running(
    tmp_path: Path, sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    release = tmp_path / "release"
    hold = {"HOTSWAP_TEST_HOLD_STATE": "PAUSED", "HOTSWAP_TEST_HOLD_WORKER": "w0",
            "HOTSWAP_TEST_HOLD_VERSION": "v1", "HOTSWAP_TEST_HOLD_RELEASE": str(release)}  # fmt: skip
    d = start_fleet(daemon_factory, sqlite_url, pool, rollout={"mode": "pause", "health_window_s": 0.3},
                    checks={"enabled": ["manifest", "headers", "crc32c"]}, hooked=True, env=hold)  # fmt: skip
    w0, w1 = pool.workers
    publish_into(d.watch_dir, "v1", seed=1)
    wait_until(lambda: w0.info()["state"] == "PAUSED", 120, what="w0 paused for v1")
    d.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    release.touch()
    d.proc.wait(60)  # type: ignore[union-attr]
    for w in (w0, w1):  # the step in flight finished; nobody is left paused or draining
        assert w.info()["state"] == "RUNNING", w.info()
    # the rollout was abandoned between workers (recorded unfinished): the next daemon's
    # recovery finishes it, so the fleet ends on one version
    d.start(timeout=90)
    wait_until(lambda: w0.info()["version"] == w1.info()["version"] and w1.info()["state"] == "RUNNING",
               180, what="one version across the fleet after the restart")  # fmt: skip
    wait_until(lambda: all(r["outcome"] for r in rollouts(d.registry)), 120, what="every rollout finished")


def test_rollout_and_worker_series_pass_promtool(
    tmp_path: Path, sqlite_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    check = REPO / "scripts" / "check-metrics.sh"
    found = subprocess.run(["bash", str(check), "--which"], capture_output=True, text=True)
    if found.returncode != 0 or not found.stdout.strip():
        pytest.skip("promtool not installed (scripts/check-metrics.sh --install)")
    import httpx

    d = start_fleet(daemon_factory, sqlite_url, pool, rollout={"mode": "pause", "health_window_s": 0.3},
                    checks={"enabled": ["manifest", "headers", "crc32c"]})  # fmt: skip
    publish_into(d.watch_dir, "v1", seed=1)
    d.wait_status("v1", "deployed", timeout=120)
    w0 = pool.workers[0]

    def tokens() -> float:
        text = httpx.get(f"{w0.url}/metrics", timeout=10).text
        return float(next(ln.split()[-1] for ln in text.splitlines()
                          if ln.startswith("hotswap_worker_generated_tokens_total")))  # fmt: skip

    before = tokens()
    httpx.post(f"{w0.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True},
               timeout=60)  # a sampled EOS would end it early
    httpx.post(f"{w0.url}/v1/completions", json={"prompt": [1], "max_tokens": -1}, timeout=60)  # a 400
    scrape = d.get("/metrics").text
    assert 'hotswap_rollouts_total{outcome="succeeded",trigger="new"}' in scrape, scrape
    assert 'hotswap_worker_state{state="RUNNING",worker="w0"} 1.0' in scrape
    assert 'hotswap_alias_info{alias="serving",version="v1"} 1.0' in scrape
    assert 'hotswap_pause_window_seconds_count{transport="disk"} 2.0' in scrape  # both workers, v1
    assert 'hotswap_update_bytes_total{transport="disk"}' in scrape
    worker = httpx.get(f"{w0.url}/metrics", timeout=10).text
    assert 'hotswap_worker_requests_total{code="2xx",route="/v1/completions"}' in worker, worker
    assert 'hotswap_worker_requests_total{code="4xx",route="/v1/completions"}' in worker
    assert tokens() == before + 3
    out = subprocess.run(["bash", str(check), d.api_url + "/metrics", f"{w0.url}/metrics"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_managed_worker_keeps_serving_across_a_daemon_restart(tmp_path: Path) -> None:
    import contextlib
    import json

    import httpx

    watch, state = tmp_path / "checkpoints", tmp_path / "state"
    cfg = make_config_file(
        tmp_path / "config.toml",
        daemon={"state_dir": str(state), "listen": "127.0.0.1:0"},
        sources=[{"path": str(watch)}],
        rollout={"health_window_s": 0.3, "health_poll_s": 0.5},
        workers=[{"name": "local", "launch": "managed", "device": "cpu"}],
    )
    d = DaemonProcess(tmp_path, cfg, f"sqlite:///{state / 'hotswap.db'}", watch, state, {})
    try:
        d.start(timeout=90)
        d.wait_status("tiny-seed", "deployed", timeout=60)
        runtime = wait_until(lambda: json.loads((state / "worker-local.json").read_text()), 60, what="the launch")
        url = f"http://127.0.0.1:{runtime['port']}"
        wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 180, what="the worker")
        assert d.stop() == 0  # SIGTERM: the daemon goes, the worker keeps serving
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        d.start(timeout=90)  # and the next daemon adopts it
        wait_until(lambda: "managed_worker_adopted" in d.log(), 60, what="the adoption")
        assert json.loads((state / "worker-local.json").read_text())["pid"] == runtime["pid"]
    finally:
        d.close()
        with contextlib.suppress(OSError, ValueError, TypeError):
            os.kill(json.loads((state / "worker-local.json").read_text())["pid"], signal.SIGKILL)
