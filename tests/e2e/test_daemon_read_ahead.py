"""The daemon asks disk workers to read a version while it verifies it (issue 41: the disk path
read every version twice, once to verify and again in the worker's prepare), through a real
daemon and a real reference worker started with `--stage-disk on`:

- a good version: the worker reads it while the daemon verifies, and the rollout's prepare takes
  that read (the worker's events: read_ahead, read_ahead_taken, prepared, updated), vouched for by
  the registry's digests; the worker serves the version;
- a corrupt version (one byte flipped after its manifest was written): the crc32c check rejects
  it, and the worker is told to let go of what it read; it keeps serving the good version.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, make_config_file, wait_until
from support_check import flip_byte
from support_engines import publish_ckpt
from support_worker import WorkerProcess, start_worker, write_token

from daemon.formats.checkpoint import tensor_table
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(600)


def tiny(seed: int) -> Any:
    def make(d: Path) -> Path:
        make_tiny_checkpoint(d, seed=seed)
        return d

    return make


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, WorkerProcess]]:
    root = tmp_path_factory.mktemp("read-ahead-daemon")
    watch, state = root / "checkpoints", root / "state"
    base = publish_ckpt(watch, "ra-v0", tiny(0))
    token = write_token(root)
    w = start_worker(base, token, extra=["--version", "ra-v0", "--stage-disk", "on"])
    cfg = make_config_file(
        root / "config.toml",
        daemon={"state_dir": str(state), "listen": "127.0.0.1:0"},
        database={"url": f"sqlite:///{root / 'hotswap.db'}"},
        sources=[{"path": str(watch), "rescan_interval_s": 1.0, "quiet_period_s": 0.3}],
        checks={"enabled": ["manifest", "headers", "crc32c", "compat", "finite"]},
        rollout={"transport": "disk", "mode": "pause", "health_window_s": 0.5},
        workers=[{"name": "w0", "url": w.url, "token_file": str(token)}],
    )
    d = DaemonProcess(root, cfg, f"sqlite:///{root / 'hotswap.db'}", watch, state, {})
    try:
        d.start(timeout=120)
        d.wait_status("ra-v0", "deployed", timeout=300)
        yield d, w
    finally:
        d.close()
        w.stop()


def events(w: WorkerProcess, version: str) -> list[dict[str, Any]]:
    return [e for e in w.info()["events"] if e.get("version") == version]


def test_a_good_version_is_read_once_by_the_worker_while_the_daemon_verifies_it(env: tuple[DaemonProcess, WorkerProcess]) -> None:
    d, w = env
    publish_ckpt(d.watch_dir, "ra-v1", tiny(1))
    d.wait_status("ra-v1", "deployed", timeout=300)
    wait_until(lambda: w.info()["version"] == "ra-v1", 60, 0.1, "the worker on ra-v1")
    seen = [e["event"] for e in events(w, "ra-v1")]
    assert seen[:2] == ["read_ahead", "read_ahead_taken"] and "prepared" in seen and "updated" in seen, seen
    assert "read_ahead_released" not in seen, seen
    assert w.info()["read_ahead"] is None


def test_a_version_that_fails_its_checks_is_let_go_by_the_worker(env: tuple[DaemonProcess, WorkerProcess]) -> None:
    d, w = env

    def corrupt(dest: Path) -> Path:
        make_tiny_checkpoint(dest, seed=2)
        return dest

    tmp = publish_ckpt(d.watch_dir.parent / "staging", "ra-bad", corrupt)  # manifest written, then a byte flipped
    table, _ = tensor_table(tmp)
    loc = min(table.values(), key=lambda x: (str(x.file), x.entry.start))
    flip_byte(loc.file, loc.entry.start + loc.entry.nbytes // 2)
    tmp.rename(d.watch_dir / "ra-bad")
    row = d.wait_status("ra-bad", ("rejected", "deployed"), timeout=300)
    assert row["status"] == "rejected" and "crc32c" in (row.get("status_message") or ""), row
    wait_until(lambda: any(e["event"] == "read_ahead_released" for e in events(w, "ra-bad")), 60, 0.1,
               "the worker to let go of ra-bad")  # fmt: skip
    (released,) = [e for e in events(w, "ra-bad") if e["event"] == "read_ahead_released"]
    assert released["why"] in ("let_go", "replaced"), released  # told by the daemon, not the hold running out
    assert w.info()["read_ahead"] is None and w.info()["version"] == "ra-v1"
    assert "read_ahead_taken" not in [e["event"] for e in events(w, "ra-bad")]
