"""Deltas through the S3 (moto server subprocess) and push sources of a real daemon, into a real
managed worker under load: `hotswap publish --delta-from --to s3://` uploads only the delta's
files; the daemon fetches only those (its cache folder, the row's `fetched_bytes` and the
`hotswap_fetched_bytes_total` counter say how many), rebuilds the version from its verified
base, verifies the result against the manifest's result hashes and serves it, with 0 failed
requests. A push of a delta folder uploads only its delta files too.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import DaemonProcess, hotswap_cli, publish_tiny, wait_until
from support_delta import step
from support_managed import close_managed

from bench.loadgen import LoadGen
from daemon.checks.signatures import HmacSigner
from daemon.client import publish_delta, push
from daemon.delta.anchors import AnchorRule
from daemon.delta.section import DELTA_DIR, parse
from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.manifest import load_manifest, publish

pytestmark = pytest.mark.timeout(600)
CHECKS = {"enabled": ["manifest", "headers", "crc32c", "compat", "finite"]}
WORKERS = {"rollout": {"health_window_s": 0.5, "health_poll_s": 0.5},
           "workers": [{"name": "local", "launch": "managed", "device": "cpu"}]}  # fmt: skip
PROBE = {"prompt": [1, 3, 5, 7], "max_tokens": 3, "ignore_eos": True}
TOKEN = "delta-push-token-3"


def serving_url(d: DaemonProcess) -> str:
    port = wait_until(lambda: json.loads((d.state_dir / "worker-local.json").read_text())["port"], 120, 0.1,
                      "the managed worker's launch")  # fmt: skip
    return f"http://127.0.0.1:{port}"


def fetched_counter(d: DaemonProcess, source: str, encoding: str) -> float:
    text = d.get("/metrics").text
    m = re.search(rf'^hotswap_fetched_bytes_total{{encoding="{encoding}",source="{source}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def shipped(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_a_delta_uploaded_to_s3_is_fetched_alone_rebuilt_and_served_under_load(
    moto_server, tmp_path: Path, daemon_factory: Callable[..., DaemonProcess], db_url: str
) -> None:
    s3 = moto_server.client()
    s3.create_bucket(Bucket="ckpts")
    cache = tmp_path / "s3cache"
    sources = [{"type": "s3", "bucket": "ckpts", "prefix": "run/", "endpoint_url": moto_server.url, "name": "bucket",
                "poll_interval_s": 0.5, "cache_dir": str(cache)}]  # fmt: skip
    d = daemon_factory(db_url, sources=sources, checks=CHECKS, env=moto_server.env(), wait=False,
                       daemon={"keep_workers_on_stop": False}, extra=WORKERS)  # fmt: skip
    load: LoadGen | None = None
    cli_env = moto_server.env()
    try:
        d.start(timeout=120)
        d.wait_status("tiny-seed", "deployed", timeout=120)
        url = serving_url(d)
        v1, v2 = tmp_path / "trainer" / "v1", tmp_path / "trainer" / "v2"
        publish_tiny(v1, seed=1)
        r = hotswap_cli("publish", str(v1), "--to", "s3://ckpts/run/v1", "--endpoint-url", moto_server.url, env=cli_env)
        assert r.returncode == 0, r.stderr
        d.wait_status("v1", "deployed", timeout=180)
        full = fetched_counter(d, "bucket", "full")
        assert full == load_manifest(v1).total_bytes
        load = LoadGen([url], concurrency=3, max_seconds=400)
        with load:
            load.wait_requests(10, timeout=120)
            step(v1, v2, 1e-3, 2)
            out = tmp_path / "out" / "v2"
            r = hotswap_cli("publish", str(v2), "--delta-from", str(v1), "--out", str(out), "--anchor-share", "100",
                            "--to", "s3://ckpts/run/v2", "--endpoint-url", moto_server.url, env=cli_env)  # fmt: skip
            assert r.returncode == 0, r.stderr
            assert "as a delta of v1" in r.stdout and "uploaded v2" in r.stdout, r.stdout
            listed = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="ckpts", Prefix="run/v2/")["Contents"])
            assert listed == [f"run/v2/{DELTA_DIR}/model.safetensors.hsd", f"run/v2/{MANIFEST_NAME}"]
            row = d.wait_status("v2", "deployed", timeout=180)
            load.wait_requests(10, timeout=120)
        spec = parse(load_manifest(out), "t")
        assert spec is not None
        assert (row["encoding"], row["delta_base"], row["fetched_bytes"]) == ("delta", "v1", spec.delta_bytes)
        assert spec.delta_bytes < load_manifest(v2).total_bytes
        assert shipped(cache / "v2") == [f"{DELTA_DIR}/model.safetensors.hsd", MANIFEST_NAME]  # only the delta came
        assert fetched_counter(d, "bucket", "delta") == spec.delta_bytes
        assert fetched_counter(d, "bucket", "full") == full  # nothing more was fetched in full
        stats = load.stats
        assert stats.errors == [] and stats.failed == 0, f"{stats.failed} of {stats.sent} failed: {stats.errors[:5]}"
        assert "v2" in stats.versions
        assert httpx.post(f"{url}/v1/completions", json=PROBE, timeout=30).json()["weight_version"] == "v2"
        assert d.get("/status").json()["aliases"]["serving"] == "v2"
    finally:
        if load is not None:
            load.stop()
        close_managed(d)


def test_a_pushed_delta_uploads_only_its_delta_files_and_is_served(
    tmp_path: Path, daemon_factory: Callable[..., DaemonProcess], db_url: str
) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    key = tmp_path / "hmac.key"
    key.write_bytes(os.urandom(32).hex().encode())
    sources = [{"type": "push", "name": "push", "path": str(tmp_path / "pushed"), "token_file": str(tmp_path / "token"),
                "listen": "127.0.0.1:0", "hmac_keys": {"trainer": str(key)}}]  # fmt: skip
    d = daemon_factory(db_url, sources=sources, checks={**CHECKS, "hmac_keys": {"trainer": str(key)}}, wait=False,
                       daemon={"keep_workers_on_stop": False}, extra=WORKERS)  # fmt: skip
    try:
        d.start(timeout=120)
        d.wait_status("tiny-seed", "deployed", timeout=120)
        url = serving_url(d)
        [src] = [s for s in d.get("/status").json()["sources"] if s["name"] == "push"]
        signer = HmacSigner("trainer", key.read_bytes())
        v1, v2, out = tmp_path / "trainer" / "v1", tmp_path / "trainer" / "v2", tmp_path / "out" / "v2"
        publish_tiny(v1, seed=1)
        publish(v1, version="v1", signer=signer)
        assert push(v1, src["url"], TOKEN, None, retries=0, timeout_s=120)["status"] == "committed"
        d.wait_status("v1", "deployed", timeout=180)
        step(v1, v2, 1e-3, 2)
        spec = publish_delta(v2, v1, out, version="v2", signer=signer, rule=AnchorRule(share=100.0)).spec
        assert spec is not None
        assert push(out, src["url"], TOKEN, None, retries=0, timeout_s=120)["status"] == "committed"
        row = d.wait_status("v2", "deployed", timeout=180)
        assert (row["encoding"], row["delta_base"], row["fetched_bytes"]) == ("delta", "v1", spec.delta_bytes)
        assert shipped(tmp_path / "pushed" / "v2") == [f"{DELTA_DIR}/model.safetensors.hsd", MANIFEST_NAME]
        assert fetched_counter(d, "push", "delta") == spec.delta_bytes
        assert httpx.post(f"{url}/v1/completions", json=PROBE, timeout=30).json()["weight_version"] == "v2"
    finally:
        close_managed(d)
