"""Engine kinds in the config and the engine clients' table: accepted keys, refused ones, one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon import engines
from daemon.config import ConfigError, parse_config
from daemon.engines import sglang, vllm, vllm_api
from daemon.engines.base import Timeouts, UpdateRefused, UpdateRequest

pytestmark = pytest.mark.quick


def worker(**kw: object) -> dict[str, object]:
    return {"workers": [{"name": "e0", "url": "http://127.0.0.1:8001", **kw}], "rollout": {"mode": "pause"}}


def test_engine_tables_match_the_engine_clients() -> None:
    assert set(engines.ENGINE_PAUSE_MODES["vllm"]) == set(vllm_api.PAUSE_MODES)
    assert engines.ENGINE_PAUSE_MODES["sglang"] == sglang.PAUSE_MODES
    assert set(engines.ENGINE_KEYS) | {"builtin"} == set(engines.WORKER_KINDS)
    assert vllm.TESTED_VERSIONS == ("0.32.0",) and sglang.TESTED_VERSIONS == ("0.5.23",)


def test_vllm_and_sglang_kinds_are_accepted_with_their_keys(tmp_path: Path) -> None:
    cfg = parse_config(worker(kind="vllm", pause_mode="abort", restart_command="systemctl restart vllm"), "t")
    (spec,) = cfg.workers
    assert (spec.kind, spec.engine_options()) == ("vllm", {"pause_mode": "abort"})
    key = tmp_path / "admin.key"
    key.write_text("k\n")
    cfg = parse_config(worker(kind="sglang", admin_token_file=str(key)), "t")
    client = engines.make_client("sglang", "e0", "http://127.0.0.1:9", token_file=None, timeouts=Timeouts(),
                                  options=cfg.workers[0].engine_options())  # fmt: skip
    assert isinstance(client, sglang.SGLangWorkerClient) and client.api.admin_key == "k"
    assert client.pause_mode == "retract"
    client.close()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"kind": "vllm", "pause_mode": "retract"}, "workers[0].pause_mode: 'retract' is not a vllm pause mode (keep, wait, abort)"),
        ({"kind": "sglang", "pause_mode": "in_place"}, "workers[0].pause_mode: 'in_place' is not a sglang pause mode"),
        ({"kind": "vllm", "admin_token_file": "/k"}, "workers[0].admin_token_file: not a setting of kind 'vllm'"),
        ({"kind": "builtin", "pause_mode": "keep"}, "workers[0].pause_mode: not a setting of kind 'builtin'"),
        ({"kind": "tgi"}, "workers[0].kind: 'tgi' has no adapter"),
    ],
)
def test_bad_engine_settings_are_refused_in_one_line(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(worker(**kw), "t")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_updates_an_engine_cannot_take_are_refused_before_any_call(tmp_path: Path) -> None:
    # Port 9 (discard) answers nothing: a refusal here proves no engine call was needed.
    c = vllm.VLLMWorkerClient("e0", "http://127.0.0.1:9", timeouts=Timeouts(1, 1, 1))
    for req, why in [
        (UpdateRequest("v1", "broadcast", {"session": "x"}), "takes the disk and ipc transports, not 'broadcast'"),
        (UpdateRequest("v1", "ipc", {"descriptor": "x"}), "names no checkpoint directory"),  # its disk fallback
        (UpdateRequest("v1", "disk", {"path": str(tmp_path)}, mode="swap"), "no swap mode"),
        (UpdateRequest("v1", "disk", {}), "names no checkpoint directory"),
        (UpdateRequest("v1", "disk", {"path": str(tmp_path / "gone")}), "is not a directory"),
    ]:
        with pytest.raises(UpdateRefused, match=why):
            c.update(req)
    with pytest.raises(ValueError, match="pause_mode"):
        vllm.VLLMWorkerClient("e0", "http://127.0.0.1:9", pause_mode="retract")
    c.close()
