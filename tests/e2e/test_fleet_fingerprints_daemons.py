"""Each host of a fleet compares its own copy of the serving version only with the fingerprint it
recorded for that copy (issue 36, item 3), with three real daemons on one PostgreSQL registry.

Every host has its own folder, and its copies are made at different times (the times in a
fingerprint differ from host to host, the bytes do not): no host may report
`serving_files_changed` for a copy nobody touched, and a host whose own copy changes does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import POSTGRES_ENV, DaemonProcess, wait_until
from support_fleet_daemons import aliases_of, host_daemon
from support_rollout import WorkerPool, publish_into

from daemon.pipeline.rediscovery import changed_since_verdict
from daemon.registry import Registry
from daemon.registry import queries as q

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")]  # fmt: skip


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path / "pool", n=3)
    yield p
    p.close()


def changed(url: str, host: str, version: str, directory: Path) -> bool:
    """What `host`'s health probe asks of its own copy (the same call, on the shared registry)."""
    reg = Registry(url, host)
    try:
        with reg.session() as s:
            ckpt = q.get_checkpoint(s, version)
            assert ckpt is not None
            return changed_since_verdict(s, ckpt.id, directory)
    finally:
        reg.close()


def files_problem(d: DaemonProcess) -> list[dict[str, object]]:
    return [p for p in d.get("/health").json().get("problems", []) if p["kind"] == "serving_files_changed"]


def test_each_host_compares_its_own_copy_only(
    pg_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    d = [host_daemon(daemon_factory, pg_url, i, pool.workers[i], {}) for i in range(3)]  # each its own v0 copy
    for x in d:
        x.start(timeout=120)
    for i in range(3):
        wait_until(lambda i=i: aliases_of(pg_url, f"host-{i}") == {"serving": "v0", "last_good": "v0"}, 240, 0.2,
                   f"host-{i} on v0")  # fmt: skip
    for i, x in enumerate(d):  # copies made at different times: none changed since its own host recorded it
        assert not changed(pg_url, f"host-{i}", "v0", x.watch_dir / "v0"), f"host-{i}"

    for i in (1, 0, 2):  # v1 reaches host-1 first (it verifies it), the others later, one by one
        publish_into(d[i].watch_dir, "v1", seed=1)
        wait_until(lambda i=i: _known_here(pg_url, f"host-{i}", "v1"), 120, 0.2,
                   f"host-{i}'s copy of v1 recorded")  # fmt: skip
    for i in range(3):
        wait_until(lambda i=i: aliases_of(pg_url, f"host-{i}") == {"serving": "v1", "last_good": "v1"}, 300, 0.2,
                   f"host-{i} on v1")  # fmt: skip
    for i, x in enumerate(d):
        assert not changed(pg_url, f"host-{i}", "v1", x.watch_dir / "v1"), f"host-{i}"

    shard = next((d[2].watch_dir / "v1").glob("*.safetensors"))
    with shard.open("ab") as f:
        f.write(b"\0" * 8)  # host-2's own copy changes after its verdict; the others' do not
    assert changed(pg_url, "host-2", "v1", d[2].watch_dir / "v1")
    assert not changed(pg_url, "host-0", "v1", d[0].watch_dir / "v1")
    found = wait_until(lambda: files_problem(d[2]), 60, 0.2, "host-2's serving_files_changed")
    assert found[0]["subject"] == "v1", found
    for x in d[:2]:  # their probes ran as often as host-2's: their own copies are what they verified
        assert not files_problem(x), x.get("/health").json()


def _known_here(url: str, host: str, version: str) -> bool:
    reg = Registry(url, host)
    try:
        with reg.session() as s:
            ckpt = q.get_checkpoint(s, version)
            from daemon.registry import hosts

            return ckpt is not None and hosts.local_path(s, ckpt.id) is not None
    finally:
        reg.close()
