"""The S3 source against a real moto server subprocess on loopback, uploads made with plain boto3."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from conftest import publish_tiny, wait_until
from support_s3 import put_file, put_multipart, random_file, upload_dir

from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.manifest import publish
from daemon.sources.base import FetchError, FetchItem
from daemon.sources.s3 import S3Source, S3SourceConfig

BUCKET = "ckpts"



class Recorder:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def __call__(self, item: Any) -> int:
        self.items.append(item)
        return len(self.items)


def make_source(server: Any, tmp_path: Path, **kw: Any) -> tuple[S3Source, Recorder]:
    rec = Recorder()
    cfg = S3SourceConfig(bucket=BUCKET, prefix="run-1", endpoint_url=server.url, poll_interval_s=3600,
                         cache_dir=str(tmp_path / "cache"), max_attempts=1, connect_timeout_s=2,
                         read_timeout_s=5, retry_after_s=0.5, **kw)  # fmt: skip
    cfg.validate("sources[0]")
    return S3Source(cfg, rec), rec


def fetch(src: S3Source, item: Any, progress: Any = None) -> Path:
    return src.fetch(FetchItem(1, item.version, item.uri), progress or (lambda done, total: None))


def test_manifest_first_is_registered_once_only_after_the_last_object(moto_server, tmp_path):
    s3 = moto_server.client()
    s3.create_bucket(Bucket=BUCKET)
    ckpt = tmp_path / "step-1"
    publish_tiny(ckpt, seed=1, shards=2)
    (ckpt / "extra.bin").write_bytes(os.urandom(4096))
    publish(ckpt)  # list extra.bin too
    src, rec = make_source(moto_server, tmp_path)
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    files.sort(key=lambda p: p.name != MANIFEST_NAME)  # manifest FIRST, as sync tools may do
    assert files[0].name == MANIFEST_NAME and len(files) >= 4
    for p in files:
        assert src.scan() == [] and rec.items == [], f"registered before {p.name} was uploaded"
        put_file(s3, BUCKET, f"run-1/step-1/{p.name}", p)
    # the last object could also land short: a listed size that does not match is not committed
    s3.put_object(Bucket=BUCKET, Key="run-1/step-1/extra.bin", Body=b"short")
    assert src.scan() == []
    put_file(s3, BUCKET, "run-1/step-1/extra.bin", ckpt / "extra.bin")
    found = src.scan()
    assert [i.version for i in found] == ["step-1"] and found[0].directory is None
    assert found[0].uri == f"s3://{BUCKET}/run-1/step-1/"
    assert src.scan() == [] and len(rec.items) == 1  # once
    directory = fetch(src, found[0])
    assert directory == tmp_path / "cache" / "step-1"
    assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in files)
    for p in files:
        assert (directory / p.name).read_bytes() == p.read_bytes()


def test_multipart_objects_verify_with_full_object_crc(moto_server, tmp_path):
    s3 = moto_server.client()
    s3.create_bucket(Bucket=BUCKET)
    ckpt = tmp_path / "mp"
    random_file(ckpt / "big.bin", 11 * 1024 * 1024 + 123, seed=3)
    random_file(ckpt / "small.bin", 1000, seed=4)
    publish(ckpt, version="mp")
    put_multipart(s3, BUCKET, "run-1/mp/big.bin", ckpt / "big.bin")
    put_file(s3, BUCKET, "run-1/mp/small.bin", ckpt / "small.bin")
    put_file(s3, BUCKET, f"run-1/mp/{MANIFEST_NAME}", ckpt / MANIFEST_NAME)
    head = s3.head_object(Bucket=BUCKET, Key="run-1/mp/big.bin")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart ETag: not an MD5 of the bytes
    src, _ = make_source(moto_server, tmp_path, part_bytes=4 * 1024 * 1024, concurrency=4)
    [item] = src.scan()
    directory = fetch(src, item)
    assert (directory / "big.bin").read_bytes() == (ckpt / "big.bin").read_bytes()
    stats = src.last_fetch["mp"]
    assert stats.full_object_crcs == 2 and stats.downloaded_bytes == stats.total_bytes


def test_corrupted_object_is_rejected_naming_the_file(moto_server, tmp_path):
    s3 = moto_server.client()
    s3.create_bucket(Bucket=BUCKET)
    ckpt = tmp_path / "bad"
    publish_tiny(ckpt, seed=2)
    upload_dir(s3, BUCKET, "run-1/bad/", ckpt)
    shard = next(p for p in ckpt.iterdir() if p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x40  # same size: only the bytes tell
    s3.put_object(Bucket=BUCKET, Key=f"run-1/bad/{shard.name}", Body=bytes(data))
    src, _ = make_source(moto_server, tmp_path)
    [item] = src.scan()
    with pytest.raises(FetchError) as err:
        fetch(src, item)
    assert shard.name in err.value.reason and err.value.retry_after_s is None
    assert not (tmp_path / "cache" / "bad").exists()  # nothing half-verified is handed on


def test_s3_crc_disagreeing_with_the_bytes_is_rejected(moto_server, tmp_path):
    """S3's FULL_OBJECT CRC32C is compared too: here the manifest was made for the bytes S3 holds
    under another checksum (the object was re-put with a forged checksum header is impossible, so
    the manifest lists the real bytes and S3 reports a different object's CRC)."""
    s3 = moto_server.client()
    s3.create_bucket(Bucket=BUCKET)
    ckpt = tmp_path / "crc"
    random_file(ckpt / "a.bin", 2 * 1024 * 1024, seed=5)
    publish(ckpt, version="crc")
    put_file(s3, BUCKET, f"run-1/crc/{MANIFEST_NAME}", ckpt / MANIFEST_NAME)
    put_file(s3, BUCKET, "run-1/crc/a.bin", ckpt / "a.bin")
    src, _ = make_source(moto_server, tmp_path)
    [item] = src.scan()
    real_head = src.client.head_object

    def lying_head(**kw: Any) -> Any:  # the store's reported checksum, not the bytes, is what differs
        out = real_head(**kw)
        if kw["Key"].endswith("a.bin"):
            out["ChecksumCRC32C"] = "AAAAAA=="
        return out

    src.client.head_object = lying_head
    with pytest.raises(FetchError, match=r"a\.bin: crc32c .* FULL_OBJECT checksum 00000000"):
        fetch(src, item)


def test_interrupted_download_resumes_without_refetching_finished_files(moto_server, tmp_path):
    s3 = moto_server.client()
    s3.create_bucket(Bucket=BUCKET)
    ckpt = tmp_path / "resume"
    random_file(ckpt / "a-first.bin", 3 * 1024 * 1024, seed=6)
    random_file(ckpt / "b-big.bin", 8 * 1024 * 1024, seed=7)
    publish(ckpt, version="resume")

    def upload() -> None:
        s3.create_bucket(Bucket=BUCKET)
        upload_dir(s3, BUCKET, "run-1/resume/", ckpt)

    upload()
    src, _ = make_source(moto_server, tmp_path, part_bytes=1024 * 1024, concurrency=1)
    [item] = src.scan()
    first = 3 * 1024 * 1024
    killed: list[int] = []

    def kill_midway(done: int, total: int | None) -> None:
        if not killed and done >= first + 2 * 1024 * 1024:  # a-first done, 2 MiB of b-big written
            killed.append(done)
            moto_server.stop()

    with pytest.raises(FetchError) as err:
        fetch(src, item, kill_midway)
    assert err.value.retry_after_s is not None, err.value.reason  # passing: the daemon tries again
    a_inode = os.stat(tmp_path / "cache" / ".partial-resume" / "a-first.bin").st_ino
    moto_server.start()  # the store is back (moto forgets: the same objects are put again)
    s3 = moto_server.client()
    upload()
    directory = fetch(src, item)
    stats = src.last_fetch["resume"]
    assert stats.reused_bytes >= first + 2 * 1024 * 1024, stats  # a-first and b-big's first ranges kept
    assert stats.downloaded_bytes <= stats.total_bytes - stats.reused_bytes, stats
    assert stats.downloaded_bytes + stats.reused_bytes == stats.total_bytes
    assert os.stat(directory / "a-first.bin").st_ino == a_inode
    for name in ("a-first.bin", "b-big.bin"):
        assert (directory / name).read_bytes() == (ckpt / name).read_bytes()
    assert not list(directory.rglob("*.hsparts")) and not (directory / ".hotswap-done").exists()


def test_unparseable_manifest_is_handed_on_and_rejected_with_the_reason(moto_server, tmp_path):
    s3 = moto_server.client()
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key=f"run-1/junk/{MANIFEST_NAME}", Body=b"{not json")
    src, _ = make_source(moto_server, tmp_path)
    [item] = src.scan()
    with pytest.raises(FetchError, match="not valid UTF-8 JSON"):
        fetch(src, item)


def test_prune_keeps_protected_versions(moto_server, tmp_path):
    src, _ = make_source(moto_server, tmp_path, cache_max_bytes=3 * 1024 * 1024)
    cache = tmp_path / "cache"
    for i, name in enumerate(["serving", "last-good", "old-1", "old-2", ".partial-new"]):
        random_file(cache / name / "w.bin", 2 * 1024 * 1024, seed=i)
        os.utime(cache / name, (1000 + i, 1000 + i))
    removed = src.prune(frozenset({cache / "serving", cache / "last-good"}))
    assert sorted(p.name for p in removed) == ["old-1", "old-2"]
    assert sorted(p.name for p in cache.iterdir()) == [".partial-new", "last-good", "serving"]
    assert src.prune(frozenset({cache / "serving", cache / "last-good"})) == []  # over the limit: all protected


def test_sqs_event_is_a_hint_that_lists_at_once(moto_server, tmp_path):
    """With an hour between listings, only the S3 event (read from SQS) can make this checkpoint appear."""
    s3, sqs = moto_server.client(), moto_server.client("sqs")
    s3.create_bucket(Bucket=BUCKET)
    queue = sqs.create_queue(QueueName="ckpt-events")["QueueUrl"]
    scheduler = BackgroundScheduler(daemon=True)
    scheduler.start()
    rec = Recorder()
    cfg = S3SourceConfig(bucket=BUCKET, prefix="run-1", endpoint_url=moto_server.url, poll_interval_s=3600,
                         sqs_queue_url=queue, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    src = S3Source(cfg, rec, scheduler)
    src.start()
    try:
        wait_until(lambda: scheduler.get_job(src._job_id).next_run_time.timestamp() > time.time() + 60,
                   10, what="the first listing to have run")  # fmt: skip
        ckpt = tmp_path / "hinted"
        publish_tiny(ckpt, seed=5)
        upload_dir(s3, BUCKET, "run-1/hinted/", ckpt)
        assert rec.items == []
        sqs.send_message(QueueUrl=queue, MessageBody='{"Records": [{"eventName": "ObjectCreated:Put"}]}')
        wait_until(lambda: [i.version for i in rec.items] == ["hinted"], 30, what="the hinted checkpoint")
        assert "Messages" not in sqs.receive_message(QueueUrl=queue, WaitTimeSeconds=0)  # consumed
    finally:
        src.stop()
        scheduler.shutdown(wait=False)


def test_a_folder_reused_for_another_version_is_refused_and_the_first_copy_stays(moto_server, tmp_path):
    s3 = moto_server.client()
    s3.create_bucket(Bucket=BUCKET)
    first = tmp_path / "a" / "slot"
    publish_tiny(first, seed=1)
    upload_dir(s3, BUCKET, "run-1/slot/", first)
    src, _ = make_source(moto_server, tmp_path)
    [item1] = src.scan()
    dir1 = fetch(src, item1)
    before = {p.name: p.read_bytes() for p in dir1.iterdir()}
    second = tmp_path / "b" / "slot"
    publish_tiny(second, seed=2, version="v2")
    upload_dir(s3, BUCKET, "run-1/slot/", second)  # the same folder, another version
    src2, rec2 = make_source(moto_server, tmp_path)  # e.g. after a daemon restart
    assert src2.scan() == [] and rec2.items == []  # v2 comes only from a folder named v2
    assert "holds a manifest for version 'v2'" in src2.describe()["refused"]["slot"]
    assert {p.name: p.read_bytes() for p in dir1.iterdir()} == before


def test_a_delta_s_compacted_files_and_its_own_share_the_cache_folder_in_turn(moto_server, tmp_path):
    """A late host fetches a delta's compacted files (from the anchor); the same folder asked for the
    delta's own files later gets those, and the other way round: never a copy without the files wanted."""
    from dataclasses import replace

    from support_delta import step

    from daemon.client import publish_delta, publish_s3
    from daemon.delta.anchors import AnchorRule
    from daemon.delta.section import COMPACT_DIR, DELTA_DIR

    s3 = moto_server.client()
    s3.create_bucket(Bucket=BUCKET)
    tr = tmp_path / "tr"
    publish_tiny(tr / "v1", seed=1)
    for v, base in (("v2", "v1"), ("v3", "v2")):
        step(tr / base, tr / v, 1e-3, 7)
        publish_delta(tr / v, tr / base, tmp_path / "out" / v, rule=AnchorRule(share=100.0))
    publish_s3(tmp_path / "out" / "v3", f"s3://{BUCKET}/run-1/v3", client=s3)
    src, rec = make_source(moto_server, tmp_path)
    (item,) = src.scan()
    plain = FetchItem(1, item.version, item.uri)

    def held(d: Path) -> list[str]:
        return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())

    hsd = "model.safetensors.hsd"
    d = src.fetch(replace(plain, compacted=True), lambda done, total: None)
    assert held(d) == [f"{COMPACT_DIR}/{hsd}", MANIFEST_NAME]
    assert src.last_fetch["v3"].downloaded_bytes == (tmp_path / "out" / "v3" / COMPACT_DIR / hsd).stat().st_size
    d = src.fetch(plain, lambda done, total: None)
    assert held(d) == [f"{DELTA_DIR}/{hsd}", MANIFEST_NAME]
    assert src.fetch(plain, lambda done, total: None) == d and src.last_fetch["v3"].downloaded_bytes == 0  # reused
    s3.delete_object(Bucket=BUCKET, Key=f"run-1/v3/{COMPACT_DIR}/{hsd}")
    with pytest.raises(FetchError, match="not in the store"):  # named; the delta's own copy stays
        src.fetch(replace(plain, compacted=True), lambda done, total: None)
    assert held(d) == [f"{DELTA_DIR}/{hsd}", MANIFEST_NAME]


def test_one_listing_emits_checkpoints_in_the_order_their_manifests_were_written(moto_server, tmp_path):
    """A listing comes back in key order ("s10" before "s2"), and a version without a step is
    ordered by arrival: one listing that finds several committed checkpoints emits them oldest
    manifest first, so the newest written is the newest registered."""
    s3 = moto_server.client()
    s3.create_bucket(Bucket=BUCKET)
    committed = [f"s{i}" for i in range(1, 13)]
    random.Random(11).shuffle(committed)
    last = None
    for name in committed:
        publish_tiny(tmp_path / name, seed=len(name), version=name)
        upload_dir(s3, BUCKET, f"run-1/{name}/", tmp_path / name)
        key = f"run-1/{name}/{MANIFEST_NAME}"
        while last is not None and s3.head_object(Bucket=BUCKET, Key=key)["LastModified"] <= last:
            put_file(s3, BUCKET, key, tmp_path / name / MANIFEST_NAME)  # a later clock tick than the one before
        last = s3.head_object(Bucket=BUCKET, Key=key)["LastModified"]
    src, rec = make_source(moto_server, tmp_path)
    assert [i.version for i in src.scan()] == committed
