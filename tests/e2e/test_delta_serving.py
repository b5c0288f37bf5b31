"""End to end under load: a managed reference worker serves versions that arrive as deltas (rebuilt
from the serving version), with 0 failed requests; a bad delta meanwhile is refused and the serving
version keeps serving. (The embedded seed version is no base: its files were never verified, and
a delta of it is refused for that.) Real daemon, real worker process, bench.loadgen's client load.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import DaemonProcess, publish_tiny, wait_until
from support_delta import step
from support_managed import close_managed

from bench.loadgen import LoadGen
from daemon.client import publish_delta
from daemon.delta.anchors import AnchorRule

pytestmark = pytest.mark.timeout(600)
RULE = AnchorRule(share=100.0)


def test_deltas_reach_the_worker_under_load_and_a_bad_one_leaves_it_serving(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = daemon_factory(
        f"sqlite:///{tmp_path / 'registry.db'}",
        daemon={"keep_workers_on_stop": False},
        checks={"enabled": ["manifest", "headers", "crc32c", "compat", "finite"]},
        extra={"rollout": {"health_window_s": 0.5, "health_poll_s": 0.5},
               "workers": [{"name": "local", "launch": "managed", "device": "cpu"}]},  # fmt: skip
        wait=False,
    )
    load: LoadGen | None = None
    try:
        d.start(timeout=120)
        d.wait_status("tiny-seed", "deployed", timeout=120)
        port = wait_until(lambda: json.loads((d.state_dir / "worker-local.json").read_text())["port"], 120, 0.1,
                          "the managed worker's launch")  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        probe = {"prompt": [1, 3, 5, 7], "max_tokens": 3, "ignore_eos": True}
        wait_until(lambda: httpx.post(f"{url}/v1/completions", json=probe, timeout=30).json()["weight_version"]
                   == "tiny-seed", 180, 0.2, "the worker to serve the seed")  # fmt: skip
        prev = tmp_path / "trainer" / "v1"  # a full version first: the chain's anchor
        publish_tiny(prev, seed=1)
        shutil.copytree(prev, d.watch_dir / ".v1")
        os.replace(d.watch_dir / ".v1", d.watch_dir / "v1")
        d.wait_status("v1", "deployed", timeout=180)
        load = LoadGen([url], concurrency=3, max_seconds=500)
        with load:
            load.wait_requests(10, timeout=120)
            for i in (1, 2):
                new = tmp_path / "trainer" / f"step-{i}"
                step(prev, new, 1e-3, i)
                publish_delta(new, prev, d.watch_dir / f"step-{i}", rule=RULE)
                row = d.wait_status(f"step-{i}", "deployed", timeout=180)
                assert (row["encoding"], row["delta_base"]) == ("delta", "v1" if i == 1 else "step-1")
                load.wait_requests(5, timeout=120)
                prev = new
            # a delta against bytes the hosts never verified: refused, step-2 keeps serving
            publish_tiny(tmp_path / "other" / "step-2", seed=9)
            step(tmp_path / "other" / "step-2", tmp_path / "trainer" / "bad", 1e-3, 3)
            publish_delta(tmp_path / "trainer" / "bad", tmp_path / "other" / "step-2", d.watch_dir / "bad", rule=RULE)
            assert "wrong base" in d.wait_status("bad", "rejected")["status_message"]
            load.wait_requests(5, timeout=120)
        stats = load.stats
        assert stats.errors == [] and stats.failed == 0, f"{stats.failed} of {stats.sent} failed: {stats.errors[:5]}"
        assert {"step-1", "step-2"} <= set(stats.versions)
        assert httpx.post(f"{url}/v1/completions", json=probe, timeout=30).json()["weight_version"] == "step-2"
        assert d.get("/health").status_code == 200
        assert d.get("/status").json()["aliases"]["serving"] == "step-2"
        assert d.stop() == 0
    finally:
        if load is not None:
            load.stop()
        close_managed(d)
