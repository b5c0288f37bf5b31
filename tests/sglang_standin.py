"""A stand-in for an SGLang 0.5.23 server: the routes hotswap drives, with SGLang's semantics.

    python tests/sglang_standin.py --model DIR --port N [--api-key K] [--admin-api-key K]
                                   [--weight-version V] [--step-delay-s S]

A real tiny Llama (transformers, float32) generates the tokens, one decode step per scheduler
iteration, with a real KV cache per request and an exact-prompt prefix cache, so stale caches
and in-place weight updates change the served tokens as they would in SGLang. What it copies
(file:line in the sglang 0.5.23 wheel; daemon/engines/sglang_api.py has the full list):

- tokenizer-manager layer: pause flag (new /generate requests wait while paused; /ready 503),
  a reader/writer model-update lock (an unpaused disk update waits for in-flight requests),
  its own weight_version and model_path, updated only when an update succeeds;
- scheduler layer: waiting queue and running batch, engine-paused flag, retract / in_place,
  flush refused while requests are running (or queued, when not paused), its own weight
  version, recorded before the flush, which /generate's meta_info reports;
- disk update: model_path switched before loading, "Weights were updated, but the cache was not
  flushed" with success=false, the rollback that reloads the NEW path, and a scheduler that
  dies (the whole server exits) when that rollback fails too (scheduler.py:6370-6378);
- auth: ADMIN_OPTIONAL admin routes, NORMAL /generate, open /health, /ready, /metrics;
- LoRA (with --enable-lora; tokenizer_control_mixin.py:634-860, lora/lora_registry.py): load
  refused for a name already loaded (no in-place replacement), unload unregisters the name at
  once and waits for the requests using that adapter to finish, /generate's `lora_path` names
  one (refused when not loaded), /v1/models lists them with parent and root. The adapter math is
  this file's own (unmerged x @ A.T @ B.T * alpha / r on the targeted linear layers), not
  hotswap's.

Not copied: tokenizers and text, batching limits, CUDA graphs, TP, multimodal, LoRA eviction.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import logging
import os
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import uvicorn
from fastapi import Body, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

log = logging.getLogger("sglang-standin")
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)


# Routes marked @auth_level(AuthLevel.ADMIN_OPTIONAL) in http_server.py; all others are NORMAL.
ADMIN_OPTIONAL_ROUTES = ("/pause_generation", "/continue_generation", "/update_weights_from_disk",
                         "/flush_cache", "/update_weight_version", "/load_lora_adapter", "/unload_lora_adapter")
ROUTES = {  # path -> methods, as registered by http_server.py
    "/health": ("GET",), "/ready": ("GET",), "/model_info": ("GET",),
    "/pause_generation": ("POST",), "/continue_generation": ("POST",),
    "/update_weights_from_disk": ("POST",), "/flush_cache": ("GET", "POST"),
    "/update_weight_version": ("POST",), "/generate": ("POST", "PUT"),
    "/load_lora_adapter": ("POST",), "/unload_lora_adapter": ("POST",), "/v1/models": ("GET",),
}
LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


# --------------------------------------------------------------------------- request bodies
# Field names, types and defaults as in sglang/srt/managers/io_struct.py (0.5.23); the
# fidelity test compares them with the parsed classes. Unknown fields are refused (422).


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str | None = None
    http_worker_ipc: str | None = None


class PauseGenerationReqInput(_Body):  # io_struct.py:1927
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_Body):  # io_struct.py:1949
    torch_empty_cache: bool = True


class UpdateWeightFromDiskReqInput(_Body):  # io_struct.py:1970
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False  # accepted and unused, as in 0.5.23
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class UpdateWeightVersionReqInput(_Body):  # io_struct.py:2155
    new_version: str
    abort_all_requests: bool = True


class LoadLoRAAdapterReqInput(_Body):  # io_struct.py:2516
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class UnloadLoRAAdapterReqInput(_Body):  # io_struct.py:2535
    lora_name: str
    lora_id: str | None = None


class GenerateReqInput(BaseModel):  # the subset of io_struct.GenerateReqInput we serve
    model_config = ConfigDict(extra="ignore")
    input_ids: list[int]
    sampling_params: dict[str, Any] | None = None
    rid: str | None = None
    stream: bool = False
    lora_path: str | None = None  # an adapter's name (io_struct.py:277)


# --------------------------------------------------------------------------- locks and requests


class RWLock:
    """SGLang's model_update_lock: many readers (requests) or one writer (a weight update)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def reader(self) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def writer(self) -> Any:
        with self._cond:
            self._writers_waiting += 1
            self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()

    def is_locked(self) -> bool:
        with self._cond:
            return self._writer or self._readers > 0


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool
    output_ids: list[int] = field(default_factory=list)
    cache: Any = None  # the KV cache (transformers DynamicCache) or None: needs a prefill
    logits: Any = None
    finish_reason: dict[str, Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    retractions: int = 0
    lora_id: str | None = None


# --------------------------------------------------------------------------- the scheduler


class Scheduler:
    """One decode step per iteration over the running batch; control calls run between steps."""

    def __init__(self, model_dir: Path, weight_version: str, step_delay_s: float) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = json.loads((model_dir / "config.json").read_text())
        cfg["torch_dtype"] = "float32"
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
        # transformers 5.x names the KV cache argument `cache`; older releases `past_key_values`
        self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.eos = int(cfg.get("eos_token_id", 2))
        self.model_path = str(model_dir)  # model_config.model_path
        self.weight_version = weight_version  # the scheduler's (what /generate reports)
        self.step_delay_s = step_delay_s
        self.mu = threading.Condition(threading.RLock())
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.engine_paused = False
        self.prefix_cache: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self.loras: dict[str, dict[str, tuple[Any, Any, float]]] = {}  # lora_id -> module -> (A, B, scale)
        self._linear = {n: m for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)}
        self._active: dict[str, tuple[Any, Any, float]] | None = None
        for n, m in self._linear.items():
            m.register_forward_hook(self._lora_hook(n))
        self.load_weights(self.model_path)
        threading.Thread(target=self._loop, name="scheduler", daemon=True).start()

    # -- weights --------------------------------------------------------------------------
    def _weight_iter(self, path: str) -> Any:
        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise RuntimeError(f"Cannot find any model weights with `{path}`")

        def it() -> Any:
            for f in files:
                with safe_open(str(f), framework="pt") as sf:
                    for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                        yield name, sf.get_tensor(name)

        return it()

    def _load_from(self, weights: Any) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                param = params[name]  # unknown name: KeyError, as the model's load_weights
                if param.shape != tensor.shape:
                    raise AssertionError(
                        f"Attempted to load weight ({tuple(tensor.shape)}) into parameter ({tuple(param.shape)})"
                    )
                param.copy_(tensor.to(param.dtype))  # missing names keep their old values

    def load_weights(self, path: str) -> None:
        self._load_from(self._weight_iter(path))

    def update_weights_from_disk(self, req: UpdateWeightFromDiskReqInput) -> tuple[bool, str]:
        """model_runner_components/weight_updater.py:174-254 then scheduler_components/weight_updater.py:138-165."""
        with self.mu:
            self.model_path = req.model_path  # set BEFORE loading: the "rollback" reads it
            try:
                weights = self._weight_iter(self.model_path)
            except Exception as exc:  # noqa: BLE001
                return False, f"Failed to get weights iterator: {exc}."
            try:
                self._load_from(weights)
            except Exception as exc:  # noqa: BLE001
                message = f"Failed to update weights: {exc}.\nRolling back to original weights."
                try:
                    self.load_weights(self.model_path)  # the NEW path again
                except Exception:  # noqa: BLE001 - the scheduler process dies, and the server with it
                    log.exception("Scheduler hit an exception")
                    os._exit(1)
                return False, message
            if req.weight_version is not None:
                self.weight_version = req.weight_version
            if req.flush_cache and not self._flush_locked():
                return False, NOT_FLUSHED
            return True, "Succeeded to update model weights."

    # -- LoRA ---------------------------------------------------------------------------------
    def read_lora(self, path: str) -> dict[str, tuple[Any, Any, float]]:
        """An adapter's pairs by module, checked against the model (ValueError naming the problem)."""
        from safetensors.torch import load_file

        cfg = json.loads((Path(path) / "adapter_config.json").read_text())
        scale = float(cfg["lora_alpha"]) / int(cfg["r"])
        state = load_file(str(Path(path) / "adapter_model.safetensors"))
        out: dict[str, tuple[Any, Any, float]] = {}
        for key, a in state.items():
            if ".lora_A." not in key:
                continue
            module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            b, lin = state[key.replace(".lora_A.", ".lora_B.")], self._linear.get(module)
            if lin is None or tuple(a.shape) != (int(cfg["r"]), lin.in_features) or tuple(b.shape) != (lin.out_features, int(cfg["r"])):
                raise ValueError(f"LoRA weights of {module} do not fit the model")
            out[module] = (a.float(), b.float(), scale)
        return out

    def _lora_hook(self, module: str) -> Any:
        def hook(_m: Any, args: Any, output: Any) -> Any:
            pair = self._active.get(module) if self._active is not None else None
            if pair is None:
                return None
            a, b, scale = pair
            return output + (args[0] @ a.t()) @ b.t() * scale

        return hook

    # -- control ------------------------------------------------------------------------------
    def _idle(self) -> bool:  # scheduler.py:5337-5370, ignore_waiting while paused
        return not self.running and (self.engine_paused or not self.waiting)

    def _flush_locked(self) -> bool:
        if not self._idle():
            log.warning("Cache not flushed because there are pending requests. #queue-req: %d, #running-req: %d",
                        len(self.waiting), len(self.running))
            return False
        self.prefix_cache.clear()
        return True

    def flush(self, timeout_s: float) -> tuple[bool, str]:
        """scheduler_components/flush_wrapper.py:22-60."""
        deadline = time.monotonic() + timeout_s
        with self.mu:
            if timeout_s <= 0 or self._idle():
                return self._flush_locked(), ""
            while not self._idle():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, "Timed out waiting for idle state."
                self.mu.wait(min(left, 0.05))
            return self._flush_locked(), ""

    def pause(self, mode: str) -> None:
        """scheduler.py:5817-5932."""
        with self.mu:
            self.engine_paused = True
            if mode == "retract":
                for r in reversed(self.running):
                    r.cache, r.logits = None, None  # KV freed; recomputed after continue
                    r.retractions += 1
                    self.waiting.appendleft(r)
                self.running = []
            self.mu.notify_all()

    def resume(self) -> None:
        with self.mu:
            self.engine_paused = False
            self.mu.notify_all()

    def submit(self, r: Req) -> None:
        with self.mu:
            self.waiting.append(r)
            self.mu.notify_all()

    def abort_all(self) -> None:
        with self.mu:
            for r in [*self.running, *self.waiting]:
                r.finish_reason = {"type": "abort", "message": "Abort in waiting queue"}
                r.done.set()
            self.running, self.waiting = [], deque()
            self.mu.notify_all()

    # -- the loop -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.mu:
                self.mu.wait_for(lambda: not self.engine_paused and (self.waiting or self.running), timeout=0.2)
                if self.engine_paused or not (self.waiting or self.running):
                    self.mu.notify_all()
                    continue
                while self.waiting:
                    self.running.append(self.waiting.popleft())
                for r in list(self.running):
                    self._step(r)
                self.mu.notify_all()
            if self.step_delay_s:
                time.sleep(self.step_delay_s)

    @torch.no_grad()
    def _step(self, r: Req) -> None:
        self._active = self.loras.get(r.lora_id) if r.lora_id else None
        try:
            self._step_with(r)
        finally:
            self._active = None

    def _step_with(self, r: Req) -> None:
        if r.cache is None:  # prefill, through the prefix cache (one per adapter, as SGLang's radix cache)
            key = (r.lora_id, *r.input_ids, *r.output_ids)
            hit = self.prefix_cache.get(key)
            if hit is None:
                out = self.model(torch.tensor([list(key[1:])]), use_cache=True)
                r.cache, r.logits = self._kv(out), out.logits[0, -1]
                self.prefix_cache[key] = (copy.deepcopy(r.cache), r.logits.clone())
            else:
                r.cache, r.logits = copy.deepcopy(hit[0]), hit[1].clone()
        tok = int(torch.argmax(r.logits).item())
        r.output_ids.append(tok)
        if len(r.output_ids) >= r.max_new_tokens or (not r.ignore_eos and tok == self.eos):
            r.finish_reason = {"type": "length" if tok != self.eos or r.ignore_eos else "stop"}
            self.running.remove(r)
            r.done.set()
            return
        out = self.model(torch.tensor([[tok]]), use_cache=True, **{self.cache_kw: r.cache})
        r.cache, r.logits = self._kv(out), out.logits[0, -1]

    @staticmethod
    def _kv(out: Any) -> Any:
        return out["cache"] if "cache" in out else out["past_key_values"]


# --------------------------------------------------------------------------- the server


class TokenizerManager:
    def __init__(self, sched: Scheduler, model_path: str, weight_version: str) -> None:
        self.sched = sched
        self.model_path = model_path  # what /model_info answers
        self.weight_version = weight_version
        self.is_pause = False
        self.pause_cond = threading.Condition()
        self.update_lock = RWLock()
        self.enable_lora = False
        self.loras: dict[str, tuple[str, str]] = {}  # lora_name -> (lora_id, lora_path): the LoRARegistry
        self.lora_users: dict[str, int] = {}  # lora_id -> requests using it (its ConcurrentCounter)
        self.lora_cond = threading.Condition()
        self.generating = 0  # /generate requests holding the model-update lock as readers (/metrics)
        self.held_by_pause = 0  # /generate requests waiting for continue_generation (stand-in only, /metrics)
        self.generating_lock = threading.Lock()


def build_app(tm: TokenizerManager, api_key: str | None, admin_api_key: str | None) -> FastAPI:
    app = FastAPI()
    admin_routes = set(ADMIN_OPTIONAL_ROUTES)

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Any:  # sglang/srt/utils/auth.py:78-150
        path = request.url.path
        if path.startswith(("/health", "/ready", "/metrics")):
            return await call_next(request)
        header = request.headers.get("Authorization", "")
        scheme, _, value = header.partition(" ")

        def ok(key: str) -> bool:
            return scheme.lower() == "bearer" and secrets.compare_digest(value, key)

        if path in admin_routes:
            allowed = ok(admin_api_key) if admin_api_key else (ok(api_key) if api_key else True)
        else:
            allowed = ok(api_key) if api_key else True
        if not allowed:
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    def ready() -> Response:
        return Response(status_code=503 if tm.is_pause else 200)

    @app.get("/model_info")
    def model_info() -> dict[str, Any]:
        return {"model_path": tm.model_path, "served_model_name": tm.model_path, "tokenizer_path": None,
                "is_generation": True, "weight_version": tm.weight_version, "load_format": "auto",
                "model_type": "llama", "architectures": ["LlamaForCausalLM"]}

    @app.post("/pause_generation")
    def pause_generation(obj: PauseGenerationReqInput) -> dict[str, str]:
        with tm.pause_cond:
            tm.is_pause = True
        if obj.mode == "abort":  # tokenizer_manager.py:2271-2280
            while True:
                tm.sched.abort_all()
                if not tm.update_lock.is_locked():
                    break
                time.sleep(0.05)
        else:
            tm.sched.pause(obj.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    def continue_generation(obj: ContinueGenerationReqInput | None = Body(None)) -> dict[str, str]:  # noqa: B008
        with tm.pause_cond:
            tm.is_pause = False
            tm.sched.resume()
            tm.pause_cond.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput) -> JSONResponse:
        if obj.abort_all_requests:
            tm.sched.abort_all()
        with tm.pause_cond:
            paused = tm.is_pause
        lock = contextlib.nullcontext() if paused else tm.update_lock.writer()
        with lock:
            success, message = tm.sched.update_weights_from_disk(obj)
            if success:  # tokenizer_manager.py:2389-2392, 2316-2320
                tm.model_path = obj.model_path
                if obj.weight_version is not None:
                    tm.weight_version = obj.weight_version
                    message += f" Weight version updated to {obj.weight_version}."
        body = {"success": success, "message": message, "num_paused_requests": 0}
        return JSONResponse(body, status_code=200 if success else 400)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache(timeout: float = Query(0.0, ge=0.0)) -> Response:  # noqa: B008
        success, message = tm.sched.flush(timeout)
        if success:
            text = ("Cache flushed.\nPlease check backend logs for more details. "
                    "(When there are running or waiting requests, the operation will not be performed.)\n")
            return Response(text, status_code=200)
        return Response(message or "Flush cache failed.\n", status_code=400)

    @app.post("/update_weight_version")
    def update_weight_version(obj: UpdateWeightVersionReqInput) -> dict[str, Any]:
        if obj.abort_all_requests:
            tm.sched.abort_all()
        with tm.sched.mu:
            tm.sched.weight_version = obj.new_version
        tm.weight_version = obj.new_version
        return {"success": True, "message": f"Weight version updated to {obj.new_version}",
                "new_version": obj.new_version}

    @app.post("/load_lora_adapter")
    def load_lora_adapter(obj: LoadLoRAAdapterReqInput) -> JSONResponse:
        def reply(ok: bool, error: str | None = None) -> JSONResponse:
            loaded = {n: p for n, (_i, p) in tm.loras.items()}
            return JSONResponse({"success": ok, "error_message": error, "loaded_adapters": loaded},
                                status_code=200 if ok else 400)

        if not tm.enable_lora:
            return reply(False, LORA_DISABLED)
        try:
            weights = tm.sched.read_lora(obj.lora_path)
        except Exception as exc:  # noqa: BLE001 - the backend's load failure
            return reply(False, f"Failed to load LoRA adapter {obj.lora_name}: {exc}")
        with tm.lora_cond:
            if obj.lora_name in tm.loras:
                return reply(False, f"LoRA with name {obj.lora_name} already exists. Loaded LoRAs: {tm.loras.keys()}")
            lora_id = secrets.token_hex(8)
            with tm.sched.mu:
                tm.sched.loras[lora_id] = weights
            tm.loras[obj.lora_name] = (lora_id, obj.lora_path)
        return reply(True)

    @app.post("/unload_lora_adapter")
    def unload_lora_adapter(obj: UnloadLoRAAdapterReqInput) -> JSONResponse:
        with tm.lora_cond:
            if not tm.enable_lora or obj.lora_name not in tm.loras:
                why = LORA_DISABLED if not tm.enable_lora else \
                    f"LoRA with name {obj.lora_name} does not exist. Loaded LoRAs: {tm.loras.keys()}"
                return JSONResponse({"success": False, "error_message": why, "loaded_adapters": None}, status_code=400)
            lora_id, _ = tm.loras.pop(obj.lora_name)  # new requests cannot take it from now on
            tm.lora_cond.wait_for(lambda: tm.lora_users.get(lora_id, 0) == 0)  # wait_for_unload
        with tm.sched.mu:
            tm.sched.loras.pop(lora_id, None)
        return JSONResponse({"success": True, "error_message": None,
                             "loaded_adapters": {n: p for n, (_i, p) in tm.loras.items()}})

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        cards = [{"id": tm.model_path, "object": "model", "root": tm.model_path, "parent": None}]
        cards += [{"id": n, "object": "model", "root": p, "parent": tm.model_path} for n, (_i, p) in tm.loras.items()]
        return {"object": "list", "data": cards}

    @app.get("/metrics")
    def metrics() -> Response:  # as SGLang's --enable-metrics gauge: requests the server holds now
        with tm.generating_lock:
            n = tm.generating
        with tm.pause_cond:  # the stand-in's own line: a test's positive signal that a request waits
            held = tm.held_by_pause
        return Response(f"sglang:num_running_reqs {n}\nstandin:held_by_pause {held}\n", media_type="text/plain")

    @app.api_route("/generate", methods=["POST", "PUT"])
    def generate(obj: GenerateReqInput) -> JSONResponse:
        sp = obj.sampling_params or {}
        r = Req(rid=obj.rid or secrets.token_hex(8), input_ids=list(obj.input_ids),
                max_new_tokens=int(sp.get("max_new_tokens", 128)), ignore_eos=bool(sp.get("ignore_eos", False)))
        with tm.pause_cond:  # tokenizer_manager.py:938-939: wait while paused
            tm.held_by_pause += 1
            tm.pause_cond.notify_all()
            tm.pause_cond.wait_for(lambda: not tm.is_pause)
            tm.held_by_pause -= 1
        if obj.lora_path is not None:
            with tm.lora_cond:  # LoRARegistry.acquire
                ref = tm.loras.get(obj.lora_path)
                if ref is None:
                    message = (f"The following requested LoRA adapters are not loaded: {obj.lora_path}\n"
                               f"Loaded adapters: {tm.loras.keys()}.")
                    return JSONResponse({"error": {"message": message}}, status_code=400)
                r.lora_id = ref[0]
                tm.lora_users[r.lora_id] = tm.lora_users.get(r.lora_id, 0) + 1
        try:
            with tm.update_lock.reader():
                with tm.generating_lock:
                    tm.generating += 1
                try:
                    tm.sched.submit(r)
                    r.done.wait()
                finally:
                    with tm.generating_lock:
                        tm.generating -= 1
        finally:
            if r.lora_id is not None:
                with tm.lora_cond:
                    tm.lora_users[r.lora_id] -= 1
                    tm.lora_cond.notify_all()
        with tm.sched.mu:
            version = tm.sched.weight_version
        meta = {"id": r.rid, "finish_reason": r.finish_reason, "prompt_tokens": len(r.input_ids),
                "completion_tokens": len(r.output_ids), "weight_version": version,
                "num_retractions": r.retractions}
        return JSONResponse({"text": "", "output_ids": r.output_ids, "meta_info": meta})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--api-key")
    ap.add_argument("--admin-api-key")
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--step-delay-s", type=float, default=0.0, help="sleep between decode steps (tests)")
    ap.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (load/unload at runtime)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    sched = Scheduler(args.model, args.weight_version, args.step_delay_s)
    tm = TokenizerManager(sched, str(args.model), args.weight_version)
    tm.enable_lora = args.enable_lora
    uvicorn.run(build_app(tm, args.api_key, args.admin_api_key), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
