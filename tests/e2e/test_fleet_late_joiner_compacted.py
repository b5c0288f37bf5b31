"""A late joiner converges from the anchor plus the compacted delta, not the chain (issue 38).

Real PostgreSQL, two real fleet daemons, real reference workers, a real moto S3 server on loopback,
the fixtures of test_fleet_late_joiner_s3. The trainer publishes v1 (full: the anchor), v2 (a delta
of v1) and v3 (a delta of v2 plus the compacted delta v1 -> v3, `hotswap-compact/`) and uploads each
with the client (`publish_s3`: the delta files, the compacted ones, the manifest last); host-0
deploys each as it comes. host-1 then joins with an empty cache:

* compacted: it fetches v1 (full) and v3's compacted files only, never v2 and never v3's own delta
  files: the S3 source's downloads and host-1's `hotswap_fetched_bytes_total` say so, byte for byte;
  v3 is rebuilt once from v1, checked against the digests it was verified with, and served.
* corrupt: v3's compacted file in the bucket is replaced by other bytes of the same size: host-1
  logs why it cannot use it and replays the chain (v1, v2, v3) instead, and serves v3.
* broken: the compacted file is corrupt and v2's delta file is gone too: host-1 names both problems,
  builds nothing half-way, and its worker keeps serving v0.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import POSTGRES_ENV, DaemonProcess
from support_delta import step
from support_rollout import WorkerPool, build_checkpoint
from support_s3 import MotoServer
from support_wait import wait_until

from daemon.client import publish_delta, publish_s3
from daemon.delta.anchors import AnchorRule
from daemon.delta.section import COMPACT_DIR, DELTA_DIR
from daemon.manifest import load_manifest
from tests.e2e.test_delta_sources import fetched_counter
from tests.e2e.test_fleet_late_joiner_s3 import (
    BUCKET,
    LABEL,
    PREFIX,
    cache_of,
    location,
    log_events,
    on,
    s3_host,
)

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")]  # fmt: skip
FILE = "model.safetensors"


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path / "pool", n=2)
    yield p
    p.close()


def events(d: DaemonProcess, name: str) -> list[dict[str, Any]]:
    return [e for e in log_events(d) if e.get("event") == name]


@pytest.mark.parametrize("case", ["compacted", "corrupt", "broken"])
def test_a_late_joiner_takes_the_anchor_and_the_compacted_delta(
    case: str, tmp_path: Path, pg_url: str, pool: WorkerPool, moto_server: MotoServer,
    daemon_factory: Callable[..., DaemonProcess],
) -> None:  # fmt: skip
    s3 = moto_server.client()
    s3.create_bucket(Bucket=BUCKET)
    w = pool.workers
    first = s3_host(daemon_factory, pg_url, 0, w[0], moto_server, tmp_path)
    first.start(timeout=120)
    on(pg_url, 0, "v0", first)
    full = {"v1": build_checkpoint(tmp_path / "trainer" / "v1", "v1", 1)}
    publish_s3(full["v1"], f"s3://{BUCKET}/{PREFIX}v1", client=s3)
    on(pg_url, 0, "v1", first)
    shipped: dict[str, Any] = {}
    for version, base in (("v2", "v1"), ("v3", "v2")):
        full[version] = tmp_path / "trainer" / version
        step(full[base], full[version], 1e-3, 7)  # the same elements move again: v1 -> v3 is about one link
        out = tmp_path / "shipped" / version
        shipped[version] = publish_delta(full[version], full[base], out, version=version,
                                         rule=AnchorRule(share=100.0)).spec  # fmt: skip
        publish_s3(out, f"s3://{BUCKET}/{PREFIX}{version}", client=s3)
        on(pg_url, 0, version, first)
    v3 = shipped["v3"]
    assert v3 is not None and v3.compacted is not None and v3.compacted.base_version == "v1"
    assert v3.compacted.delta_bytes < v3.chain_bytes, (v3.compacted.delta_bytes, v3.chain_bytes)
    compact_key = f"{PREFIX}v3/{COMPACT_DIR}/{FILE}.hsd"
    if case in ("corrupt", "broken"):
        size = s3.head_object(Bucket=BUCKET, Key=compact_key)["ContentLength"]
        s3.put_object(Bucket=BUCKET, Key=compact_key, Body=os.urandom(size))  # same size, other bytes
    if case == "broken":
        s3.delete_object(Bucket=BUCKET, Key=f"{PREFIX}v2/{DELTA_DIR}/{FILE}.hsd")

    late = s3_host(daemon_factory, pg_url, 1, w[1], moto_server, tmp_path)
    late.start(timeout=120)
    rebuilt = late.state_dir / "deltas"
    if case == "broken":
        failed = wait_until(lambda: [e for e in events(late, "fetching this host's copy failed")
                                     if e.get("version") == "v3"], 180, 0.2, "host-1 giving up on v3")  # fmt: skip
        assert "base v2 has no copy on this host" in str(failed[0].get("reason")), failed[0]
        gap = [e for e in events(late, "fetching this host's copy failed") if e.get("version") == "v2"]
        assert gap and f"{DELTA_DIR}/{FILE}.hsd" in str(gap[0].get("reason")), gap  # the missing link, named
        unusable = events(late, "the compacted delta cannot be used: replaying the chain instead")
        assert unusable and f"{COMPACT_DIR}/{FILE}.hsd" in str(unusable[0].get("reason")), unusable
        info = w[1].info()
        assert (info["state"], info["version"]) == ("RUNNING", "v0"), (
            info
        )  # the serving version keeps serving
        assert location(pg_url, "v3", "host-1") is None
        assert not rebuilt.is_dir() or sorted(p.name for p in rebuilt.iterdir()) == [], list(
            rebuilt.iterdir()
        )
        return
    on(pg_url, 1, "v3", late)
    fetched = [e.get("version") for e in events(late, "fetched this host's copy")]
    downloads = {e["version"]: e for e in events(late, "downloaded")}
    if case == "compacted":
        assert fetched == ["v1", "v3"], fetched  # the anchor, then v3 from its compacted delta: no chain
        assert not events(late, "no copy of its base on this host: fetching the chain first")
        assert sorted(downloads) == ["v1", "v3"], sorted(downloads)
        v1_bytes = load_manifest(full["v1"]).total_bytes
        assert downloads["v1"]["bytes"] == v1_bytes
        assert (
            downloads["v3"]["bytes"] == v3.compacted.delta_bytes
            and downloads["v3"]["encoding"] == "compacted"
        )
        assert fetched_counter(late, LABEL, "full") == v1_bytes
        assert fetched_counter(late, LABEL, "delta") == v3.compacted.delta_bytes  # not v2's, not v3's own
        came = sorted(p.relative_to(cache_of(tmp_path, 1) / "v3").as_posix()
                      for p in (cache_of(tmp_path, 1) / "v3").rglob("*") if p.is_file())  # fmt: skip
        assert came == [f"{COMPACT_DIR}/{FILE}.hsd", "hotswap-manifest.json"], came
    else:  # corrupt: named, then the chain
        unusable = events(late, "the compacted delta cannot be used: replaying the chain instead")
        assert unusable and "does not match the manifest" in str(unusable[0].get("reason")), unusable
        assert fetched == ["v1", "v2", "v3"], fetched
    assert location(pg_url, "v3", "host-1") == str(rebuilt / "v3")
    for f in sorted(p for p in full["v3"].iterdir() if p.is_file()):
        assert (rebuilt / "v3" / f.name).read_bytes() == f.read_bytes(), f.name
    info = w[1].wait_running(60, version="v3")
    assert Path(info["path"]).resolve() == (rebuilt / "v3").resolve(), info
