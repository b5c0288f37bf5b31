"""End to end (real daemon, real reference worker): a writer that copies the manifest first and
then stalls longer than the quiet period still gets its checkpoint deployed once the copy is
complete (finding 8), and `hotswap reverify` works through the running daemon's API."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from conftest import DaemonProcess, hotswap_cli, wait_until
from support_rollout import WorkerPool, aliases, assert_fleet_on, build_checkpoint, publish_into

from daemon.formats.checkpoint import MANIFEST_NAME

pytestmark = pytest.mark.timeout(600)

QUIET_S = 1.0
STALL_S = 30.0  # far longer than the quiet period


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path_factory.mktemp("pool"), n=1)
    yield p
    p.close()


def test_manifest_first_copy_with_a_30s_stall_deploys_once_complete_and_reverify(
    tmp_path: Path, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    (w0,) = pool.workers
    watch = tmp_path / "daemon0" / "checkpoints"  # where daemon_factory puts its first daemon's folder
    d = daemon_factory(
        f"sqlite:///{tmp_path / 'registry.db'}",
        sources=[{"path": str(watch), "quiet_period_s": QUIET_S, "rescan_interval_s": 2.0}],
        extra={"rollout": {"health_window_s": 0.3}, "workers": [w0.spec()]},
        wait=False,
    )
    assert d.watch_dir == watch
    watch.mkdir(parents=True)
    pool.reset(publish_into(watch, "v0", seed=0), "v0")
    d.start(timeout=90)
    d.wait_status("v0", "deployed", timeout=180)
    wait_until(lambda: aliases(d.registry).get("last_good") == "v0", 60, what="v0's health window")

    src = build_checkpoint(tmp_path / "src", "v1", seed=1)
    dst = watch / "v1"
    dst.mkdir()
    shutil.copy(src / MANIFEST_NAME, dst / MANIFEST_NAME)  # the manifest lands first
    for f in sorted(src.iterdir()):
        if f.name not in (MANIFEST_NAME, "model.safetensors"):
            shutil.copy(f, dst / f.name)
    data = (src / "model.safetensors").read_bytes()
    with open(dst / "model.safetensors", "wb") as out:
        out.write(data[: len(data) // 3])
        out.flush()
        stall_end = time.monotonic() + STALL_S  # the writer stalls, the file a third long
        while time.monotonic() < stall_end:
            assert d.row("v1") is None, "handed on while a listed file was still short"
            time.sleep(0.5)
        out.write(data[len(data) // 3 :])
    row = d.wait_status("v1", "deployed", timeout=240)
    assert row["status"] == "deployed"
    assert_fleet_on([w0], "v1")
    assert [r["version"] for r in d.history() if r["status"] == "rejected"] == []

    # `hotswap reverify`: through the daemon's API, with the control token
    cfg = str(d.config_path)
    serving = hotswap_cli("reverify", "v1", "-c", cfg)
    assert serving.returncode == 1 and "is deployed" in serving.stderr, serving
    unknown = hotswap_cli("reverify", "nope", "-c", cfg)
    assert unknown.returncode == 1 and "unknown version 'nope'" in unknown.stderr
    assert d.api_url is not None
    anonymous = httpx.post(f"{d.api_url}/v1/checkpoints/reverify", json={"version": "v0"}, timeout=10)
    assert anonymous.status_code == 401
    wait_until(lambda: aliases(d.registry).get("last_good") == "v1", 60, what="v1's health window")
    again = hotswap_cli("reverify", "v0", "-c", cfg, timeout=300)
    assert again.returncode == 0, again
    assert "v0: was retired; the daemon is verifying it" in again.stdout
    # checked again and passed, but older than the serving v1: not rolled out over it
    wait_until(lambda: (d.row("v0") or {}).get("status") == "superseded", 120, what="v0 superseded")
    assert_fleet_on([w0], "v1")
    assert aliases(d.registry)["serving"] == "v1"
