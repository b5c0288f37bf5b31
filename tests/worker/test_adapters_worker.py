"""The reference worker serves LoRA adapters by request `model` name (daemon/worker/lora.py), as a
real `hotswap worker` process on a tiny base: greedy tokens equal the base with the adapter merged
(computed independently in float64 by support_adapters), a request in flight finishes on the
version it started with while a new version replaces the name, base requests keep running and
nothing is paused during a load, and bad adapters are refused with the reason, changing nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import wait_until
from support_adapters import make_adapter, make_base, merged_greedy, publish_adapter
from support_engines import corrupt_bytes
from support_worker import WorkerProcess, start_worker, stream_in_thread, write_token

from daemon.manifest import load_manifest
from daemon.transport.base import Expect, ExpectedFile

PROMPT = [5, 17, 33, 2, 71, 9, 120, 44]
N = 12


def expect_of(directory: Path) -> dict[str, Any]:
    """What the daemon sends: the verified per-file digests (here: the manifest's)."""
    m = load_manifest(directory)
    files = tuple(ExpectedFile(f.path, f.bytes, {"crc32c": f.crc32c, str(f.hash_alg): f.hash}) for f in m.files)
    return Expect(digest=m.digest, files=files).to_json()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WorkerProcess, Path, Path]]:
    root = tmp_path_factory.mktemp("lora-worker")
    base = make_base(root / "base", seed=0, lm_head_scale=8.0)
    # 40 ms per scheduler step: a 40-token request is in flight for seconds, long enough to load under it
    watch = root / "watch"
    for i in (1, 2):  # the two versions every test may load (each test is independent of the others)
        publish_adapter(watch, f"sql@{i}", "sql", lambda d, i=i: make_adapter(d, base, seed=i))  # type: ignore[misc]
    w = start_worker(base, write_token(root), extra=["--step-delay-ms", "40"])
    try:
        yield w, base, watch
    finally:
        w.stop()


def load(w: WorkerProcess, name: str, version: str, directory: Path, expect: dict[str, Any] | None = None) -> httpx.Response:
    body = {"name": name, "version": version, "path": str(directory), "expect": expect_of(directory) if expect is None else expect}
    return w.post("/admin/adapters/load", body, admin=True)


def greedy(w: WorkerProcess, model: str | None, n: int = N) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    if model:
        body["model"] = model
    r = w.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_an_adapter_serves_the_tokens_of_the_base_with_it_merged(env: tuple[WorkerProcess, Path, Path]) -> None:
    w, base, watch = env
    a1 = watch / "sql@1"
    want, margin = merged_greedy(base, a1, PROMPT, N)
    base_want, _ = merged_greedy(base, None, PROMPT, N)
    assert margin > 1e-3 and want != base_want  # the adapter changes the answer, unambiguously
    r = load(w, "sql", "sql@1", a1)
    assert r.status_code == 200, r.text
    assert r.json()["previous_version"] is None and r.json()["probe"]["finite"] is True
    doc = greedy(w, "sql")
    assert doc["choices"][0]["token_ids"] == want
    assert doc["model"] == "sql" and doc["adapter_version"] == "sql@1"
    base_doc = greedy(w, None)
    assert base_doc["choices"][0]["token_ids"] == base_want and "adapter_version" not in base_doc
    cards = {c["id"]: c for c in w.get("/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == base_doc["model"] and cards["sql"]["metadata"]["adapter_version"] == "sql@1"
    info = w.info()
    assert info["adapters"]["sql"]["version"] == "sql@1" and info["adapter_requests"]["sql"]["requests_total"] >= 1


def test_a_new_version_replaces_the_name_and_a_request_in_flight_finishes_on_its_own(
    env: tuple[WorkerProcess, Path, Path],
) -> None:
    w, base, watch = env
    a1, a2 = watch / "sql@1", watch / "sql@2"
    assert load(w, "sql", "sql@1", a1).status_code == 200
    long_v1, _ = merged_greedy(base, a1, PROMPT, 40)
    t, chunks, outcome = stream_in_thread(w, {"model": "sql", "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                              "ignore_eos": True})  # fmt: skip
    wait_until(lambda: len(chunks) >= 3, 60, what="the request in flight to stream its first tokens")
    r = load(w, "sql", "sql@2", a2)  # the name moves to v2 while the request is still generating
    at_switch = len(chunks)
    assert r.status_code == 200 and r.json()["previous_version"] == "sql@1"
    assert greedy(w, "sql")["adapter_version"] == "sql@2"
    t.join(120)
    assert outcome.get("done") and outcome.get("status") == 200, outcome
    assert at_switch < 40 < len(chunks)  # tokens were generated after the switch (40 tokens + the finish chunk)
    assert {c["adapter_version"] for c in chunks} == {"sql@1"}
    assert [tok for c in chunks for tok in c["choices"][0]["token_ids"]] == long_v1
    want_v2, _ = merged_greedy(base, a2, PROMPT, N)
    assert greedy(w, "sql")["choices"][0]["token_ids"] == want_v2


def test_base_requests_keep_running_and_nothing_pauses_during_loads(env: tuple[WorkerProcess, Path, Path]) -> None:
    w, base, watch = env
    a1, a2 = watch / "sql@1", watch / "sql@2"
    results: list[int] = []
    stop = threading.Event()

    def base_load() -> None:
        with httpx.Client(base_url=w.url, timeout=60) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
                results.append(r.status_code)

    t = threading.Thread(target=base_load, daemon=True)
    t.start()
    wait_until(lambda: len(results) >= 2, 60, what="base requests to flow")
    for i in range(4):
        assert load(w, "sql", f"sql@{1 + i % 2}", a1 if i % 2 == 0 else a2).status_code == 200
        assert w.get("/ready").status_code == 200
    n = len(results)
    wait_until(lambda: len(results) >= n + 2, 60, what="base requests after the loads")
    stop.set()
    t.join(60)
    assert results and set(results) == {200}, results
    events = [e["event"] for e in w.info()["events"]]
    assert events.count("adapter_loaded") >= 4 and "paused" not in events, events


@pytest.mark.parametrize("bad", ["corrupt", "wrong_shape", "nan", "unverified"])
def test_a_bad_adapter_is_refused_with_the_reason_and_the_name_keeps_its_version(
    env: tuple[WorkerProcess, Path, Path], bad: str
) -> None:
    w, base, watch = env
    assert load(w, "sql", "sql@1", watch / "sql@1").status_code == 200
    before = greedy(w, "sql")["choices"][0]["token_ids"]
    kw: dict[str, Any] = {"wrong_shape": True} if bad == "wrong_shape" else {"nan": True} if bad == "nan" else {}
    d = publish_adapter(watch, f"sql@{bad}", "sql", lambda x: make_adapter(x, base, seed=9, **kw))
    expect = None
    if bad == "corrupt":
        corrupt_bytes(d)  # after the manifest: not the verified bytes
    if bad == "unverified":
        expect = {}
    r = load(w, "sql", f"sql@{bad}", d, expect)
    assert r.status_code == 409, r.text
    reason = r.json()["error"]
    assert {"corrupt": "changed since verify", "wrong_shape": "lora_A shape [8, 63] != [8, 64]",
            "nan": "is not finite", "unverified": "only verified adapters are loaded"}[bad] in reason, reason  # fmt: skip
    assert greedy(w, "sql")["adapter_version"] == "sql@1"
    assert greedy(w, "sql")["choices"][0]["token_ids"] == before


def test_an_unloaded_adapter_is_not_found_and_the_base_still_serves(env: tuple[WorkerProcess, Path, Path]) -> None:
    w, base, watch = env
    assert load(w, "sql", "sql@1", watch / "sql@1").status_code == 200
    assert w.admin("/admin/adapters/unload", {"name": "sql"})["unloaded"] == "sql@1"
    r = w.post("/v1/completions", {"model": "sql", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and "sql" in r.text
    assert greedy(w, None)["choices"][0]["token_ids"] == merged_greedy(base, None, PROMPT, N)[0]
