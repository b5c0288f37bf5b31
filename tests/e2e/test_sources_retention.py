"""Retention through the daemon: its prune job asks the registry what is protected, and the S3
source's cache keeps the serving and last good versions whatever their age."""

from __future__ import annotations

import os

import pytest
from support_s3 import random_file

from daemon.config import parse_config
from daemon.registry import status
from daemon.registry.journal import Journal
from daemon.registry.status import CheckpointStatus as C
from daemon.service import build_daemon

pytestmark = pytest.mark.quick

MIB = 1024 * 1024


def test_daemon_prune_never_deletes_serving_or_last_good(tmp_path, db_url):
    cache = tmp_path / "cache"
    cfg = parse_config({
        "daemon": {"state_dir": str(tmp_path / "state"), "listen": ""},
        "database": {"url": db_url},
        "sources": [{"type": "s3", "name": "bucket", "bucket": "b", "endpoint_url": "http://127.0.0.1:9",
                     "cache_dir": str(cache), "cache_max_bytes": 3 * MIB}],
    }, "test")  # fmt: skip
    d = build_daemon(cfg)
    d.registry.upgrade()
    try:
        ids: dict[str, int] = {}
        for i, name in enumerate(["serving-v", "last-good-v", "old-1", "old-2"]):
            random_file(cache / name / "w.bin", 2 * MIB, seed=i)
            os.utime(cache / name, (1000 + i, 1000 + i))  # the protected ones are the oldest
            with d.registry.session() as s:
                ckpt = status.create(s, version=name, source="bucket", uri=f"s3://b/{name}/",
                                     local_path=str(cache / name), commit_signal="manifest")  # fmt: skip
                assert ckpt is not None
                status.move(s, ckpt, C.VERIFYING)
                status.move(s, ckpt, C.REJECTED, "finished, not in flight")
                ids[name] = ckpt.id
        journal = Journal(d.registry)
        journal.set_alias("serving", ids["serving-v"])
        journal.set_alias("last_good", ids["last-good-v"])
        assert d.protected_paths() == frozenset({cache / "serving-v", cache / "last-good-v"})
        removed = d.prune()
        assert sorted(p.name for p in removed) == ["old-1", "old-2"]
        assert sorted(p.name for p in cache.iterdir()) == ["last-good-v", "serving-v"]
        assert d.prune() == []  # still over the limit: only protected versions are left
    finally:
        d.registry.close()
