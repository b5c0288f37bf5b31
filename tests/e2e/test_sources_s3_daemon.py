"""The real daemon with a local folder and an S3 prefix (moto server subprocess): one checkpoints table."""

from __future__ import annotations

from conftest import publish_tiny
from sqlalchemy import select
from support_s3 import upload_dir

from daemon.registry.models import Checkpoint

CHECKS = {"enabled": ["manifest", "headers", "crc32c"]}



def test_s3_and_local_sources_feed_the_same_checkpoints_table(moto_server, daemon_factory, db_url, tmp_path):
    s3 = moto_server.client()
    s3.create_bucket(Bucket="ckpts")
    watch = tmp_path / "watch"
    cache = tmp_path / "s3cache"
    sources = [
        {"path": str(watch), "rescan_interval_s": 1.0, "name": "local"},
        {"type": "s3", "bucket": "ckpts", "prefix": "run/", "endpoint_url": moto_server.url, "name": "bucket",
         "poll_interval_s": 0.5, "cache_dir": str(cache)},
    ]  # fmt: skip
    d = daemon_factory(db_url, sources=sources, checks=CHECKS, env=moto_server.env())
    publish_tiny(tmp_path / "up" / "s3-step-1", seed=1, shards=2)
    upload_dir(s3, "ckpts", "run/s3-step-1/", tmp_path / "up" / "s3-step-1", manifest_first=True)
    publish_tiny(watch / "local-step-1", seed=2)
    s3_row = d.wait_status("s3-step-1", "verified", timeout=60)
    local_row = d.wait_status("local-step-1", "verified", timeout=60)
    assert s3_row["source"] == "bucket" and local_row["source"] == "local"
    assert s3_row["local_path"] == str(cache / "s3-step-1")
    assert (cache / "s3-step-1" / "hotswap-manifest.json").is_file()
    status = d.get("/status").json()
    assert {s["name"] for s in status["sources"]} == {"local", "bucket"}
    assert "testing-secret" not in d.log()  # credentials come from the chain and are never logged


def test_a_folder_squatting_another_version_is_refused_by_the_daemon(moto_server, daemon_factory, db_url, tmp_path):
    """`aaa-squat/` (listed first) claims version `legit` in its manifest: the daemon registers only
    the real `legit/`, fetches it into cache/legit, and /status names the refused folder and why."""
    s3 = moto_server.client()
    s3.create_bucket(Bucket="ckpts")
    publish_tiny(tmp_path / "evil" / "aaa-squat", seed=9, version="legit")
    upload_dir(s3, "ckpts", "run/aaa-squat/", tmp_path / "evil" / "aaa-squat")
    publish_tiny(tmp_path / "real" / "legit", seed=1)
    upload_dir(s3, "ckpts", "run/legit/", tmp_path / "real" / "legit")
    cache = tmp_path / "s3cache"
    sources = [{"type": "s3", "bucket": "ckpts", "prefix": "run/", "endpoint_url": moto_server.url, "name": "bucket",
                "poll_interval_s": 0.5, "cache_dir": str(cache)}]  # fmt: skip
    d = daemon_factory(db_url, sources=sources, checks=CHECKS, env=moto_server.env())
    row = d.wait_status("legit", "verified", timeout=60)
    assert row["local_path"] == str(cache / "legit")
    with d.registry.session() as s:
        assert s.execute(select(Checkpoint.version, Checkpoint.uri)).all() == [("legit", "s3://ckpts/run/legit/")]
    for p in (tmp_path / "real" / "legit").iterdir():
        assert (cache / "legit" / p.name).read_bytes() == p.read_bytes()
    [src] = [s for s in d.get("/status").json()["sources"] if s["name"] == "bucket"]
    assert "holds a manifest for version 'legit'" in src["refused"]["aaa-squat"], src
    assert d.log().count("checkpoint refused") == 1, d.log()[-3000:]
