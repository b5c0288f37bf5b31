"""The reference worker as a real process: serving, pause/drain/resume, in-place updates, refusals, auth.

Two processes serve the module: `w` (checkpoint A, a tokenizer, 5 ms between scheduler steps so
requests stay in flight long enough to watch) and `fresh_b` (a new process started on checkpoint B,
the reference for "outputs after an update equal a fresh start"). Every test leaves `w` RUNNING on A.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_until
from support_check import expect_of
from support_worker import (
    WorkerProcess,
    start_worker,
    stream_in_thread,
    write_byte_tokenizer,
    write_token,
)

from daemon.formats.checkpoint import weight_files
from daemon.manifest import publish
from daemon.tinymodel import make_tiny_checkpoint

PROMPT = [1, 17, 42, 99, 5]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("worker")
    a = make_tiny_checkpoint(r / "ckpt-a", seed=11)
    b = make_tiny_checkpoint(r / "ckpt-b", seed=22, shards=2)
    for d in (a, b):
        write_byte_tokenizer(d)
    publish(b, version="step-200")
    make_tiny_checkpoint(r / "ckpt-wide", seed=33, config_overrides={"intermediate_size": 96})
    write_token(r)
    return r


@pytest.fixture(scope="module")
def w(root: Path) -> Iterator[WorkerProcess]:
    proc = start_worker(root / "ckpt-a", root / "token", extra=["--step-delay-ms", "5", "--version", "A"])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def fresh_b(root: Path) -> Iterator[WorkerProcess]:
    proc = start_worker(root / "ckpt-b", root / "token")
    yield proc
    proc.stop()


@pytest.fixture(autouse=True)
def back_to_a(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "w" not in request.fixturenames:
        return
    wp: WorkerProcess = request.getfixturevalue("w")
    info = wp.info()
    if info["state"] != "RUNNING":
        wp.admin("/admin/resume")
    if wp.info()["version"] != "A":
        wp.admin("/admin/pause", {"mode": "wait"})
        wp.admin("/admin/update", {"version": "A", "transport": "disk", "path": info["model_dir"]})
        wp.admin("/admin/resume")


def test_serves_with_weight_version_and_text_prompts(w: WorkerProcess) -> None:
    doc = w.complete({"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert doc["weight_version"] == "A"
    assert len(doc["choices"][0]["token_ids"]) == 6
    assert doc["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    text = w.complete({"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert text["weight_version"] == "A" and isinstance(text["choices"][0]["text"], str)
    # streaming gives the same greedy tokens, every chunk tagged with the version
    t, chunks, outcome = stream_in_thread(w, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    t.join(30)
    assert outcome.get("status") == 200 and outcome.get("done"), outcome
    tokens = [tok for c in chunks for tok in c["choices"][0]["token_ids"]]
    assert tokens == doc["choices"][0]["token_ids"]
    assert {c["weight_version"] for c in chunks} == {"A"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # seeded sampling is reproducible
    s1 = w.complete({"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True})
    s2 = w.complete({"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True})
    assert s1["choices"][0]["token_ids"] == s2["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": [1, 999]}, "outside the vocabulary"),
        ({"prompt": []}, "empty"),
        ({"max_tokens": 3}, "'prompt' is required"),
        ({"prompt": [1], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1], "n": 2}, "'n' must be 1"),
        ({"prompt": [1], "stop": ["x"]}, "'stop' is not supported"),
    ],
)
def test_bad_completion_requests_get_400_naming_the_field(w: WorkerProcess, body: dict, needle: str) -> None:
    r = w.post("/v1/completions", body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_update_from_disk_matches_a_fresh_process(w: WorkerProcess, fresh_b: WorkerProcess, root: Path) -> None:
    before = w.greedy(PROMPT)
    info0 = w.info()
    assert info0["state"] == "RUNNING" and info0["tensors"] == 21
    w.admin("/admin/pause", {"mode": "keep"})
    assert w.get("/ready").status_code == 503
    manifest_digest = fresh_b.info()["digest"]
    res = w.admin("/admin/update", {"version": "step-200", "transport": "disk", "path": str(root / "ckpt-b"),
                                    "mode": "copy", "expect": {"digest": manifest_digest, "tensors": 21,
                                                               "files": expect_of(root / "ckpt-b").to_json()["files"]}})
    assert res["version"] == "step-200" and res["previous_version"] == "A" and res["digest_checked"] is True
    info = w.info()
    assert info["state"] == "UPDATED" and info["version"] == "step-200" and info["digest"] == manifest_digest
    assert info["update_count"] == info0["update_count"] + 1
    assert info["storage_id"] == info0["storage_id"], "a parameter was reallocated"
    probe = w.admin("/admin/probe", {"max_tokens": 3})
    assert probe["weight_version"] == "step-200" and probe["finite"]
    w.admin("/admin/resume")
    assert w.get("/ready").status_code == 200
    after = w.greedy(PROMPT)
    assert after == fresh_b.greedy(PROMPT)
    assert after != before
    # rollback returns to the retained previous version (re-read from its path)
    rb = w.admin("/admin/rollback")
    assert rb["version"] == "A" and rb["rolled_back_from"] == "step-200"
    assert w.greedy(PROMPT) == before
    assert w.info()["storage_id"] == info0["storage_id"]


def test_wrong_digest_or_tensor_count_is_refused(w: WorkerProcess, root: Path) -> None:
    w.admin("/admin/pause", {"mode": "keep"})
    for expect, needle in (({"digest": "00000000"}, "digest"), ({"tensors": 20}, "expected 20 tensors")):
        r = w.post("/admin/update", {"version": "x", "path": str(root / "ckpt-b"), "expect": expect}, admin=True)
        assert r.status_code == 409 and needle in r.json()["error"], r.text
    assert w.info()["version"] == "A"


def test_pause_keeps_in_flight_requests_and_queues_new_ones(w: WorkerProcess) -> None:
    t, chunks, outcome = stream_in_thread(w, {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True})
    wait_until(lambda: len(chunks) >= 3, what="first tokens")
    res = w.admin("/admin/pause", {"mode": "keep"})
    assert res["state"] == "PAUSED" and res["kept"] == 1
    before = w.info()
    t2, chunks2, outcome2 = stream_in_thread(w, {"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0})
    wait_until(lambda: w.info()["in_flight"] == 2, what="second request queued")
    # positive signal: the scheduler woke for the new request and stayed parked (its own counter)
    after = wait_until(lambda: (i := w.info())["wakeups_paused"] > before["wakeups_paused"] and i,
                       what="the paused scheduler to see the new request")  # fmt: skip
    assert after["steps"] == before["steps"], "the scheduler ran a step while paused"
    assert chunks2 == [] and "status" in outcome2 and outcome2["status"] == 200  # queued, not refused
    w.admin("/admin/resume")
    t.join(30)
    t2.join(30)
    assert outcome.get("done") and outcome2.get("done"), (outcome, outcome2)
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 60
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_update_during_pause_reprefills_kept_sequences(
    w: WorkerProcess, fresh_b: WorkerProcess, root: Path
) -> None:
    t, chunks, outcome = stream_in_thread(w, {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
    wait_until(lambda: len(chunks) >= 5, what="first tokens")
    w.admin("/admin/pause", {"mode": "keep"})
    w.admin("/admin/update", {"version": "B", "path": str(root / "ckpt-b")})
    w.admin("/admin/resume")
    t.join(30)
    assert outcome.get("done"), outcome
    tokens = [c["choices"][0]["token_ids"][0] for c in chunks[:-1]]
    versions = [c["weight_version"] for c in chunks[:-1]]
    k = versions.index("B")
    assert set(versions[:k]) == {"A"} and set(versions[k:]) == {"B"}
    assert chunks[-1]["weight_versions"] == ["A", "B"]
    # the continuation is what B computes from scratch on the same context: no stale KV cache
    continuation = fresh_b.greedy(PROMPT + tokens[:k], max_tokens=len(tokens) - k)
    assert tokens[k:] == continuation


def test_drain_waits_for_in_flight_and_refuses_new_requests(w: WorkerProcess) -> None:
    t, chunks, outcome = stream_in_thread(w, {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
    wait_until(lambda: len(chunks) >= 2, what="first tokens")
    failed0 = w.info()["requests_failed"]
    res = w.admin("/admin/drain", {"timeout_s": 30})
    assert res == {"state": "DRAINING", "drained": True, "in_flight": 0}
    t.join(30)  # the worker has sent the last chunk; the client thread may not have read it yet
    assert outcome.get("done") and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert w.get("/ready").status_code == 503
    r = w.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
    assert w.info()["requests_failed"] == failed0 + 1
    # an update from DRAINING leaves it UPDATED and still refusing until resume
    w.admin("/admin/update", {"version": "A", "path": w.info()["model_dir"]})
    assert w.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 503
    w.admin("/admin/resume")
    assert w.get("/ready").status_code == 200
    assert w.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_drain_timeout_reports_requests_still_in_flight(w: WorkerProcess) -> None:
    t, chunks, outcome = stream_in_thread(w, {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True})
    wait_until(lambda: len(chunks) >= 2, what="first tokens")
    res = w.admin("/admin/drain", {"timeout_s": 0.05})
    assert res["drained"] is False and res["in_flight"] == 1
    w.admin("/admin/resume")
    t.join(30)
    assert outcome.get("done")


def test_wrong_shape_is_refused_before_any_parameter_changes(w: WorkerProcess, root: Path) -> None:
    before, info0 = w.greedy(PROMPT), w.info()
    w.admin("/admin/pause", {"mode": "keep"})
    r = w.post("/admin/update", {"version": "wide", "path": str(root / "ckpt-wide")}, admin=True)
    assert r.status_code == 409, r.text
    assert "mlp" in r.json()["error"] and "shape" in r.json()["error"]
    info = w.info()
    assert (info["version"], info["update_count"], info["state"]) == ("A", info0["update_count"], "PAUSED")
    w.admin("/admin/resume")
    assert w.greedy(PROMPT) == before


def test_truncated_shard_is_refused_and_old_version_keeps_serving(w: WorkerProcess, root: Path, tmp_path: Path) -> None:
    import shutil

    bad = Path(shutil.copytree(root / "ckpt-b", tmp_path / "ckpt-b-cut"))
    shard = weight_files(bad)[1]
    os.truncate(shard, shard.stat().st_size - 1000)
    before = w.greedy(PROMPT)
    w.admin("/admin/pause", {"mode": "keep"})
    r = w.post("/admin/update", {"version": "cut", "path": str(bad)}, admin=True)
    assert r.status_code == 422 and shard.name in r.json()["error"], r.text
    w.admin("/admin/resume")
    assert w.info()["version"] == "A"
    assert w.greedy(PROMPT) == before


def test_update_from_running_needs_an_idle_worker(w: WorkerProcess, root: Path) -> None:
    t, chunks, outcome = stream_in_thread(w, {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True})
    wait_until(lambda: len(chunks) >= 2, what="first tokens")
    r = w.post("/admin/update", {"version": "B", "path": str(root / "ckpt-b")}, admin=True)
    assert r.status_code == 409 and "pause or drain" in r.json()["error"]
    t.join(30)
    assert outcome.get("done") and {c["weight_version"] for c in chunks} == {"A"}
    res = w.admin("/admin/update", {"version": "B", "path": str(root / "ckpt-b")})  # idle now
    assert res["state"] == "RUNNING" and w.get("/ready").status_code == 200


@pytest.mark.parametrize("header", [None, "Bearer wrong-token", "Bearer worker-test-token-7f3", "Basic d29ya2Vy"])
def test_admin_calls_without_the_right_token_get_401_and_change_nothing(
    w: WorkerProcess, root: Path, header: str | None
) -> None:
    info0 = w.info()
    headers = {} if header is None else {"Authorization": header}
    for path, body in (("/admin/pause", {"mode": "keep"}), ("/admin/drain", {"timeout_s": 1}),
                       ("/admin/update", {"version": "B", "path": str(root / "ckpt-b")}),
                       ("/admin/rollback", {}), ("/admin/resume", {}), ("/admin/probe", {})):
        r = w.post(path, body, headers=headers)
        assert r.status_code == 401, (path, r.status_code, r.text)
        assert r.headers.get("www-authenticate") == "Bearer"
    assert w.get("/weight_info", headers=headers).status_code == 401
    info = w.info()
    for key in ("version", "state", "update_count", "storage_id", "previous_version"):
        assert info[key] == info0[key], key
    assert w.get("/health").status_code == 200 and w.get("/ready").status_code == 200
