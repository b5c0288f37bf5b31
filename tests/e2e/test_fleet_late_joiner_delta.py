"""A late joiner converges on a delta version from the anchor plus the chain (issue 38).

Real PostgreSQL, two real fleet daemons, real reference workers, a real moto S3 server on loopback.
The bucket holds v1 (full: the anchor), v2 (a delta of v1) and v3 (a delta of v2); host-0 deploys
each as it comes. host-1 then joins with an empty cache: its fleet agent fetches the target v3 (only
its delta files), finds no copy of v2 here, fetches v2, finds no v1, fetches v1 (full), then
rebuilds v2 and v3 in order, each checked against the digests the version was verified with, and
its worker serves v3 rebuilt on host-1, bit-identical to the trainer's full files.
Without the chain host-1 would record v3's delta files as its copy and never serve it.
(No compacted delta is published here: test_fleet_late_joiner_compacted.py takes that way.)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import POSTGRES_ENV, DaemonProcess
from support_delta import step
from support_rollout import WorkerPool, build_checkpoint
from support_s3 import MotoServer, upload_dir

from daemon.client import publish_delta
from daemon.delta.anchors import AnchorRule
from daemon.delta.section import DELTA_DIR
from tests.e2e.test_fleet_late_joiner_s3 import BUCKET, PREFIX, cache_of, location, log_events, on, s3_host

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")]  # fmt: skip


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path / "pool", n=2)
    yield p
    p.close()


def test_a_late_joiner_rebuilds_the_target_from_the_anchor_and_the_chain(
    tmp_path: Path, pg_url: str, pool: WorkerPool, moto_server: MotoServer,
    daemon_factory: Callable[..., DaemonProcess],
) -> None:  # fmt: skip
    s3 = moto_server.client()
    s3.create_bucket(Bucket=BUCKET)
    w = pool.workers
    first = s3_host(daemon_factory, pg_url, 0, w[0], moto_server, tmp_path)
    first.start(timeout=120)
    on(pg_url, 0, "v0", first)
    full = {"v1": build_checkpoint(tmp_path / "trainer" / "v1", "v1", 1)}
    upload_dir(s3, BUCKET, f"{PREFIX}v1/", full["v1"])
    on(pg_url, 0, "v1", first)
    for version, base in (("v2", "v1"), ("v3", "v2")):
        full[version] = tmp_path / "trainer" / version
        step(full[base], full[version], 1e-3, int(version[1:]))
        out = tmp_path / "shipped" / version
        p = publish_delta(full[version], full[base], out, version=version, rule=AnchorRule(share=100.0),
                          compact=False)  # the chain alone (the compacted delta: ..._compacted.py)
        assert p.spec is not None and p.spec.base_version == base
        upload_dir(s3, BUCKET, f"{PREFIX}{version}/", out)
        on(pg_url, 0, version, first)

    late = s3_host(daemon_factory, pg_url, 1, w[1], moto_server, tmp_path)
    late.start(timeout=120)
    on(pg_url, 1, "v3", late)

    events = log_events(late)
    fetched = [e.get("version") for e in events if e.get("event") == "fetched this host's copy"]
    assert fetched == ["v1", "v2", "v3"], fetched  # the anchor first, then each link rebuilt in order
    chain = [e.get("version") for e in events if e.get("event") == "no copy of its base on this host: fetching the chain first"]
    assert chain == ["v3", "v2"], chain
    rebuilt = late.state_dir / "deltas"
    assert location(pg_url, "v3", "host-1") == str(rebuilt / "v3")
    assert location(pg_url, "v1", "host-1") == str(cache_of(tmp_path, 1) / "v1")
    for version in ("v2", "v3"):  # only their delta files came down
        came = sorted(p.relative_to(cache_of(tmp_path, 1) / version).as_posix()
                      for p in (cache_of(tmp_path, 1) / version).rglob("*") if p.is_file())  # fmt: skip
        assert all(c.startswith(f"{DELTA_DIR}/") or c == "hotswap-manifest.json" for c in came), came
    for f in sorted(p for p in full["v3"].iterdir() if p.is_file()):
        assert (rebuilt / "v3" / f.name).read_bytes() == f.read_bytes(), f.name
    info = w[1].wait_running(60, version="v3")
    assert Path(info["path"]).resolve() == (rebuilt / "v3").resolve(), info
