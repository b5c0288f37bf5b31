"""The SGLang client against the 0.5.23 stand-in, and the stand-in against SGLang's own source.

No SGLang runs here (it needs a GPU build); tests/sglang_standin.py reproduces the routes
hotswap drives. The first group proves the stand-in's routes, methods, auth levels, request
fields, defaults and messages are those parsed out of the real 0.5.23 wheel; the second drives
it through daemon.engines.sglang_api with a real tiny model, so every token is computed.
"""

from __future__ import annotations

import ast
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sglang_standin as standin
from support_engine_source import (
    HTTP_SERVER,
    class_bases,
    class_fields,
    function,
    sglang_routes,
    sglang_source,
)
from support_sglang import SGLangStandIn
from support_wait import wait_until

from daemon.engines.engine_http import EngineAPIError
from daemon.engines.sglang_api import SGLangAPI
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 6, 7, 8]
STEP_DELAY_S = 0.02  # per decode step: a 100-token request lasts ~2 s, long enough to pause it

# --------------------------------------------------------------------------- fidelity to 0.5.23

BODY_MODELS = [standin.PauseGenerationReqInput, standin.ContinueGenerationReqInput,
               standin.UpdateWeightFromDiskReqInput, standin.UpdateWeightVersionReqInput,
               standin.LoadLoRAAdapterReqInput, standin.UnloadLoRAAdapterReqInput]


def test_standin_routes_and_methods_are_sglangs() -> None:
    real = sglang_routes()
    for path, methods in standin.ROUTES.items():
        assert path in real, f"{path} is not a route of sglang 0.5.23"
        assert set(methods) == real[path].methods, (path, methods, real[path].methods)
    app = standin.build_app(None, None, None)  # type: ignore[arg-type]  # only listing its routes
    served = {(m, r.path) for r in app.routes if hasattr(r, "methods") and r.path in standin.ROUTES
              for m in r.methods}
    assert served == {(m, p) for p, ms in standin.ROUTES.items() for m in ms}


def test_standin_auth_levels_are_sglangs() -> None:
    real = sglang_routes()
    admin = {p for p in standin.ROUTES if "auth_level(AuthLevel.ADMIN_OPTIONAL)" in real[p].decorators}
    assert admin == set(standin.ADMIN_OPTIONAL_ROUTES)


@pytest.mark.parametrize("model", BODY_MODELS, ids=lambda m: m.__name__)
def test_standin_request_fields_and_defaults_are_sglangs(model: Any) -> None:
    src = sglang_source("srt/managers/io_struct.py")
    real = dict(class_fields(src, model.__name__))
    assert class_bases(src, model.__name__)[0] == "BaseReq"
    real = {**class_fields(src, "BaseReq"), **real}
    ours = {name: f.default for name, f in model.model_fields.items()}
    assert set(ours) == set(real), f"{model.__name__}: stand-in {sorted(ours)} vs sglang {sorted(real)}"
    for name, (_ann, default) in real.items():
        if model.model_fields[name].is_required():
            assert default is None, f"{model.__name__}.{name} has a default in sglang"
            continue
        assert ours[name] == default, f"{model.__name__}.{name}: stand-in {ours[name]!r}, sglang {default!r}"


def _string_constants(node: ast.AST) -> list[str]:
    out: list[str] = []
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.append(n.value)
    return out


def test_standin_messages_are_sglangs() -> None:
    updater = sglang_source("srt/managers/scheduler_components/weight_updater.py")
    fn = function(updater, "flush_cache_after_weight_update")
    assert "".join(_string_constants(fn)[1:]) == standin.NOT_FLUSHED, "the not-flushed message changed"
    flush = function(sglang_source(HTTP_SERVER), "flush_cache")
    consts = _string_constants(flush)
    assert "Flush cache failed.\n" in consts
    assert any(c.startswith("Cache flushed.\n") for c in consts)


# --------------------------------------------------------------------------- behaviour


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang-ckpts")
    out = {"A": make_tiny_checkpoint(root / "A", seed=1), "B": make_tiny_checkpoint(root / "B", seed=2)}
    empty = root / "empty"
    empty.mkdir()
    shutil.copy(out["B"] / "config.json", empty / "config.json")
    out["empty"] = empty
    bad = root / "bad-shape"  # B with one tensor of the wrong shape in the second of two shards
    make_tiny_checkpoint(bad, seed=2, shards=2)
    from safetensors.torch import load_file, save_file

    shard = sorted(bad.glob("model-*.safetensors"))[-1]
    tensors = load_file(str(shard))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].flatten()[:-1].clone()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    out["bad"] = bad
    return out


@pytest.fixture(scope="module")
def fresh(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Greedy tokens of a stand-in started on each checkpoint (the references)."""
    logs = tmp_path_factory.mktemp("sglang-logs")
    out: dict[str, list[int]] = {}
    for name in ("A", "B"):
        with SGLangStandIn.start(ckpts[name], logs / f"fresh-{name}.log") as srv:
            out[name] = SGLangAPI("ref", srv.url).greedy(PROMPT, 8)[0]
            out[name + "100"] = SGLangAPI("ref", srv.url).greedy(PROMPT, 100)[0]
    assert out["A"] != out["B"]
    return out


@pytest.fixture(scope="module")
def shared(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangStandIn]:
    log = tmp_path_factory.mktemp("sglang-logs") / "sglang.log"
    with SGLangStandIn.start(ckpts["A"], log, api_key="user-key", admin_api_key="admin-key",
                             step_delay_s=STEP_DELAY_S) as s:
        yield s


@pytest.fixture
def srv(shared: SGLangStandIn, ckpts: dict[str, Path], fresh: dict[str, list[int]]) -> Iterator[SGLangStandIn]:
    """The shared stand-in, put back on A (version "default", resumed, idle, cache flushed) after each test."""
    yield shared
    assert shared.alive(), shared.log_tail()
    client = SGLangAPI("reset", shared.url, api_key="user-key", admin_api_key="admin-key")
    client.continue_generation()
    assert client.flush_cache(timeout_s=60)[0]
    assert client.update_weights_from_disk(str(ckpts["A"]), weight_version="default").success
    assert client.greedy(PROMPT, 8) == (fresh["A"], "default")


@pytest.fixture
def api(srv: SGLangStandIn) -> Iterator[SGLangAPI]:
    client = SGLangAPI("s0", srv.url, api_key="user-key", admin_api_key="admin-key")
    yield client
    client.close()


def held_by_pause(api: SGLangAPI) -> int:
    """Requests the stand-in holds until continue_generation (its /metrics line)."""
    text = httpx.get(api.http.url + "/metrics", timeout=5).text
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("standin:held_by_pause ")))


class Background:
    """A greedy /generate in a thread."""

    def __init__(self, api: SGLangAPI, prompt: list[int], n: int) -> None:
        self.result: tuple[list[int], str | None] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(api, prompt, n), daemon=True)
        self.thread.start()

    def _run(self, api: SGLangAPI, prompt: list[int], n: int) -> None:
        try:
            self.result = api.greedy(prompt, n)
        except BaseException as exc:  # noqa: BLE001
            self.error = exc

    def join(self, timeout: float = 60) -> tuple[list[int], str | None]:
        self.thread.join(timeout)
        assert self.error is None, self.error
        assert self.result is not None, "the request did not finish"
        return self.result


def test_auth_admin_routes_need_the_admin_key_and_generation_the_api_key(srv: SGLangStandIn) -> None:
    def h(key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    for key, want in ((None, 401), ("user-key", 401), ("admin-key", 200)):
        assert httpx.post(srv.url + "/flush_cache", headers=h(key)).status_code == want, key
    gen = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
    for key, want in ((None, 401), ("admin-key", 401), ("user-key", 200)):
        assert httpx.post(srv.url + "/generate", json=gen, headers=h(key)).status_code == want, key
    assert httpx.get(srv.url + "/health").status_code == 200 and httpx.get(srv.url + "/ready").status_code == 200


def test_update_from_disk_serves_what_a_fresh_server_serves(api: SGLangAPI, ckpts: dict[str, Path],
                                                           fresh: dict[str, list[int]]) -> None:
    assert api.greedy(PROMPT, 8) == (fresh["A"], "default")
    reply = api.update_weights_from_disk(str(ckpts["B"]), weight_version="B-1")
    assert reply.success and reply.status == 200 and "Weight version updated to B-1" in reply.message
    assert api.greedy(PROMPT, 8) == (fresh["B"], "B-1")  # flushed: no stale prefix cache
    info = api.model_info()
    assert (info["weight_version"], info["model_path"]) == ("B-1", str(ckpts["B"]))


def test_unpaused_update_waits_for_requests_in_flight(api: SGLangAPI, ckpts: dict[str, Path],
                                                      fresh: dict[str, list[int]]) -> None:
    bg = Background(api, PROMPT, 100)
    time.sleep(0.3)
    reply = api.update_weights_from_disk(str(ckpts["B"]), weight_version="B-1")
    assert reply.success
    assert bg.join() == (fresh["A100"], "default")  # served wholly by A: the update waited for it
    assert api.greedy(PROMPT, 8) == (fresh["B"], "B-1")


def test_paused_in_place_update_loads_new_weights_but_reports_failure(
    api: SGLangAPI, ckpts: dict[str, Path], fresh: dict[str, list[int]]
) -> None:
    api.greedy(PROMPT, 8)  # PROMPT's KV under A is now in the prefix cache
    bg = Background(api, [9, 10, 11], 100)
    time.sleep(0.3)
    api.pause_generation("in_place")
    assert not api.ready()
    reply = api.update_weights_from_disk(str(ckpts["B"]), weight_version="B-1")
    assert (reply.success, reply.status, reply.loaded_but_not_flushed) == (False, 400, True)
    # /model_info still names A and the old version, over B's weights
    assert api.model_info()["weight_version"] == "default"
    assert api.model_info()["model_path"] == str(ckpts["A"])
    assert api.flush_cache() == (False, "Flush cache failed.")  # the in-place request is still running
    api.continue_generation()
    bg.join()
    stale, version = api.greedy(PROMPT, 8)  # the prefix cache still holds A's KV for PROMPT
    assert version == "B-1" and stale != fresh["B"]  # generation reports the scheduler's version
    ok, _ = api.flush_cache(timeout_s=5)
    assert ok
    assert api.greedy(PROMPT, 8)[0] == fresh["B"]
    api.update_weight_version("B-1")
    assert api.weight_version() == "B-1"


def test_retract_pause_lets_the_update_flush_and_requests_continue_on_new_weights(
    api: SGLangAPI, ckpts: dict[str, Path], fresh: dict[str, list[int]]
) -> None:
    bg = Background(api, PROMPT, 100)
    time.sleep(0.5)
    api.pause_generation("retract")
    reply = api.update_weights_from_disk(str(ckpts["B"]), weight_version="B-1")
    assert reply.success, reply
    queued = Background(api, PROMPT, 8)  # a new request while paused waits; it is not refused
    wait_until(lambda: held_by_pause(api) == 1, 30, 0.02, "the new request held at the pause")
    assert queued.thread.is_alive() and queued.error is None
    api.continue_generation()
    out, _version = bg.join()
    assert queued.join() == (fresh["B"], "B-1")
    n = next(i for i, (x, y) in enumerate(zip(out, fresh["A100"], strict=True)) if x != y)
    assert n > 0  # A served the start, B (recomputed KV) the rest
    api2 = SGLangAPI("s0", api.http.url, api_key="user-key")
    assert out[n:] == api2.greedy(PROMPT + out[:n], 100 - n)[0]


def test_flush_is_refused_with_requests_in_flight_and_waits_with_a_timeout(api: SGLangAPI) -> None:
    bg = Background(api, PROMPT, 60)
    time.sleep(0.3)
    assert api.flush_cache() == (False, "Flush cache failed.")
    ok, text = api.flush_cache(timeout_s=30)
    assert ok and text.startswith("Cache flushed.")
    bg.join()


def test_update_without_weights_fails_and_keeps_serving(api: SGLangAPI, ckpts: dict[str, Path],
                                                       fresh: dict[str, list[int]]) -> None:
    reply = api.update_weights_from_disk(str(ckpts["empty"]), weight_version="bad")
    assert not reply.success and reply.message.startswith("Failed to get weights iterator")
    assert not reply.loaded_but_not_flushed
    assert api.greedy(PROMPT, 8) == (fresh["A"], "default")


def test_a_failing_load_rolls_back_to_the_new_path_and_the_server_dies(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    """SGLang's "rollback" re-reads model_config.model_path, already the new (bad) path; the
    second failure escapes the scheduler, which takes the whole server down."""
    srv = SGLangStandIn.start(ckpts["A"], tmp_path / "sglang.log")
    api = SGLangAPI("s1", srv.url)
    with pytest.raises(EngineAPIError):
        api.update_weights_from_disk(str(ckpts["bad"]), weight_version="bad")
    try:
        assert srv.wait_exit(30) is not None
        assert "Scheduler hit an exception" in srv.log_tail()
        assert "Attempted to load weight" in srv.log_tail()
        assert not api.health()
    finally:
        srv.stop()
