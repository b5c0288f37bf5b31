"""Failures that used to be silent, with real processes: each is a problem in /health, `hotswap
status` and /metrics with its reason within one poll, and clears when fixed (issue 21 item 4).

- an S3 source that cannot list (no credentials; the store down, then back)
- the serving version's files changed after it was deployed
- the time of the last failure survives a restart (it counted rollouts only)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import DaemonProcess, hotswap_cli, wait_until
from support_check import flip_byte
from support_managed import FEW_CHECKS, close_managed, managed_daemon
from support_rollout import aliases, build_checkpoint, publish_into
from support_s3 import MotoServer

NO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SESSION_TOKEN": "",
                  "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
                  "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip



def problems(d: DaemonProcess) -> tuple[int, list[dict[str, Any]]]:
    r = d.get("/health")
    return r.status_code, r.json().get("problems", [])


def problem(d: DaemonProcess, kind: str) -> dict[str, Any] | None:
    return next((p for p in problems(d)[1] if p["kind"] == kind), None)


def metric_lines(d: DaemonProcess, name: str) -> list[str]:
    text = d.get("/metrics").text
    return [line for line in text.splitlines() if line.startswith(name)]


def status_text(d: DaemonProcess) -> str:
    out = hotswap_cli("status", "-c", str(d.config_path), env={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture
def moto() -> Iterator[MotoServer]:
    server = MotoServer().start()
    try:
        yield server
    finally:
        server.stop()


def _s3_source(server: MotoServer, tmp_path: Path) -> dict[str, Any]:
    return {"type": "s3", "bucket": "ckpts", "prefix": "run/", "endpoint_url": server.url, "name": "bucket",
            "poll_interval_s": 0.5, "cache_dir": str(tmp_path / "s3cache")}  # fmt: skip


def test_an_s3_source_without_credentials_is_unhealthy_and_says_why(moto, daemon_factory, db_url, tmp_path) -> None:
    d = daemon_factory(db_url, sources=[_s3_source(moto, tmp_path)], env=NO_CREDENTIALS)
    found = wait_until(lambda: problem(d, "source_failing"), 30, 0.2, "a source_failing problem in /health")
    assert found["subject"] == "bucket" and "Unable to locate credentials" in found["reason"], found
    assert found["severity"] == "critical" and problems(d)[0] == 503
    assert "Unable to locate credentials" in d.get("/health").json()["error"]
    out = status_text(d)
    assert "health:      unhealthy" in out and "source_failing bucket" in out and "Unable to locate credentials" in out
    assert metric_lines(d, 'hotswap_problem{kind="source_failing",severity="critical",subject="bucket"} 1.0')
    errors = metric_lines(d, 'hotswap_source_errors_total{source="bucket"}')
    assert errors and float(errors[0].split()[-1]) >= 1, errors


def test_an_s3_listing_failure_clears_when_the_store_answers_again(moto, daemon_factory, db_url, tmp_path) -> None:
    moto.client().create_bucket(Bucket="ckpts")
    d = daemon_factory(db_url, sources=[_s3_source(moto, tmp_path)], env=moto.env())
    wait_until(lambda: problems(d)[0] == 200, 30, 0.2, "a healthy daemon")
    moto.stop()
    found = wait_until(lambda: problem(d, "source_failing"), 60, 0.2, "the store being down in /health")
    assert "listing s3://ckpts/run/ failed" in found["reason"], found
    moto.start()
    moto.client().create_bucket(Bucket="ckpts")  # moto keeps nothing across a restart
    wait_until(lambda: problem(d, "source_failing") is None and problems(d)[0] == 200, 60, 0.2,
               "the problem to clear once a listing works")  # fmt: skip
    assert not metric_lines(d, 'hotswap_problem{kind="source_failing"')
    from sqlalchemy import text

    with d.registry.engine.connect() as c:
        kinds = [r[0] for r in c.execute(text("SELECT to_state FROM events WHERE to_state LIKE 'problem_%' ORDER BY id"))]
    assert kinds == ["problem_started", "problem_ended"]


@pytest.fixture
def managed(tmp_path: Path) -> Iterator[Any]:
    started: list[DaemonProcess] = []
    yield lambda: managed_daemon(tmp_path, started, {"mode": "pause"}, [{"path": str(tmp_path / "checkpoints"),
                                                                       "rescan_interval_s": 0.5}])  # fmt: skip
    for d in started:
        close_managed(d)


def test_the_serving_versions_files_changing_is_a_problem_until_another_version_serves(managed) -> None:
    d = managed()
    v1 = publish_into(d.watch_dir, "v1", seed=1)
    wait_until(lambda: aliases(d.registry).get("serving") == "v1", 90, 0.2, "v1 serving")
    assert problem(d, "serving_files_changed") is None
    shard = next(v1.glob("*.safetensors"))
    with shard.open("ab") as f:
        f.write(b"\0" * 8)  # after verify and deploy: the worker serves what was verified, the disk differs
    found = wait_until(lambda: problem(d, "serving_files_changed"), 30, 0.2, "the change in /health")
    assert found["subject"] == "v1" and shard.name in found["reason"] and found["severity"] == "warning", found
    assert problems(d)[0] == 200  # the workers still serve the verified bytes: a warning, not an outage
    assert f"serving_files_changed v1: {found['reason']}" in status_text(d)
    gauge = 'hotswap_problem{kind="serving_files_changed",severity="warning",subject="v1"} 1.0'
    assert metric_lines(d, gauge), metric_lines(d, "hotswap_problem{")
    publish_into(d.watch_dir, "v2", seed=2)
    wait_until(lambda: aliases(d.registry).get("serving") == "v2", 90, 0.2, "v2 serving")
    wait_until(lambda: problem(d, "serving_files_changed") is None, 30, 0.2, "the problem to clear")
    assert not metric_lines(d, 'hotswap_problem{kind="serving_files_changed"'), metric_lines(d, "hotswap_problem{")
    assert "serving_files_changed" not in status_text(d)


def test_the_last_failure_time_counts_rejections_and_survives_a_restart(daemon_factory, db_url) -> None:
    d = daemon_factory(db_url, checks=FEW_CHECKS)
    tmp = d.watch_dir / ".build-bad-1"
    build_checkpoint(tmp, "bad-1", seed=1)
    shard = next(tmp.glob("*.safetensors"))
    flip_byte(shard, shard.stat().st_size - 1)  # after publish: the manifest's hashes no longer match
    os.replace(tmp, d.watch_dir / "bad-1")
    d.wait_status("bad-1", "rejected", timeout=60)

    def last_failure() -> float:
        line = metric_lines(d, "hotswap_last_failure_timestamp_seconds")
        return float(line[0].split()[-1]) if line else 0.0

    wait_until(lambda: last_failure() > 0, 10, 0.2, "the rejection in the metric")
    before = last_failure()
    d.stop()
    d.start()
    assert last_failure() == before > 0
    httpx.get(d.api_url + "/livez", timeout=10).raise_for_status()
