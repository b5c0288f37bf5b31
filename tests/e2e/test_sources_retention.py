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


def test_prune_keeps_the_base_a_fetched_delta_is_still_to_be_rebuilt_from(tmp_path, db_url):
    """`base-v` is old and no alias names it, but `step-v`, fetched and not yet rebuilt, is a delta of it:
    retention keeps it (and takes it once the delta no longer waits)."""
    from conftest import publish_tiny
    from support_delta import step

    from daemon.client import publish_delta
    from daemon.delta.anchors import AnchorRule

    cache = tmp_path / "cache"
    cfg = parse_config({
        "daemon": {"state_dir": str(tmp_path / "state"), "listen": ""},
        "database": {"url": db_url},
        "sources": [{"type": "s3", "name": "bucket", "bucket": "b", "endpoint_url": "http://127.0.0.1:9",
                     "cache_dir": str(cache), "cache_max_bytes": 1}],
    }, "test")  # fmt: skip
    d = build_daemon(cfg)
    d.registry.upgrade()
    try:
        publish_tiny(cache / "base-v", seed=1)
        step(cache / "base-v", tmp_path / "new", 1e-3, 2)
        publish_delta(tmp_path / "new", cache / "base-v", cache / "step-v", version="step-v", rule=AnchorRule(share=100))
        random_file(cache / "old-1" / "w.bin", MIB, seed=3)
        rows = {}
        for name, to in (("base-v", C.REJECTED), ("old-1", C.REJECTED), ("step-v", C.FETCHING)):
            with d.registry.session() as s:
                ckpt = status.create(s, version=name, source="bucket", uri=f"s3://b/{name}/",
                                     local_path=str(cache / name), commit_signal="manifest")  # fmt: skip
                assert ckpt is not None
                if to == C.REJECTED:
                    status.move(s, ckpt, C.VERIFYING)
                status.move(s, ckpt, to, "as the test needs")
                rows[name] = ckpt.id
        assert d.protected_paths() == frozenset({cache / "base-v", cache / "step-v"})
        assert sorted(p.name for p in d.prune()) == ["old-1"]
        with d.registry.session() as s:
            from daemon.registry import queries as q

            done = q.get_checkpoint_by_id(s, rows["step-v"])
            assert done is not None
            status.move(s, done, C.REJECTED, "no longer waits")
        assert sorted(p.name for p in d.prune()) == ["base-v", "step-v"]
    finally:
        d.registry.close()


def test_prune_removes_rebuilt_versions_nothing_needs(tmp_path, db_url):
    """state_dir/deltas: a rejected version's rebuild and a finished one older than last good go; last
    good's, a newer one's (a trainer's next base) and a rebuild in progress stay."""
    from daemon.registry import queries as q

    cfg = parse_config({"daemon": {"state_dir": str(tmp_path / "state"), "listen": ""},
                        "database": {"url": db_url}, "sources": []}, "test")  # fmt: skip
    d = build_daemon(cfg)
    d.registry.upgrade()
    rebuilt = d.coordinator.delta_dir
    try:
        ids = {}
        for name, to in (("old", C.SUPERSEDED), ("rej", C.REJECTED), ("good", C.VERIFIED), ("newer", C.SUPERSEDED)):
            random_file(rebuilt / name / "w.bin", 1024, seed=1)
            with d.registry.session() as s:
                ckpt = status.create(s, version=name, source="local", uri=f"file:///x/{name}",
                                     local_path=str(rebuilt / name), commit_signal="manifest")  # fmt: skip
                assert ckpt is not None
                status.move(s, ckpt, C.VERIFYING)
                status.move(s, ckpt, C.VERIFIED if to == C.SUPERSEDED else to, "as the test needs")
                if to == C.SUPERSEDED:
                    status.move(s, ckpt, to, "a newer version came first")
                ids[name] = ckpt.id
        (rebuilt / ".newest.tmp-1").mkdir()
        Journal(d.registry).set_alias("last_good", ids["good"])
        with d.registry.session() as s:
            assert q.aliases(s)["last_good"] == "good"
        assert sorted(p.name for p in d.prune()) == ["old", "rej"]
        assert sorted(p.name for p in rebuilt.iterdir()) == [".newest.tmp-1", "good", "newer"]
    finally:
        d.registry.close()
