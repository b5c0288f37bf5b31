"""The push source inside the real daemon: a 1 GiB checkpoint streamed in while the daemon's RSS
stays flat, then verified through the same pipeline; a repeat push is the same one checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from pathlib import Path

import psutil
import pytest
from conftest import publish_tiny

from daemon.checks.signatures import HmacSigner
from daemon.client import PushError, push
from daemon.manifest import publish

GIB = 1024**3
TOKEN = "daemon-push-token-42"


def sparse_checkpoint(directory: Path, size: int) -> None:
    """A `size`-byte safetensors file (one U8 tensor) that costs little disk: holes, with random
    1 MiB blocks every 128 MiB."""
    directory.mkdir(parents=True)
    header = b""
    for _ in range(2):  # the header's length depends on the tensor's, which depends on the header's
        n = size - 8 - len(header)
        doc = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
        header = doc + b" " * (-len(doc) % 8)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(size)
        for offset in range(64 * 1024 * 1024, size - 1024 * 1024, 128 * 1024 * 1024):
            f.seek(offset)
            f.write(os.urandom(1024 * 1024))


@pytest.mark.slow
def test_one_gib_push_keeps_daemon_rss_flat_and_is_one_checkpoint(daemon_factory, tmp_path):
    if shutil.disk_usage(tmp_path).free < 4 * GIB:
        pytest.skip("needs 4 GiB of free disk for the pushed copy")
    (tmp_path / "token").write_text(TOKEN + "\n")
    key = tmp_path / "hmac.key"
    key.write_bytes(os.urandom(32).hex().encode())
    registry = tmp_path / "pushed"
    db_url = f"sqlite:///{tmp_path / 'registry.db'}"
    d = daemon_factory(
        db_url,
        sources=[{"type": "push", "name": "push", "path": str(registry), "token_file": str(tmp_path / "token"),
                  "listen": "127.0.0.1:0", "hmac_keys": {"trainer": str(key)}}],
        checks={"enabled": ["manifest", "crc32c"], "hmac_keys": {"trainer": str(key)}},
    )  # fmt: skip
    [src] = [s for s in d.get("/status").json()["sources"] if s["name"] == "push"]
    url = src["url"]
    big = tmp_path / "out" / "big-1"
    sparse_checkpoint(big, GIB)
    publish(big, signer=HmacSigner("trainer", key.read_bytes()))
    proc = psutil.Process(d.pid)
    base = proc.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], proc.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        answer = push(big, url, TOKEN, None, retries=0, timeout_s=600)
    finally:
        done.set()
        sampler.join()
    try:
        assert answer["status"] == "committed"
        growth_mb = (peak[0] - base) / 1e6
        assert growth_mb < 100, f"daemon RSS grew by {growth_mb:.0f} MB during a 1 GiB push"
        row = d.wait_status("big-1", "verified", timeout=240)
        assert row["source"] == "push" and row["local_path"] == str(registry / "big-1")
        assert os.path.getsize(registry / "big-1" / "model.safetensors") == GIB
        # the same version and content again: still one checkpoint; other content: 409
        small = tmp_path / "out" / "small-1"
        publish_tiny(small, seed=1, version="small-1")
        assert push(small, url, TOKEN, key, key_id="trainer")["status"] == "committed"
        assert push(small, url, TOKEN, key, key_id="trainer")["status"] == "exists"
        d.wait_status("small-1", "verified", timeout=60)
        other = tmp_path / "out2" / "small-1"
        publish_tiny(other, seed=2, version="small-1")
        with pytest.raises(PushError) as err:
            push(other, url, TOKEN, key, key_id="trainer", retries=0)
        assert err.value.status == 409
        assert [r["version"] for r in d.history()].count("small-1") == 1
    finally:
        shutil.rmtree(registry, ignore_errors=True)  # pytest keeps recent tmp dirs: do not leave 1 GiB
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
