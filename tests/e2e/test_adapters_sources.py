"""LoRA adapters through the S3 (moto server) and push sources of a real daemon: the manifest
carries the adapter's name and base, the registry records kind, name and base whatever the source,
and the adapter checks run against the base (here `checks.reference_dir`: a verify-only daemon has
no serving version). A bad one is refused the same way as from the local folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support_adapters import BASE_NAME, make_adapter, make_base
from support_s3 import upload_dir

from daemon.checks.signatures import HmacSigner
from daemon.client import push
from daemon.manifest import publish

CHECKS = {"enabled": ["manifest", "headers", "crc32c", "compat", "finite"]}
TOKEN = "adapter-push-token-7"



@pytest.fixture
def base(tmp_path: Path) -> Path:
    d = make_base(tmp_path / "base-v0", seed=0)
    publish(d, version="base-v0")
    return d


def test_an_adapter_from_s3_is_recorded_with_its_name_and_base_and_checked(moto_server, daemon_factory, db_url,
                                                                          tmp_path, base) -> None:  # fmt: skip
    s3 = moto_server.client()
    s3.create_bucket(Bucket="ckpts")
    sources = [{"type": "s3", "bucket": "ckpts", "prefix": "run/", "endpoint_url": moto_server.url, "name": "bucket",
                "poll_interval_s": 0.5, "cache_dir": str(tmp_path / "s3cache")}]  # fmt: skip
    d = daemon_factory(db_url, sources=sources, checks={**CHECKS, "reference_dir": str(base)}, env=moto_server.env())
    good = make_adapter(tmp_path / "up" / "sql-1", base, seed=1)
    publish(good, version="sql-1", extra={"adapter": "sql"})
    upload_dir(s3, "ckpts", "run/sql-1/", good)
    bad = make_adapter(tmp_path / "up" / "sql-2", base, seed=2, config_rank=4)
    publish(bad, version="sql-2", extra={"adapter": "sql"})
    upload_dir(s3, "ckpts", "run/sql-2/", bad)
    row = d.wait_status("sql-1", "verified", timeout=120)
    assert (row["kind"], row["adapter_name"], row["base_model"], row["source"]) == ("adapter", "sql", BASE_NAME, "bucket")
    refused = d.wait_status("sql-2", "rejected", timeout=120)
    assert refused["adapter_name"] == "sql" and "lora_A shape [8, 64] != [4, 64]" in refused["status_message"]


def test_a_pushed_adapter_is_recorded_with_its_name_and_base_and_checked(daemon_factory, db_url, tmp_path, base) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    key = tmp_path / "hmac.key"
    key.write_bytes(os.urandom(32).hex().encode())
    sources = [{"type": "push", "name": "push", "path": str(tmp_path / "pushed"), "token_file": str(tmp_path / "token"),
                "listen": "127.0.0.1:0", "hmac_keys": {"trainer": str(key)}}]  # fmt: skip
    d = daemon_factory(db_url, sources=sources,
                       checks={**CHECKS, "reference_dir": str(base), "hmac_keys": {"trainer": str(key)}})  # fmt: skip
    [src] = [s for s in d.get("/status").json()["sources"] if s["name"] == "push"]
    signer = HmacSigner("trainer", key.read_bytes())
    good = make_adapter(tmp_path / "out" / "sql-1", base, seed=1)
    publish(good, version="sql-1", signer=signer, extra={"adapter": "sql", "base_model": BASE_NAME})
    assert push(good, src["url"], TOKEN, None, retries=0, timeout_s=120)["status"] == "committed"
    row = d.wait_status("sql-1", "verified", timeout=120)
    assert (row["kind"], row["adapter_name"], row["base_model"], row["source"]) == ("adapter", "sql", BASE_NAME, "push")
    other = make_adapter(tmp_path / "out" / "sql-2", base, seed=2)
    publish(other, version="sql-2", signer=signer, extra={"adapter": "sql", "base_model": "someone/else"})
    push(other, src["url"], TOKEN, None, retries=0, timeout_s=120)
    refused = d.wait_status("sql-2", "rejected", timeout=120)
    assert "trained for base 'someone/else'" in refused["status_message"]
