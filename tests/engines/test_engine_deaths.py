"""An engine that dies is infrastructure, not a verdict on the version (fast, over fake engines).

vLLM answers HTTP 500 "EngineCore encountered an issue" (EngineDeadError) to every call once its
engine core died, and /health 503; SGLang's /health stops answering 200. The clients turn such a
5xx into WorkerUnreachable (counted against `rollout.max_infra_retries`, never rejecting the
version at once), while a 5xx from an engine that stays healthy (vLLM's reload of a directory it
cannot read) stays the checkpoint's fault. The real engine dying is in test_vllm_engine_death.py.
"""

from __future__ import annotations

import httpx
import pytest

from daemon.engines.base import WorkerError, WorkerUnreachable
from daemon.engines.sglang import SGLangWorkerClient
from daemon.engines.sglang_api import SGLangAPI
from daemon.engines.vllm import VLLMWorkerClient
from daemon.engines.vllm_api import VLLMAPI
from tests.engines.test_engine_clients import SGLANG_REPLIES, VLLM_REPLIES, Recorder

pytestmark = pytest.mark.quick

DEAD = httpx.Response(500, json={"error": {"message": "EngineCore encountered an issue. See stack trace (above) "
                                           "for the root cause.", "type": "InternalServerError", "code": 500}})  # fmt: skip


class Engine(Recorder):
    """A fake engine whose /health flips to 503 once `dead` is set."""

    def __init__(self, replies: dict[tuple[str, str], object]) -> None:
        super().__init__(dict(replies))
        self.dead = False
        self.replies[("GET", "/health")] = lambda req, body: httpx.Response(503 if self.dead else 200, text="")


def vllm(**replies: object) -> tuple[VLLMWorkerClient, Engine]:
    eng = Engine({**VLLM_REPLIES, **{tuple(k.split(" ", 1)): v for k, v in replies.items()}})
    client = VLLMWorkerClient("v0", "http://vllm.test")
    client.api = VLLMAPI("v0", "http://vllm.test", token="tok", transport=httpx.MockTransport(eng))
    return client, eng


def test_vllm_probe_that_kills_the_engine_is_unreachable_not_the_versions_fault() -> None:
    client, eng = vllm(**{"POST /v1/completions": DEAD})
    eng.dead = True
    with pytest.raises(WorkerUnreachable, match="the engine died.*EngineCore encountered an issue"):
        client.probe()


def test_vllm_5xx_while_the_engine_is_healthy_stays_a_refusal_of_the_version() -> None:
    # vLLM's reload of a directory it cannot read: HTTP 500, /health still 200 (vllm_api.py).
    client, _ = vllm(**{"POST /collective_rpc": httpx.Response(500, json={"error": "Cannot find any model weights"})})
    with pytest.raises(WorkerError) as err:
        client._call("update: reload_weights", lambda: client.api.reload_weights("/nope"))
    assert not isinstance(err.value, WorkerUnreachable), err.value


def test_vllm_5xx_with_health_gone_is_unreachable_whatever_the_reply_says() -> None:
    client, eng = vllm(**{"POST /collective_rpc": httpx.Response(500, text="Internal Server Error")})
    eng.dead = True
    with pytest.raises(WorkerUnreachable, match="the engine died"):
        client._call("update: reload_weights", lambda: client.api.reload_weights("/ckpt"))


def test_sglang_generate_5xx_after_its_scheduler_died_is_unreachable() -> None:
    eng = Engine({**SGLANG_REPLIES, ("POST", "/generate"): httpx.Response(500, text="scheduler died")})
    client = SGLangWorkerClient("s0", "http://sglang.test")
    client.api = SGLangAPI("s0", "http://sglang.test", transport=httpx.MockTransport(eng))
    eng.dead = True
    with pytest.raises(WorkerUnreachable, match="the engine died"):
        client._call("probe", lambda: client.api.greedy([1, 2, 3], 2))
    eng.dead = False
    with pytest.raises(WorkerError) as err:
        client._call("probe", lambda: client.api.greedy([1, 2, 3], 2))
    assert not isinstance(err.value, WorkerUnreachable), err.value
