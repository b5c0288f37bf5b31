"""Fast unit tests of the low-level engine clients over an in-process httpx transport.

They prove the clients send nothing but what ROUTES_USED lists (the route-table test checks
that list against the engines' source), send the token on every call, and turn every kind of
bad answer into an error naming the engine, the worker, the route and the reply. The real
behaviour is tested against a real vLLM (test_vllm_api.py) and the SGLang stand-in.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest

from daemon.engines import sglang_api, vllm_api
from daemon.engines.engine_http import EngineAPIError, EngineUnreachable
from daemon.engines.sglang_api import SGLangAPI
from daemon.engines.vllm_api import VLLMAPI, Timeouts

pytestmark = pytest.mark.quick


class Recorder:
    """A fake engine: answers from a table, records what each call sent."""

    def __init__(self, replies: dict[tuple[str, str], Any]) -> None:
        self.replies = replies
        self.calls: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.calls.append({
            "method": request.method, "path": request.url.path, "query": dict(request.url.params),
            "body": body, "auth": request.headers.get("authorization"),
        })
        reply = self.replies.get((request.method, request.url.path))
        if callable(reply):
            reply = reply(request, body)
        if reply is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        if isinstance(reply, httpx.Response):
            return reply
        if isinstance(reply, str):
            return httpx.Response(200, text=reply)
        return httpx.Response(200, json=reply)


VLLM_REPLIES: dict[tuple[str, str], Any] = {
    ("GET", "/health"): "",
    ("GET", "/is_paused"): {"is_paused": True},
    ("POST", "/pause"): {"status": "paused"},
    ("POST", "/resume"): {"status": "resumed"},
    ("POST", "/collective_rpc"): {"results": [None]},
    ("POST", "/reset_prefix_cache"): {"success": True},
    ("POST", "/update_weight_version"): lambda req, body: {"success": True, "new_version": body["new_version"]},
    ("GET", "/weight_info"): {"weight_version": "v1"},
    ("POST", "/weight_checker"): lambda req, body: (
        {"checksums": {"dp0:pp0:pcp0:tp0:w": "ab"}} if body["action"] == "checksum" else {"match": True, "mismatches": []}
    ),
    ("GET", "/metrics"): 'vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_waiting{engine="0"} 1.0\n',
    ("GET", "/v1/models"): {"data": [{"id": "/models/a"}, {"id": "sql", "root": "/adapters/sql@2", "parent": "/models/a"}]},
    ("POST", "/v1/completions"): {"choices": [{"token_ids": [4, 5, 6], "text": ""}]},
    ("POST", "/v1/load_lora_adapter"): "Success: LoRA adapter 'sql' added successfully.",
    ("POST", "/v1/unload_lora_adapter"): "Success: LoRA adapter 'sql' removed successfully.",
}


def vllm_client(replies: dict[tuple[str, str], Any] | None = None, **kw: Any) -> tuple[VLLMAPI, Recorder]:
    rec = Recorder({**VLLM_REPLIES, **(replies or {})})
    return VLLMAPI("w0", "http://vllm.test", token="tok", transport=httpx.MockTransport(rec), **kw), rec


def exercise_vllm(api: VLLMAPI) -> None:
    assert api.health()
    assert api.is_paused() is True
    for mode in vllm_api.PAUSE_MODES:
        api.pause(mode, clear_cache=False)
    api.resume()
    assert api.reload_weights("/ckpt/b") == [None]
    assert api.reset_prefix_cache(reset_running_requests=True) == 1
    api.update_weight_version("v2")
    assert api.weight_version() == "v1"
    assert api.weight_checksums() == {"dp0:pp0:pcp0:tp0:w": "ab"}
    assert api.weight_compare({"dp0:pp0:pcp0:tp0:w": "ab"}) == []
    assert api.requests_in_engine() == (2, 1)
    assert api.greedy([1, 2, 3], 3) == [4, 5, 6]
    api.load_lora_adapter("sql", "/adapters/sql@2", load_inplace=True)
    assert api.lora_adapters() == {"sql": "/adapters/sql@2"}
    api.unload_lora_adapter("sql")


def assert_only_declared(calls: list[dict[str, Any]], table: dict[tuple[str, str], Any]) -> None:
    for c in calls:
        key = (c["method"], c["path"])
        assert key in table, f"client called {key}, not in ROUTES_USED"
        use = table[key]
        assert set(c["query"]) <= set(use.query), (key, c["query"])
        assert set(c["body"] or {}) <= set(use.body), (key, c["body"])


def test_vllm_client_sends_only_declared_routes_and_fields_with_the_token_every_time() -> None:
    api, rec = vllm_client()
    exercise_vllm(api)
    assert_only_declared(rec.calls, vllm_api.ROUTES_USED)
    assert {(c["method"], c["path"]) for c in rec.calls} == set(vllm_api.ROUTES_USED)  # each one exercised
    assert all(c["auth"] == "Bearer tok" for c in rec.calls)
    rpc = next(c for c in rec.calls if c["path"] == "/collective_rpc")
    assert rpc["body"]["method"] == "reload_weights" and rpc["body"]["kwargs"] == {"weights_path": "/ckpt/b"}
    pause = next(c for c in rec.calls if c["path"] == "/pause")
    assert pause["query"] == {"mode": "abort", "clear_cache": "false"}
    completion = next(c for c in rec.calls if c["path"] == "/v1/completions")["body"]
    assert completion["temperature"] == 0.0 and completion["ignore_eos"] and completion["return_token_ids"]
    assert completion["model"] == "/models/a"  # the served name, asked from /v1/models


def test_vllm_never_sends_the_weight_checker_reset_that_zeroes_weights() -> None:
    assert "reset" not in vllm_api.WEIGHT_CHECKER_ACTIONS
    api, rec = vllm_client()
    exercise_vllm(api)
    assert all(c["body"]["action"] != "reset" for c in rec.calls if c["path"] == "/weight_checker")


def test_vllm_reset_prefix_cache_retries_until_success() -> None:
    answers = iter([False, False, True])
    api, rec = vllm_client({("POST", "/reset_prefix_cache"): lambda r, b: {"success": next(answers)}})
    assert api.reset_prefix_cache() == 3
    assert sum(c["path"] == "/reset_prefix_cache" for c in rec.calls) == 3


def test_vllm_reset_prefix_cache_gives_up_with_a_clear_error() -> None:
    api, _ = vllm_client({("POST", "/reset_prefix_cache"): {"success": False}},
                         timeouts=Timeouts(reset_cache_s=0.2))
    with pytest.raises(EngineAPIError, match=r"vLLM worker w0 .*POST /reset_prefix_cache: still success=false"):
        api.reset_prefix_cache(interval_s=0.01)


@pytest.mark.parametrize(
    "route,reply,call,match",
    [
        (("POST", "/collective_rpc"), httpx.Response(500, json={"error": {"message": "Worker failed: no such file"}}),
         lambda a: a.reload_weights("/x"), r"POST /collective_rpc: HTTP 500: .*Worker failed: no such file"),
        (("POST", "/pause"), httpx.Response(400, json={"error": "Invalid pause mode"}),
         lambda a: a.pause("keep"), r"POST /pause\?mode=keep&clear_cache=true: HTTP 400: .*Invalid pause mode"),
        (("POST", "/pause"), {"status": "weird"}, lambda a: a.pause("wait"), r"unexpected reply"),
        (("GET", "/weight_info"), {"version": "x"}, lambda a: a.weight_version(), r"no str 'weight_version'"),
        (("GET", "/weight_info"), httpx.Response(200, text="<html>"), lambda a: a.weight_version(), r"non-JSON body"),
        (("POST", "/update_weight_version"), {"success": True, "new_version": "other"},
         lambda a: a.update_weight_version("v9"), r"not recorded"),
        (("POST", "/v1/completions"), {"choices": []}, lambda a: a.greedy([1], 2), r"no choices\[0\].token_ids"),
        (("POST", "/v1/completions"), {"choices": [{"token_ids": ["a"]}]}, lambda a: a.greedy([1], 2), r"not a list of ints"),
        (("POST", "/v1/completions"), httpx.Response(401, json={"error": "Unauthorized"}),
         lambda a: a.greedy([1], 2), r"HTTP 401: .*Unauthorized"),
        (("POST", "/weight_checker"), {"match": True}, lambda a: a.weight_compare({}), r"unexpected reply"),
    ],
)
def test_vllm_errors_name_engine_worker_route_and_reply(route: Any, reply: Any, call: Any, match: str) -> None:
    api, _ = vllm_client({route: reply})
    with pytest.raises(EngineAPIError, match=match) as exc:
        call(api)
    assert str(exc.value).startswith("vLLM worker w0 (http://vllm.test): ")


def test_vllm_without_weight_checker_reports_no_checksums() -> None:
    api, _ = vllm_client({("POST", "/weight_checker"): None})  # 404: an older vLLM
    assert api.weight_checksums() == {}


def test_health_is_false_on_503_and_on_no_answer() -> None:
    api, _ = vllm_client({("GET", "/health"): httpx.Response(503)})
    assert api.health() is False
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = VLLMAPI("w1", f"http://127.0.0.1:{port}", timeouts=Timeouts(call_s=1))
    assert dead.health() is False
    with pytest.raises(EngineUnreachable, match=rf"vLLM worker w1 \(http://127.0.0.1:{port}\): POST /resume: no answer"):
        dead.resume()


def test_a_call_past_its_timeout_is_unreachable_and_says_timed_out() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("read timed out", request=request)

    api = VLLMAPI("w0", "http://vllm.test", transport=httpx.MockTransport(slow))
    with pytest.raises(EngineUnreachable, match=r"POST /collective_rpc: timed out"):
        api.reload_weights("/x")


def test_every_vllm_call_carries_a_timeout() -> None:
    seen: list[dict[str, Any]] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions.get("timeout", {}))
        return Recorder(VLLM_REPLIES)(request)

    api = VLLMAPI("w0", "http://vllm.test", token="t", transport=httpx.MockTransport(record),
                  timeouts=Timeouts(call_s=3, pause_s=5, reload_s=77, probe_s=4))
    exercise_vllm(api)
    assert seen and all(t.get("read") for t in seen)  # none unbounded
    assert max(t["read"] for t in seen) == 77 + 3  # reload: the RPC's own timeout plus slack
    assert sorted({t["read"] for t in seen}) == [3, 4, 5, 77, 80]


# --------------------------------------------------------------------------- SGLang

SGLANG_REPLIES: dict[tuple[str, str], Any] = {
    ("GET", "/health"): "",
    ("GET", "/ready"): "",
    ("GET", "/model_info"): {"model_path": "/m/a", "weight_version": "v1"},
    ("POST", "/pause_generation"): {"message": "Generation paused successfully.", "status": "ok"},
    ("POST", "/continue_generation"): {"message": "Generation continued successfully.", "status": "ok"},
    ("POST", "/update_weights_from_disk"): {"success": True, "message": "Succeeded", "num_paused_requests": 0},
    ("POST", "/flush_cache"): "Cache flushed.\n",
    ("POST", "/update_weight_version"): lambda r, b: {"success": True, "message": "ok", "new_version": b["new_version"]},
    ("POST", "/generate"): {"text": "", "output_ids": [7, 8], "meta_info": {"weight_version": "v1"}},
    ("POST", "/load_lora_adapter"): {"success": True, "error_message": None, "loaded_adapters": {"sql": "/a/sql@1"}},
    ("POST", "/unload_lora_adapter"): {"success": True, "error_message": None, "loaded_adapters": {}},
    ("GET", "/v1/models"): {"data": [{"id": "/m/a"}, {"id": "sql", "root": "/a/sql@1", "parent": "/m/a"}]},
}


def sglang_client(replies: dict[tuple[str, str], Any] | None = None, **kw: Any) -> tuple[SGLangAPI, Recorder]:
    rec = Recorder({**SGLANG_REPLIES, **(replies or {})})
    return SGLangAPI("s0", "http://sglang.test", transport=httpx.MockTransport(rec), **kw), rec


def exercise_sglang(api: SGLangAPI) -> None:
    assert api.health() and api.ready()
    assert api.weight_version() == "v1"
    for mode in sglang_api.PAUSE_MODES:
        api.pause_generation(mode)
    reply = api.update_weights_from_disk("/m/b", weight_version="v2")
    assert reply.success and not reply.loaded_but_not_flushed
    assert api.flush_cache(timeout_s=2.0) == (True, "Cache flushed.")
    api.update_weight_version("v2")
    api.continue_generation()
    assert api.greedy([1, 2], 2) == ([7, 8], "v1")
    api.load_lora_adapter("sql", "/a/sql@1")
    assert api.lora_adapters() == {"sql": "/a/sql@1"}
    assert api.greedy([1, 2], 2, lora="sql") == ([7, 8], "v1")
    api.unload_lora_adapter("sql")


def test_sglang_client_sends_only_declared_routes_and_fields() -> None:
    api, rec = sglang_client(api_key="user-key", admin_api_key="admin-key")
    exercise_sglang(api)
    assert_only_declared(rec.calls, sglang_api.ROUTES_USED)
    assert {(c["method"], c["path"]) for c in rec.calls} == set(sglang_api.ROUTES_USED)
    gen = next(c for c in rec.calls if c["path"] == "/generate")["body"]
    assert set(gen["sampling_params"]) <= set(sglang_api.SAMPLING_PARAMS_USED)
    assert gen["sampling_params"]["temperature"] == 0.0
    # its default would abort every request in flight
    assert next(c for c in rec.calls if c["path"] == "/update_weight_version")["body"]["abort_all_requests"] is False
    upd = next(c for c in rec.calls if c["path"] == "/update_weights_from_disk")["body"]
    assert upd == {"model_path": "/m/b", "weight_version": "v2", "flush_cache": True,
                   "abort_all_requests": False, "keep_pause": False}


@pytest.mark.parametrize("api_key,admin_key", [("user-key", "admin-key"), ("user-key", None), (None, None)])
def test_sglang_client_sends_the_admin_key_to_admin_routes_and_the_api_key_elsewhere(
    api_key: str | None, admin_key: str | None
) -> None:
    api, rec = sglang_client(api_key=api_key, admin_api_key=admin_key)
    exercise_sglang(api)
    for c in rec.calls:
        want = (admin_key or api_key) if c["path"] in sglang_api.ADMIN_ROUTES else api_key
        assert c["auth"] == (f"Bearer {want}" if want else None), c


def test_sglang_update_reply_not_flushed_means_new_weights_loaded() -> None:
    msg = ("Weights were updated, but the cache was not flushed because requests are still running or queued. "
           "Retract or finish them, then call /flush_cache.")
    api, _ = sglang_client({("POST", "/update_weights_from_disk"): httpx.Response(
        400, json={"success": False, "message": msg, "num_paused_requests": 0})})
    reply = api.update_weights_from_disk("/m/b", weight_version="v2")
    assert (reply.success, reply.loaded_but_not_flushed, reply.status) == (False, True, 400)
    api, _ = sglang_client({("POST", "/update_weights_from_disk"): httpx.Response(
        400, json={"success": False, "message": "Failed to update weights: boom.\nRolling back to original weights."})})
    reply = api.update_weights_from_disk("/m/b", weight_version="v2")
    assert (reply.success, reply.loaded_but_not_flushed) == (False, False)


@pytest.mark.parametrize(
    "route,reply,call,match",
    [
        (("POST", "/update_weights_from_disk"), httpx.Response(500, text="Internal Server Error"),
         lambda a: a.update_weights_from_disk("/m", weight_version=None), r"HTTP 500: Internal Server Error"),
        (("POST", "/update_weights_from_disk"), httpx.Response(400, json={"detail": "bad"}),
         lambda a: a.update_weights_from_disk("/m", weight_version=None), r"without a success flag"),
        (("POST", "/pause_generation"), httpx.Response(401, json={"error": "Unauthorized"}),
         lambda a: a.pause_generation("retract"), r"POST /pause_generation: HTTP 401"),
        (("POST", "/update_weight_version"), httpx.Response(400, json={"success": False, "message": "nope"}),
         lambda a: a.update_weight_version("v3"), r"POST /update_weight_version: HTTP 400: .*nope"),
        (("POST", "/generate"), {"text": "x"}, lambda a: a.greedy([1], 1), r"no output_ids list"),
    ],
)
def test_sglang_errors_name_engine_worker_route_and_reply(route: Any, reply: Any, call: Any, match: str) -> None:
    api, _ = sglang_client({route: reply})
    with pytest.raises(EngineAPIError, match=match) as exc:
        call(api)
    assert str(exc.value).startswith("SGLang worker s0 (http://sglang.test): ")


def test_sglang_flush_refused_is_an_answer_not_an_error() -> None:
    api, _ = sglang_client({("POST", "/flush_cache"): httpx.Response(400, text="Flush cache failed.\n")})
    assert api.flush_cache() == (False, "Flush cache failed.")


def test_sglang_ready_is_false_while_paused() -> None:
    api, _ = sglang_client({("GET", "/ready"): httpx.Response(503)})
    assert api.ready() is False and api.health() is True
