"""`hotswap publish --to s3://...` (moto server subprocess) and `hotswap push` (the push source)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import hotswap_cli, publish_tiny
from support_s3 import random_file

from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.sources.base import FetchItem
from daemon.sources.push import PushSource, PushSourceConfig
from daemon.sources.s3 import S3Source, S3SourceConfig

pytestmark = pytest.mark.quick



def test_publish_to_s3_uploads_files_then_the_manifest_and_the_source_verifies_it(moto_server, tmp_path):
    s3 = moto_server.client()
    s3.create_bucket(Bucket="ckpts")
    ckpt = tmp_path / "any-name"
    publish_tiny(ckpt, seed=1)
    (ckpt / MANIFEST_NAME).unlink()  # `hotswap publish` writes it
    random_file(ckpt / "big.bin", 40 * 1024 * 1024 + 7, seed=2)  # over the 32 MiB part: multipart
    r = hotswap_cli("publish", str(ckpt), "--to", "s3://ckpts/run-2/step-9", "--endpoint-url", moto_server.url,
                    env=moto_server.env())  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "uploaded step-9" in r.stdout
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="ckpts")["Contents"]}
    assert f"run-2/step-9/{MANIFEST_NAME}" in keys and "run-2/step-9/big.bin" in keys
    head = s3.head_object(Bucket="ckpts", Key="run-2/step-9/big.bin", ChecksumMode="ENABLED")
    assert head["ETag"].strip('"').endswith("-2") and head.get("ChecksumType") == "FULL_OBJECT"
    src = S3Source(S3SourceConfig(bucket="ckpts", prefix="run-2/", endpoint_url=moto_server.url,
                                  cache_dir=str(tmp_path / "cache")), lambda item: None)  # fmt: skip
    [item] = src.scan()
    assert item.version == "step-9"
    out = src.fetch(FetchItem(1, item.version, item.uri), lambda d, t: None)
    assert (out / "big.bin").read_bytes() == (ckpt / "big.bin").read_bytes()
    assert src.last_fetch["step-9"].full_object_crcs == len(list(ckpt.iterdir())) - 1


def test_publish_to_a_bad_url_is_a_clear_error(tmp_path):
    r = hotswap_cli("publish", str(tmp_path), "--to", "s3://bucket-only")
    assert r.returncode == 2 and "a version folder is needed" in r.stderr


def test_push_cli_streams_a_checkpoint_and_reports_refusals(tmp_path):
    (tmp_path / "token").write_text("cli-token\n")
    key = tmp_path / "k"
    key.write_bytes(os.urandom(16).hex().encode())
    items: list[object] = []
    src = PushSource(PushSourceConfig(path=str(tmp_path / "reg"), token_file=str(tmp_path / "token"),
                                      listen="127.0.0.1:0", hmac_keys={"ci": str(key)}), items.append)  # fmt: skip
    src.start()
    try:
        assert src.server is not None
        ckpt = tmp_path / "step-3"
        publish_tiny(ckpt, seed=3)
        args = ["push", str(ckpt), "--to", src.server.url, "--token-file", str(tmp_path / "token"),
                "--key-file", str(key), "--key-id", "ci"]  # fmt: skip
        r = hotswap_cli(*args)
        assert r.returncode == 0, r.stderr
        assert "pushed step-3: committed" in r.stdout and len(items) == 1
        (tmp_path / "token").write_text("wrong\n")
        r = hotswap_cli(*args, "--retries", "0")
        assert r.returncode == 1 and "401" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    finally:
        src.stop()
    assert Path(src.root / "step-3" / MANIFEST_NAME).is_file()
