"""`WorkerClient` for an SGLang server (`kind = "sglang"`), written against SGLang 0.5.23.

daemon.engines.sglang_api has every route's semantics as read in the 0.5.23 wheel; the tests
drive this client against tests/sglang_standin.py, which implements them. Keys: `token_file` is
SGLang's `--api-key` (generation, /model_info), `admin_token_file` its `--admin-api-key` (the
weight, cache and pause routes take only the admin key when one is set).

One update, as the rollout engine drives it:

    pause     rollout mode "pause": POST /pause_generation {mode: <pause_mode>}: retract by
              default (running requests go back to the queue and are recomputed under the new
              weights after continue; the cache can be flushed), or abort. in_place is refused:
              a flush fails while its requests hold the running batch.
              rollout mode "drain": the daemon's readiness route answers 503; the update then
              runs unpaused, and SGLang's own model-update lock waits for requests in flight
              and holds new ones back until the new weights are in.
    update    label "hotswap-partial:V" (when paused), POST /update_weights_from_disk {model_path, weight_version,
              flush_cache: true}. success:false "Weights were updated, but the cache was not
              flushed" means the NEW weights are loaded: /flush_cache?timeout= until it
              succeeds, then /update_weight_version V (its tokenizer manager did not record V).
              Any other failure leaves an unknown state: SGLang's own "rollback" reloads the new
              path, so the rollout engine re-installs the previous directory itself.
    check     GET /model_info shows V; continue_generation (a paused SGLang holds /generate),
              then a greedy probe whose meta_info.weight_version must be V and whose tokens
              must equal those recorded when V first passed this check.

Cannot: swap mode, the ipc transport (SGLang's tensor route takes pickled CUDA handles).
"""

from __future__ import annotations

import time
from typing import Any

from daemon.common import get_logger
from daemon.engines import sglang_api
from daemon.engines.base import (
    AdapterRequest,
    AdapterResult,
    Capabilities,
    PauseMode,
    ServedAdapter,
    Timeouts,
    UpdateRefused,
    UpdateRequest,
    UpdateResult,
    WeightInfo,
    WorkerError,
    WorkerUnreachable,
    cannot_broadcast,
    read_token,
)
from daemon.engines.engine_common import (
    PARTIAL_PREFIX,
    PROBE_ATTEMPTS,
    PROBE_PROMPT,
    PROBE_TOKENS,
    EngineMemory,
    EngineOptions,
    Installed,
    checked_files,
    engine_call,
    engine_died,
    install_path,
    verified_adapter_path,
)
from daemon.engines.engine_http import EngineAPIError, EngineUnreachable
from daemon.engines.sglang_api import SGLangAPI
from daemon.transport import Expect, GroupSpec

log = get_logger(__name__)
TESTED_VERSIONS = sglang_api.TESTED_VERSIONS  # ("0.5.23",)
PAUSE_MODES: tuple[sglang_api.PauseMode, ...] = ("retract", "abort")  # in_place cannot flush
DEFAULT_PAUSE_MODE: sglang_api.PauseMode = "retract"
NOT_LOADED_PREFIX = "Failed to get weights iterator"  # refused before any tensor was read
FLUSH_WAIT_S = 5.0  # one /flush_cache?timeout= call


def connect(
    name: str, url: str, *, token_file: str | None, timeouts: Timeouts, options: dict[str, Any] | None = None
) -> SGLangWorkerClient:
    """The registry's factory (daemon.engines.WORKER_KINDS["sglang"])."""
    opts = EngineOptions.from_mapping(options)
    return SGLangWorkerClient(
        name, url, api_key=read_token(token_file, name), admin_api_key=read_token(opts.admin_token_file, name),
        timeouts=timeouts, pause_mode=opts.pause_mode or DEFAULT_PAUSE_MODE,
    )  # fmt: skip


class SGLangWorkerClient:
    capabilities = Capabilities(
        pause_modes=("keep",),  # "keep" -> pause_generation(<pause_mode>): requests survive the pause
        can_drain=True,  # readiness route + SGLang's model-update lock waits for in-flight requests
        transports=("disk",),
        restores_itself=True,  # re-installs its last checked directory (restore())
        atomic_updates=False,  # a failed load leaves a mix (and SGLang's rollback reloads the new path)
        reports_in_flight=False,
        adapters=True,  # --enable-lora: /load_lora_adapter, /unload_lora_adapter
        adapter_swap_atomic=False,  # no in-place replacement: unload (in-flight ones finish), then load
    )

    def __init__(
        self, name: str, url: str, *, api_key: str | None = None, admin_api_key: str | None = None,
        timeouts: Timeouts | None = None, pause_mode: str = DEFAULT_PAUSE_MODE,
    ) -> None:  # fmt: skip
        t = timeouts or Timeouts()
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"worker {name}: pause_mode: {pause_mode!r} is not one of {', '.join(PAUSE_MODES)}"
                             " (in_place cannot flush the cache)")  # fmt: skip
        self.name = name
        self.url = url
        self.pause_mode: sglang_api.PauseMode = pause_mode  # checked above
        self.flush_timeout_s = max(t.drain_s, FLUSH_WAIT_S)
        self.api = SGLangAPI(name, url, api_key=api_key, admin_api_key=admin_api_key, timeouts=sglang_api.Timeouts(
            call_s=t.request_s, pause_s=t.drain_s + t.request_s, update_s=t.update_s + t.drain_s,
            probe_s=max(t.request_s, 60.0)))  # fmt: skip
        self.memory = EngineMemory(name)
        self._paused = False  # we paused it (SGLang has no is_paused; /ready is 503 then)
        self._draining = False
        self._adapter_versions: dict[tuple[str, str], str] = {}  # (name, path) -> version this client loaded there

    def _call(self, step: str, fn: Any) -> Any:
        return engine_call(self.name, step, fn, alive=self.api.health)

    # -- state ----------------------------------------------------------------------------
    def health(self) -> bool:
        return self.api.health()

    def ready(self) -> bool:
        return not self._draining and not self._paused and self.api.ready()

    def weight_info(self) -> WeightInfo:
        if not self.api.health():
            raise WorkerUnreachable(f"worker {self.name}: weight_info: SGLang at {self.url} is not healthy (/health)")
        info = self._call("weight_info", self.api.model_info)
        label = info.get("weight_version")
        label = None if label is None else str(label)
        if self._paused and self.api.ready():
            self._paused = False  # it answers /ready: not paused any more (restarted)
        if label is not None and not self._paused and isinstance(info.get("model_path"), str):
            self.memory.remember_startup(label, str(info["model_path"]))
        state = "PAUSED" if self._paused else "DRAINING" if self._draining else "RUNNING"
        return WeightInfo(version=label, digest=self.memory.digest_of(label), state=state,
                          extra={"engine": "sglang", "model_path": info.get("model_path"),
                                 "pause_mode": self.pause_mode, **self.counters()})  # fmt: skip

    def counters(self) -> dict[str, int]:
        # The routes used here expose no served/failed request counts (SGLang's Prometheus
        # metrics need --enable-metrics and count no server errors), so the health window
        # judges an SGLang worker by the daemon's own probes alone.
        return {"requests_total": 0, "requests_failed": 0}

    # -- leaving RUNNING and coming back --------------------------------------------------
    def drain(self, timeout_s: float) -> None:
        """Readiness off; the unpaused update itself waits for requests in flight (SGLang's lock)."""
        self._draining = True

    def pause(self, mode: PauseMode = "keep") -> None:
        self._call("pause", lambda: self.api.pause_generation(self.pause_mode))
        self._paused = True

    def resume(self) -> None:
        self._call("resume", self.api.continue_generation)
        self._paused = self._draining = False

    # -- weights --------------------------------------------------------------------------
    def prepare(self, request: UpdateRequest) -> None:
        """While it still serves: hash the files SGLang will load against the verified digests
        (daemon.engines.engine_files), so the update itself only stats them."""
        checked_files(request, self.name, install_path(request, self.name, "SGLang"))

    def update(self, request: UpdateRequest) -> UpdateResult:
        path = install_path(request, self.name, "SGLang")
        version, digest = request.version, request.expect.digest
        t0 = time.perf_counter()
        checked_files(request, self.name, path)  # hashed in prepare (else now); here a stat per file
        if self._paused:
            # Unpaused (drain mode) the label would also land on the requests still finishing
            # under the old weights (SGLang applies it at once); then the daemon's own record of
            # the failed step is what marks the worker UNCERTAIN.
            try:
                self._call("update: mark partial", lambda: self.api.update_weight_version(PARTIAL_PREFIX + version))
            except WorkerError as exc:
                raise UpdateRefused(f"{exc} (nothing was loaded)") from None
        self.memory.pending = None
        reply = self._call("update: update_weights_from_disk",
                           lambda: self.api.update_weights_from_disk(path, weight_version=version, flush_cache=True))
        flushes = 0
        if not reply.success:
            if reply.message.startswith(NOT_LOADED_PREFIX):
                self._relabel_previous()
                raise UpdateRefused(f"worker {self.name}: update: SGLang refused {path}: {reply.message}")
            if not reply.loaded_but_not_flushed:
                raise WorkerError(f"worker {self.name}: update: SGLang failed to load {path} (HTTP {reply.status}): "
                                  f"{reply.message[:300]}")  # fmt: skip
            # The new weights ARE loaded, over a stale cache, and /model_info still names the old version.
            if self._paused or not self.api.ready():
                # Paused in place (by someone else): its requests hold the running batch, so no
                # flush can succeed. Retracting them frees their KV; they recompute under the new weights.
                self._call("update: pause_generation retract", lambda: self.api.pause_generation("retract"))
                self._paused = True
            flushes = self._flush_until_done()
        self._call("update: update_weight_version", lambda: self.api.update_weight_version(version))
        self.memory.pending = Installed(version, digest, path)
        ms = (time.perf_counter() - t0) * 1000.0
        log.info("sglang_updated", worker=self.name, version=version, path=path, ms=round(ms, 1),
                 not_flushed_first=not reply.success, flushes=flushes)  # fmt: skip
        return UpdateResult(version, ms, {"path": path, "loaded_but_not_flushed": not reply.success,
                                          "flush_attempts": flushes})  # fmt: skip

    def _flush_until_done(self) -> int:
        deadline = time.monotonic() + self.flush_timeout_s
        attempts = 0
        while True:
            attempts += 1
            ok, text = self._call("update: flush_cache", lambda: self.api.flush_cache(timeout_s=FLUSH_WAIT_S))
            if ok:
                return attempts
            if time.monotonic() >= deadline:
                raise WorkerError(f"worker {self.name}: update: new weights loaded but the cache could not be "
                                  f"flushed in {self.flush_timeout_s:g} s ({attempts} attempts): {text[:200]}")  # fmt: skip
            time.sleep(0.1)

    def _relabel_previous(self) -> None:
        # Nothing was read, so the weights are still the last checked install's: say so again.
        last = self.memory.last_good()
        if last is not None:
            try:
                self.api.update_weight_version(last.version)
            except Exception:  # noqa: BLE001 - the refusal is what the caller reports
                log.warning("sglang_relabel_failed", worker=self.name, version=last.version)

    def rollback(self, request: UpdateRequest) -> UpdateResult:
        """An earlier version by path, never SGLang's own rollback (it reloads the new path)."""
        return self.update(request)

    def restore(self) -> UpdateResult:
        last = self.memory.last_good()
        if last is None:
            raise WorkerError(f"worker {self.name}: rollback: no directory known to have served good weights")
        return self.update(UpdateRequest(last.version, "disk", {"path": last.path}, expect=Expect(digest=last.digest)))

    def init_weight_group(self, spec: GroupSpec, timeout_s: float) -> None:
        raise cannot_broadcast(self.name, "SGLang")

    def probe(self) -> str:
        """Continue (a paused SGLang holds /generate), then a greedy generation: its
        meta_info.weight_version is the answer, its tokens are compared with the record."""
        if self._paused:
            self.resume()
        self._draining = False
        label = self._call("probe", self.api.weight_version)
        digest = self.memory.digest_of(label)
        attempts: list[list[int]] = []
        served: str | None = None
        for i in range(PROBE_ATTEMPTS):
            ids, served = self._call("probe", lambda: self.api.greedy(list(PROBE_PROMPT), PROBE_TOKENS))
            attempts.append(ids)
            if served != label:
                raise WorkerError(f"worker {self.name}: probe: generation reports version {served!r}, "
                                  f"/model_info {label!r}")  # fmt: skip
            try:
                self.memory.check_probe(str(label), digest, attempts[-1:])
                break
            except WorkerError:
                if i + 1 == PROBE_ATTEMPTS:
                    raise
        self.memory.confirm(str(label), digest, attempts[-1])
        return str(served)

    # -- LoRA adapters (ServesAdapters) ------------------------------------------------------
    def load_adapter(self, request: AdapterRequest) -> AdapterResult:
        """Only verified bytes (daemon.engines.engine_files); a served name is unloaded first
        (SGLang lets its requests in flight finish), then the new version is loaded."""
        t0 = time.perf_counter()
        path = verified_adapter_path(request, self.name)
        if request.name in self._call("load adapter", self.api.lora_adapters):
            self._call("load adapter: unload the served version", lambda: self.api.unload_lora_adapter(request.name))
            unloaded = True
        else:
            unloaded = False
        try:
            self.api.load_lora_adapter(request.name, path)
        except EngineUnreachable as exc:
            raise WorkerUnreachable(f"worker {self.name}: load adapter: {exc}") from None
        except EngineAPIError as exc:
            if engine_died(exc, self.api.health):
                raise WorkerUnreachable(f"worker {self.name}: load adapter: the engine died: {exc}") from None
            what = f"worker {self.name}: load adapter {request.name} {request.version}: {exc}"
            if unloaded:  # the name serves nothing now: the rollout puts the previous version back
                raise WorkerError(what + " (the previous version was unloaded)") from None
            raise UpdateRefused(what) from None
        self._adapter_versions[(request.name, path)] = request.version
        ms = (time.perf_counter() - t0) * 1000.0
        log.info("sglang_adapter_loaded", worker=self.name, adapter=request.name, version=request.version, ms=round(ms, 1))
        return AdapterResult(request.name, request.version, ms, None, {"path": path, "unloaded_first": unloaded})

    def unload_adapter(self, name: str) -> None:
        self._call("unload adapter", lambda: self.api.unload_lora_adapter(name))

    def adapters(self) -> dict[str, ServedAdapter]:
        served = self._call("adapters", self.api.lora_adapters)
        return {n: ServedAdapter(n, self._adapter_versions.get((n, p)), p) for n, p in served.items()}

    def adapter_probe(self, name: str) -> tuple[str | None, list[int]]:
        ids, _ = self._call("adapter probe", lambda: self.api.greedy(list(PROBE_PROMPT), PROBE_TOKENS, lora=name))
        path = self._call("adapter probe", self.api.lora_adapters).get(name)
        return (self._adapter_versions.get((name, path)) if path else None), ids

    def adapter_counters(self, name: str) -> dict[str, int] | None:
        return None  # no per-adapter failure counts on these routes: the health window probes it

    def close(self) -> None:
        self.api.close()
