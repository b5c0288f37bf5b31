"""Thin client for the SGLang routes hotswap drives: one method per route, nothing decided here.

Written against SGLang 0.5.23, read from its released wheel (`sglang==0.5.23`, never installed
here: tests/engines/test_engine_routes.py parses `sglang/srt/entrypoints/http_server.py` and
`sglang/srt/managers/io_struct.py` out of it) and exercised against the stand-in server in
tests/support_sglang.py, which implements these semantics. Paths below are inside the wheel.

Auth (sglang/srt/utils/auth.py:78-150). Every weight/cache/pause route here is ADMIN_OPTIONAL:
no key configured -> open; only --api-key -> that key; --admin-api-key set -> only the admin key,
the api key is refused (401).
/generate and /model_info are NORMAL: the api key when one is set, else open. /health*, /ready*,
/metrics* are always open. So the client holds both keys and sends the admin key (falling back
to the api key) to the admin routes and the api key to the others.

What each route does:

`POST /pause_generation {"mode": "abort"|"retract"|"in_place"}` -> `{"message", "status": "ok"}`
    (http_server.py:1831-1841; tokenizer_manager.py:2267-2280; scheduler.py:5817-5932). From then on
    new /generate requests WAIT in the tokenizer manager (not refused) until continue
    (tokenizer_manager.py:938-939), and GET /ready answers 503 (tokenizer_manager.py:732-734).
    - abort: aborts every request, returns once none holds the model-update lock.
    - retract: running requests go back to the waiting queue, their KV freed; they are
      recomputed after continue (under the new weights). A cache flush works in this mode
      (the scheduler ignores the waiting queue while paused: scheduler.py:5518-5519).
    - in_place: the scheduler just stops; requests keep their KV. A flush FAILS while any
      request is in the running batch (io_struct.py:1927-1946).
`POST /continue_generation {"torch_empty_cache": true}` -> `{"message", "status": "ok"}`
    (http_server.py:1844-1855).
`POST /update_weights_from_disk {model_path, load_format?, weight_version?, flush_cache=true,
    abort_all_requests=false, keep_pause=false, ...}` -> `{"success", "message",
    "num_paused_requests"}`, HTTP 200 on success and 400 otherwise (http_server.py:1300-1326;
    io_struct.py:1970-1999). Not paused: it takes the model-update writer lock, i.e. waits for
    every in-flight request to finish and holds new ones back (tokenizer_manager.py:2303-2314).
    Paused: it loads at once. Faults the adapter must handle:
    - With flush_cache and requests still running or queued (in_place pause), the reply is
      success=false "Weights were updated, but the cache was not flushed because requests are
      still running or queued..." (scheduler_components/weight_updater.py:120-136): the NEW
      weights ARE loaded. The scheduler recorded the new version, but the tokenizer manager,
      which answers /model_info, did not (it records weight_version and model_path only on
      success: tokenizer_manager.py:2316-2320, 2389-2392): /model_info still shows the OLD
      version and path over new weights. Flush, then set the version with /update_weight_version.
    - A load that raises part way "rolls back" by reloading from model_config.model_path, which
      was already set to the NEW path (model_runner_components/weight_updater.py:192, 226-236):
      the rollback reloads the new checkpoint (or fails again). Re-install the previous path
      yourself; never trust its rollback.
`POST /flush_cache?timeout=S` (GET also accepted) -> text, 200 "Cache flushed..." or 400 with the
    reason (http_server.py:1025-1040); refused while requests are running or queued (unless
    paused, when only running ones count: scheduler.py:5518-5547); timeout>0 waits up to S
    seconds for the scheduler to go idle (scheduler_components/flush_wrapper.py:22-60).
`POST /update_weight_version {"new_version", "abort_all_requests"=true}` -> `{"success",
    "message", "new_version"}` (http_server.py:1527-1556; io_struct.py:2155-2159). Its default
    ABORTS all requests: hotswap always sends abort_all_requests=false.
`GET /model_info` -> `{"model_path", "weight_version", ...}` (http_server.py:812-850). The old
    `/get_weight_version` route is gone in 0.5.23.
`GET /ready` -> 200 or 503 (http_server.py:714-718): 503 while paused, starting or unhealthy.
`GET /health` -> 200, 503 while starting or shutting down (http_server.py:721-800).
LoRA adapters (the server started with `--enable-lora`; tokenizer_control_mixin.py:634-860,
    lora/lora_registry.py): `POST /load_lora_adapter {"lora_name", "lora_path"}` -> `{"success",
    "error_message", "loaded_adapters"}`, 200 or 400 (http_server.py:1652-1660). A name already
    loaded is refused ("LoRA with name X already exists"): there is no in-place replacement.
    `POST /unload_lora_adapter {"lora_name"}` unregisters the name at once (new requests naming
    it fail: "not loaded"), waits for the requests already using it to finish, then frees it.
    So a new version of a served name is unload, then load: requests that name it between the
    two are refused by SGLang. `GET /v1/models` lists each adapter as a card with `parent` (the
    base) and `root` (its path); `/generate` takes `"lora_path": NAME` to run with one.
Greedy probe: `POST /generate {"input_ids": [...], "sampling_params": {"max_new_tokens": n,
    "temperature": 0, "ignore_eos": true}}` -> `{"output_ids": [...], "meta_info":
    {"weight_version", ...}}` (http_server.py:928-941; tokenizer_manager.py:2505-2512, 2664-2668).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from daemon.engines.engine_http import EngineHTTP, RouteUse

ENGINE = "SGLang"
TESTED_VERSIONS = ("0.5.23",)
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "retract", "in_place")
# The start of the message of an update whose weights were loaded but whose cache was not flushed.
NOT_FLUSHED_PREFIX = "Weights were updated, but the cache was not flushed"

ROUTES_USED: dict[tuple[str, str], RouteUse] = {
    ("GET", "/health"): RouteUse(),
    ("GET", "/ready"): RouteUse(),
    ("GET", "/model_info"): RouteUse(),
    ("POST", "/pause_generation"): RouteUse(body=("mode",)),
    ("POST", "/continue_generation"): RouteUse(body=()),
    ("POST", "/update_weights_from_disk"): RouteUse(
        body=("model_path", "weight_version", "flush_cache", "abort_all_requests", "keep_pause")
    ),
    ("POST", "/flush_cache"): RouteUse(query=("timeout",)),
    ("POST", "/update_weight_version"): RouteUse(body=("new_version", "abort_all_requests")),
    ("POST", "/generate"): RouteUse(body=("input_ids", "sampling_params", "lora_path")),
    ("POST", "/load_lora_adapter"): RouteUse(body=("lora_name", "lora_path")),
    ("POST", "/unload_lora_adapter"): RouteUse(body=("lora_name",)),
    ("GET", "/v1/models"): RouteUse(),
}
SAMPLING_PARAMS_USED = ("max_new_tokens", "temperature", "ignore_eos")
# Routes SGLang marks @auth_level(AuthLevel.ADMIN_OPTIONAL): they get the admin key when one is
# configured (the api key is refused there then); the others get the api key.
ADMIN_ROUTES = frozenset(
    {"/pause_generation", "/continue_generation", "/update_weights_from_disk", "/flush_cache", "/update_weight_version",
     "/load_lora_adapter", "/unload_lora_adapter"}
)


@dataclass(slots=True, frozen=True)
class Timeouts:
    call_s: float = 10.0
    pause_s: float = 120.0  # abort mode waits for aborted requests to leave
    update_s: float = 600.0  # unpaused, the update first waits for in-flight requests
    probe_s: float = 60.0


@dataclass(slots=True, frozen=True)
class DiskUpdateReply:
    success: bool
    message: str
    num_paused_requests: int
    status: int
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def loaded_but_not_flushed(self) -> bool:
        """success=false, yet the new weights ARE loaded (and /model_info still shows the old version)."""
        return not self.success and self.message.startswith(NOT_FLUSHED_PREFIX)


class SGLangAPI:
    def __init__(
        self,
        name: str,
        url: str,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeouts: Timeouts | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.timeouts = timeouts or Timeouts()
        self.admin_key = admin_api_key or api_key
        self.http = EngineHTTP(ENGINE, name, url, token=api_key, timeout_s=self.timeouts.call_s, transport=transport)

    def _token(self, route: str) -> str | None:
        return self.admin_key if route in ADMIN_ROUTES else self.http.token

    def _request(self, method: str, route: str, **kw: Any) -> httpx.Response:
        return self.http.request(method, route, token=self._token(route), **kw)

    def _object(self, method: str, route: str, **kw: Any) -> dict[str, Any]:
        return self.http.json_object(method, route, token=self._token(route), **kw)

    # -- state --------------------------------------------------------------------------------
    def health(self) -> bool:
        try:
            return self._request("GET", "/health", ok=(200, 503)).status_code == 200
        except Exception:  # noqa: BLE001 - unreachable means not healthy
            return False

    def ready(self) -> bool:
        """GET /ready: False while paused, starting or unhealthy (and when unreachable)."""
        try:
            return self._request("GET", "/ready", ok=(200, 503)).status_code == 200
        except Exception:  # noqa: BLE001
            return False

    def model_info(self) -> dict[str, Any]:
        return self._object("GET", "/model_info")

    def weight_version(self) -> str | None:
        v = self.model_info().get("weight_version")
        return None if v is None else str(v)

    # -- pause --------------------------------------------------------------------------------
    def pause_generation(self, mode: PauseMode) -> None:
        doc = self._object("POST", "/pause_generation", json={"mode": mode}, timeout_s=self.timeouts.pause_s)
        if doc.get("status") != "ok":
            raise self.http.error(f"POST /pause_generation {mode}", "unexpected reply", reply=str(doc))

    def continue_generation(self) -> None:
        doc = self._object("POST", "/continue_generation", json={})
        if doc.get("status") != "ok":
            raise self.http.error("POST /continue_generation", "unexpected reply", reply=str(doc))

    # -- weights ------------------------------------------------------------------------------
    def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None, flush_cache: bool = True, keep_pause: bool = False
    ) -> DiskUpdateReply:
        """The engine's reply, success or not (HTTP 200 or 400); only other statuses raise."""
        body: dict[str, Any] = {
            "model_path": model_path,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
            "keep_pause": keep_pause,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        resp = self._request(
            "POST", "/update_weights_from_disk", json=body, timeout_s=self.timeouts.update_s, ok=(200, 400)
        )
        try:
            doc = resp.json()
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("success"), bool):
            raise self.http.error(
                "POST /update_weights_from_disk", f"HTTP {resp.status_code} without a success flag", reply=resp.text
            )
        paused = doc.get("num_paused_requests", 0)
        return DiskUpdateReply(
            success=doc["success"],
            message=str(doc.get("message", "")),
            num_paused_requests=paused if isinstance(paused, int) else 0,
            status=resp.status_code,
            raw=doc,
        )

    def flush_cache(self, *, timeout_s: float = 0.0) -> tuple[bool, str]:
        """(flushed, the engine's text). SGLang answers 400 while requests are running or queued."""
        resp = self._request(
            "POST", "/flush_cache", params={"timeout": timeout_s}, timeout_s=timeout_s + self.timeouts.call_s,
            ok=(200, 400),
        )
        return resp.status_code == 200, resp.text.strip()

    def update_weight_version(self, version: str) -> None:
        resp = self._request(
            "POST", "/update_weight_version", json={"new_version": version, "abort_all_requests": False},
            ok=(200, 400),
        )
        try:
            doc = resp.json()
        except ValueError:
            doc = None
        if resp.status_code != 200 or not isinstance(doc, dict) or doc.get("success") is not True:
            raise self.http.error("POST /update_weight_version", f"HTTP {resp.status_code}", reply=resp.text)

    # -- LoRA adapters ----------------------------------------------------------------------------
    def _lora_call(self, route: str, body: dict[str, Any]) -> None:
        resp = self._request("POST", route, json=body, timeout_s=self.timeouts.update_s, ok=(200, 400))
        try:
            doc = resp.json()
        except ValueError:
            doc = None
        if resp.status_code != 200 or not isinstance(doc, dict) or doc.get("success") is not True:
            why = doc.get("error_message") if isinstance(doc, dict) else None
            raise self.http.error(f"POST {route}", f"HTTP {resp.status_code}", status=resp.status_code,
                                  reply=str(why or resp.text))  # fmt: skip

    def load_lora_adapter(self, name: str, path: str) -> None:
        self._lora_call("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_lora_adapter(self, name: str) -> None:
        """Returns once the requests already using it finished (SGLang waits for them)."""
        self._lora_call("/unload_lora_adapter", {"lora_name": name})

    def lora_adapters(self) -> dict[str, str]:
        """Adapter name -> the path it was loaded from, as /v1/models lists them."""
        data = self._object("GET", "/v1/models").get("data")
        cards = data if isinstance(data, list) else []
        return {str(c["id"]): str(c.get("root") or "") for c in cards if isinstance(c, dict) and c.get("parent")}

    # -- serving ------------------------------------------------------------------------------
    def greedy(self, input_ids: list[int], max_new_tokens: int, *, lora: str | None = None) -> tuple[list[int], str | None]:
        """(output token ids, meta_info.weight_version) of a deterministic generation (with the
        LoRA adapter named `lora`, when given)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        }
        if lora is not None:
            body["lora_path"] = lora
        doc = self._object("POST", "/generate", json=body, timeout_s=self.timeouts.probe_s)
        ids = doc.get("output_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise self.http.error("POST /generate", "no output_ids list", reply=str(doc))
        meta = doc.get("meta_info")
        version = meta.get("weight_version") if isinstance(meta, dict) else None
        return ids, None if version is None else str(version)

    def close(self) -> None:
        self.http.close()
