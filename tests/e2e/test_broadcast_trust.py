"""Trust in a broadcast session with real processes (a daemon, two reference workers, a trainer
process in one gloo group): with [checks] signing keys a session must be signed, and the workers'
digest must be the signed one."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.e2e.test_broadcast import checkpoint_row, outputs, snapshot, trainer
from tests.support_rollout import (
    WorkerPool,
    aliases,
    build_checkpoint,
    publish_into,
    wait_until,
    worker_events,
)

pytestmark = pytest.mark.timeout(600)
KEY_ID = "trainer-1"


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path_factory.mktemp("pool"))
    yield p
    p.close()


def start_signed_fleet(daemon_factory: Callable[..., Any], tmp_path: Path, pool: WorkerPool,
                       checks: dict[str, Any] | None = None, rollout: dict[str, Any] | None = None) -> Any:  # fmt: skip
    """As support_rollout.start_fleet, with an HMAC key in [checks] and v0 signed by it."""
    from daemon.checks.signatures import HmacSigner
    from daemon.manifest import publish

    key = tmp_path / "trainer.key"
    key.write_text("trainer-secret\n")
    d = daemon_factory(f"sqlite:///{tmp_path / 'registry.db'}",
                       checks={"hmac_keys": {KEY_ID: str(key)}, **(checks or {})},
                       extra={"rollout": {"mode": "pause", "health_window_s": 0.3, **(rollout or {})},
                              "workers": [w.spec() for w in pool.workers]}, wait=False)  # fmt: skip
    d.watch_dir.mkdir(parents=True)
    v0 = publish_into(d.watch_dir, "v0", seed=0)
    publish(v0, version="v0", signer=HmacSigner(KEY_ID, b"trainer-secret"))
    pool.reset(v0, "v0")
    d.start(timeout=90)
    d.wait_status("v0", "deployed", timeout=180)
    wait_until(lambda: aliases(d.registry).get("last_good") == "v0", 60, what="v0's health window")
    # at rest before a test snapshots the workers: no job running or waiting (a reconcile after v0's
    # window updated a worker once more between a snapshot and its check)
    wait_until(lambda: (doc := d.get("/v1/rollout").json())["current"] is None and doc["pending"] is None
               and all(w["state"] == "RUNNING" for w in doc["workers"]), 120, what="the fleet at rest")  # fmt: skip
    d.key = key
    return d


@pytest.fixture
def fleet(tmp_path: Path, pool: WorkerPool, daemon_factory: Callable[..., Any]) -> Any:
    return start_signed_fleet(daemon_factory, tmp_path, pool)


def one_push(d: Any, weights: Path, version: str, out: Path, *extra: str) -> dict[str, Any]:
    run = trainer(d, weights, version, out, *extra)
    assert run.returncode == 0, run.stdout + run.stderr
    (doc,) = json.loads(out.read_text())
    return dict(doc)


def test_the_trainer_computes_the_digest_the_workers_compute_of_the_stream() -> None:
    from daemon.transport.broadcast import buckets, parse_table, stream_digest, stream_hasher
    from daemon.transport.broadcast_worker import tensors_digest

    named = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).bfloat16()}
    table = parse_table([{"name": n, "dtype": {"float32": "F32", "int64": "I64", "bfloat16": "BF16"}[str(t.dtype)[6:]],
                          "shape": list(t.shape)} for n, t in named.items()])  # fmt: skip
    flat = {n: t.contiguous().view(-1).view(torch.uint8) for n, t in named.items()}
    hasher = stream_hasher(table)  # as BroadcastReceiver.write_into: bucket by bucket
    for used, pieces in buckets(table, 11):
        view = torch.empty(used, dtype=torch.uint8)
        for p in pieces:
            view[p.offset : p.offset + p.size].copy_(flat[p.name][p.start : p.start + p.size])
        hasher.update(memoryview(view.numpy()))
    assert tensors_digest(table, named) == stream_digest(hasher)


def test_an_unsigned_or_wrongly_signed_session_is_refused_before_any_worker_is_paused(
    tmp_path: Path, pool: WorkerPool, fleet: Any
) -> None:
    d = fleet
    before, served, events = snapshot(pool), outputs(pool), len(worker_events(d.registry))
    weights = build_checkpoint(tmp_path / "w5", "w5", seed=5)
    unsigned = one_push(d, weights, "bc-unsigned", tmp_path / "unsigned.json")
    assert not unsigned["ok"]
    assert "HTTP 403" in unsigned["error"] and "must be signed" in unsigned["error"], unsigned
    wrong_key = tmp_path / "wrong.key"
    wrong_key.write_text("not-the-secret\n")
    wrong = one_push(d, weights, "bc-wrong", tmp_path / "wrong.json", "--key-file", str(wrong_key), "--key-id", KEY_ID)
    assert not wrong["ok"]
    assert "HTTP 403" in wrong["error"] and "bad hmac-sha256 signature" in wrong["error"], wrong
    unknown = one_push(d, weights, "bc-unknown", tmp_path / "unknown.json", "--key-file", str(d.key), "--key-id", "x")
    assert "HTTP 403" in unknown["error"] and "not configured" in unknown["error"], unknown
    # nothing was recorded, no worker moved: same version, digest, update count, storage and outputs
    assert [d.row(v) for v in ("bc-unsigned", "bc-wrong", "bc-unknown")] == [None, None, None]
    assert len(worker_events(d.registry)) == events, worker_events(d.registry)[events:]
    assert snapshot(pool) == before
    assert outputs(pool) == served


def test_a_signed_session_deploys_and_bytes_other_than_the_signed_ones_are_undone(
    tmp_path: Path, pool: WorkerPool, fleet: Any
) -> None:
    d = fleet
    weights = build_checkpoint(tmp_path / "w6", "w6", seed=6)
    served = outputs(pool)
    sign = ("--key-file", str(d.key), "--key-id", KEY_ID)
    tampered = one_push(d, weights, "bc-tampered", tmp_path / "tampered.json", *sign, "--tamper")
    assert not tampered["ok"], tampered
    result = tampered["result"]
    assert "differs from the signed digest" in result["reason"], result
    assert [w["restored_to"] for w in result["workers"]] == ["v0", "v0"]
    assert [w.info()["version"] for w in pool.workers] == ["v0", "v0"]
    assert outputs(pool) == served
    row = checkpoint_row(d, "bc-tampered")
    assert row["status"] == "rejected" and "signed digest" in row["status_message"], row

    good = one_push(d, weights, "bc-signed", tmp_path / "signed.json", *sign)
    assert good["ok"], good
    assert [w.info()["version"] for w in pool.workers] == ["bc-signed", "bc-signed"]
    assert checkpoint_row(d, "bc-signed")["status"] == "deployed"
    assert aliases(d.registry)["serving"] == "bc-signed"


def test_a_signed_session_the_forward_canary_rejects_is_undone_before_any_worker_serves_it(
    tmp_path: Path, pool: WorkerPool, daemon_factory: Callable[..., Any]
) -> None:
    # any other seed is far from v0 by KL: the forward check rejects it; the workers' own probe
    # (finite logits, the right version) would pass it
    d = start_signed_fleet(daemon_factory, tmp_path, pool, checks={"forward_kl_max": 1e-6})
    served = outputs(pool)
    weights = build_checkpoint(tmp_path / "w7", "w7", seed=7)
    doc = one_push(d, weights, "bc-far", tmp_path / "far.json", "--key-file", str(d.key), "--key-id", KEY_ID)
    assert not doc["ok"], doc
    result = doc["result"]
    assert result["reason"].startswith("forward: KL(serving || new)"), result
    assert [c["name"] for c in result["checks"]] == ["compat", "forward"], result["checks"]
    assert [w["restored_to"] for w in result["workers"]] == ["v0", "v0"]
    # real completions: both workers answer with v0's weights and weight_version
    for w in pool.workers:
        assert w.info()["version"] == "v0"
        r = httpx.post(f"{w.url}/v1/completions", timeout=60,
                       json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True})  # fmt: skip
        assert r.status_code == 200 and r.json()["weight_version"] == "v0", r.text
    assert outputs(pool) == served
    # no worker was resumed on the new version: every move to RUNNING in that rollout is onto v0
    moves = [e for e in worker_events(d.registry, result["rollout_id"]) if e["to"] == "RUNNING"]
    assert moves and all(e["detail"].get("probe_version") in (None, "v0") for e in moves), moves
    row = checkpoint_row(d, "bc-far")
    assert row["status"] == "rejected" and "forward: KL" in row["status_message"], row


def test_a_session_pause_is_bounded_and_a_trainer_that_crawls_is_cut_off_within_it(
    tmp_path: Path, pool: WorkerPool, daemon_factory: Callable[..., Any]
) -> None:
    bound = 8.0
    d = start_signed_fleet(daemon_factory, tmp_path, pool, rollout={"broadcast_max_pause_s": bound})
    sign = ("--key-file", str(d.key), "--key-id", KEY_ID)
    before, served = snapshot(pool), outputs(pool)
    weights = build_checkpoint(tmp_path / "w8", "w8", seed=8)
    # a timeout above the bound is refused before any worker is paused
    long = one_push(d, weights, "bc-long", tmp_path / "long.json", *sign, "--timeout-s", "3600")
    assert "HTTP 422" in long["error"] and "broadcast_max_pause_s" in long["error"], long
    assert d.row("bc-long") is None and snapshot(pool) == before
    # 3 buckets, then one every 3 s: each send is well inside the group's timeout, the whole is not
    crawl = one_push(d, weights, "bc-crawl", tmp_path / "crawl.json", *sign, "--timeout-s", str(bound),
                     "--bucket-bytes", "8192", "--hang-after-buckets", "3", "--drip-s", "3")  # fmt: skip
    assert not crawl["ok"], crawl
    result = crawl["result"]
    print("crawling trainer's session:", result)
    # cut off by the bound (on a loaded machine the trainer may still be joining the group when it
    # strikes: then the group's own timeout, which is the same bound, names it)
    assert "broadcast_max_pause_s" in result["reason"] or "timed out" in result["reason"].lower(), result
    assert [w["restored_to"] for w in result["workers"]] == ["v0", "v0"], result
    assert [w.info()["state"] for w in pool.workers] == ["RUNNING", "RUNNING"]
    assert [s[:2] for s in snapshot(pool)] == [s[:2] for s in before]
    assert outputs(pool) == served
    assert checkpoint_row(d, "bc-crawl")["status"] == "rejected"
