"""The SGLang engine client (daemon/engines/sglang.py) against the SGLang 0.5.23 stand-in, a real server.

First the client alone (its fault handling, each on a fresh idle stand-in state), then a hotswap
daemon with `kind = "sglang"` rolling checkpoints dropped into its watched folder onto it:
served tokens equal a fresh server's, bad checkpoints rejected while the old tokens keep being
served, requests during the update all succeed, and a shard changed after verify (which once
made SGLang's broken disk rollback kill the server) is refused before SGLang reads it: the worker
resumes on last good, every step in `events`; SGLang SIGKILLed mid-update ends with the worker
back on last good after its restart command. SGLang dying in its own failed "rollback" load is
tested through the client in test_sglang_standin.py.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import DaemonProcess, make_config_file, wait_until
from support_engines import (
    FEW_CHECKS,
    PROMPT,
    corrupt_bytes,
    engine_worker,
    kill_pidfile,
    publish_ckpt,
    restart_command,
)
from support_rollout import rollouts, worker_events, worker_paths
from support_sglang import SGLangStandIn, standin_command
from support_vllm import free_port

from daemon.engines.base import Timeouts, UpdateRefused, UpdateRequest
from daemon.engines.engine_common import PROBE_PROMPT
from daemon.engines.sglang import SGLangWorkerClient
from daemon.engines.sglang_api import SGLangAPI
from daemon.tinymodel import make_tiny_checkpoint

API_KEY, ADMIN_KEY = "sg-user-key", "sg-admin-key"
STEP_DELAY_S = 0.02  # per decode step: long requests are still running when the update comes
pytestmark = pytest.mark.timeout(600)


def tiny(seed: int, **overrides: Any) -> Any:
    return lambda d: make_tiny_checkpoint(d, seed=seed, config_overrides=overrides or None)


def fresh_tokens(model: Path, log: Path) -> tuple[list[int], list[int]]:
    """(PROMPT, probe prompt) greedy tokens of a stand-in started fresh on `model`."""
    with SGLangStandIn.start(model, log) as srv:
        api = SGLangAPI("ref", srv.url)
        return api.greedy(PROMPT, 8)[0], api.greedy(list(PROBE_PROMPT), 8)[0]


class Load:
    """Greedy requests in a loop on a thread; every reply is kept."""

    def __init__(self, url: str, n: int = 40) -> None:
        self.api = SGLangAPI("load", url, api_key=API_KEY)
        self.n = n
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.api.greedy(PROMPT[:12], self.n)
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - counted as a failed request
                self.errors.append(str(exc))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(120)


# --------------------------------------------------------------------------- the client alone


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sg-ckpts")
    out = {"A": make_tiny_checkpoint(root / "A", seed=1), "B": make_tiny_checkpoint(root / "B", seed=2)}
    empty = root / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((out["B"] / "config.json").read_text())
    out["empty"] = empty
    return out


@pytest.fixture(scope="module")
def fresh(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[int], list[int]]]:
    logs = tmp_path_factory.mktemp("sg-fresh")
    return {k: fresh_tokens(ckpts[k], logs / f"{k}.log") for k in ("A", "B")}


@pytest.fixture
def client_srv(ckpts: dict[str, Path], tmp_path: Path) -> Iterator[tuple[SGLangStandIn, SGLangWorkerClient]]:
    with SGLangStandIn.start(ckpts["A"], tmp_path / "sglang.log", api_key=API_KEY, admin_api_key=ADMIN_KEY,
                             step_delay_s=STEP_DELAY_S) as srv:  # fmt: skip
        client = SGLangWorkerClient("s0", srv.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeouts=Timeouts(10, 120, 30))
        yield srv, client
        client.close()


def disk(version: str, path: Path) -> UpdateRequest:
    return UpdateRequest(version, "disk", {"path": str(path)})


def test_updated_but_not_flushed_means_loaded_the_client_flushes_and_labels(
    client_srv: tuple[SGLangStandIn, SGLangWorkerClient], ckpts: dict[str, Path], fresh: dict[str, Any]
) -> None:
    """Someone paused in_place with a request running: SGLang loads B, refuses the flush and answers
    success=false. The client retracts, flushes (refused at first: a request is in flight), labels."""
    srv, client = client_srv
    raw = SGLangAPI("raw", srv.url, api_key=API_KEY, admin_api_key=ADMIN_KEY)
    assert client.probe() == "default"  # records A's probe tokens under "default"
    raw.greedy(PROMPT, 8)  # PROMPT's KV under A is cached
    done: list[Any] = []
    bg = threading.Thread(target=lambda: done.append(raw.greedy(PROMPT[:10], 120)), daemon=True)
    bg.start()
    wait_until(lambda: running(srv) >= 1, 60, 0.02, "the request in flight")
    raw.pause_generation("in_place")
    assert raw.flush_cache() == (False, "Flush cache failed.")  # flush refused with a request in flight
    result = client.update(disk("B-1", ckpts["B"]))
    assert result.version == "B-1" and result.detail["loaded_but_not_flushed"] is True
    assert result.detail["flush_attempts"] >= 1
    assert client.weight_info().version == "B-1"  # /model_info relabelled (SGLang had kept "default")
    assert client.probe() == "B-1"  # continues generation first
    bg.join(120)
    assert done, "the request paused in place never finished"
    assert raw.greedy(PROMPT, 8) == (fresh["B"][0], "B-1")  # the stale KV of A is gone


def test_failed_load_is_never_left_to_sglangs_rollback_restore_reinstalls_the_previous_path(
    client_srv: tuple[SGLangStandIn, SGLangWorkerClient], ckpts: dict[str, Path], fresh: dict[str, Any]
) -> None:
    srv, client = client_srv
    raw = SGLangAPI("raw", srv.url, api_key=API_KEY, admin_api_key=ADMIN_KEY)
    client.pause()
    client.update(disk("B-1", ckpts["B"]))
    assert client.probe() == "B-1"
    # No weights in the directory: refused before anything was read; the label goes back.
    with pytest.raises(UpdateRefused, match="Failed to get weights iterator"):
        client.update(disk("bad", ckpts["empty"]))
    assert client.weight_info().version == "B-1"
    assert client.probe() == "B-1"
    # restore(): the last checked directory by path (SGLang's model_path now names the empty one).
    assert raw.model_info()["model_path"] == str(ckpts["B"])  # tokenizer manager: only successes
    result = client.restore()
    assert result.version == "B-1" and result.detail["path"] == str(ckpts["B"].resolve())
    assert client.probe() == "B-1"
    assert raw.greedy(PROMPT, 8) == (fresh["B"][0], "B-1")


def test_probe_refuses_weights_that_differ_from_the_first_deploy_of_the_version(
    client_srv: tuple[SGLangStandIn, SGLangWorkerClient], ckpts: dict[str, Path]
) -> None:
    srv, client = client_srv
    client.update(disk("B-1", ckpts["B"]))
    assert client.probe() == "B-1"
    raw = SGLangAPI("raw", srv.url, api_key=API_KEY, admin_api_key=ADMIN_KEY)
    # Behind the daemon's back: A's weights under B-1's label.
    assert raw.update_weights_from_disk(str(ckpts["A"]), weight_version="B-1").success
    raw.update_weight_version("B-1")
    with pytest.raises(Exception, match="not serving those weights"):
        client.probe()


def running(srv: SGLangStandIn) -> int:
    """Requests the stand-in holds now (its /metrics gauge, as SGLang's `sglang:num_running_reqs`)."""
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return int(text.split("sglang:num_running_reqs ")[1].split()[0])


def test_drain_turns_readiness_off_and_the_unpaused_update_waits_for_requests_in_flight(
    client_srv: tuple[SGLangStandIn, SGLangWorkerClient], ckpts: dict[str, Path], fresh: dict[str, Any]
) -> None:
    srv, client = client_srv
    raw = SGLangAPI("raw", srv.url, api_key=API_KEY)
    assert client.ready()
    out: list[Any] = []
    bg = threading.Thread(target=lambda: out.append(raw.greedy(PROMPT[:10], 60)), daemon=True)
    bg.start()
    wait_until(lambda: running(srv) >= 1, 60, 0.02, "the request in flight")  # holds the update lock as a reader
    client.drain(30)
    assert not client.ready() and client.weight_info().state == "DRAINING"
    client.update(disk("B-1", ckpts["B"]))
    assert out and out[0][1] == "default"  # finished wholly before the load
    assert client.probe() == "B-1" and client.ready()
    assert raw.greedy(PROMPT, 8) == (fresh["B"][0], "B-1")


# --------------------------------------------------------------------------- through the daemon


@dataclass
class Fleet:
    daemon: DaemonProcess
    watch: Path
    url: str
    pidfile: Path
    release: Path
    logs: Path

    def api(self) -> SGLangAPI:
        return SGLangAPI("t", self.url, api_key=API_KEY, admin_api_key=ADMIN_KEY)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("sg-daemon")
    watch, state, logs = root / "checkpoints", root / "state", root / "logs"
    logs.mkdir()
    v0 = publish_ckpt(watch, "v0", tiny(10))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    (root / "api.key").write_text(API_KEY + "\n")
    (root / "admin.key").write_text(ADMIN_KEY + "\n")
    pidfile, release = root / "sglang.pid", root / "release"
    argv = standin_command("{path}", port, api_key=API_KEY, admin_api_key=ADMIN_KEY,
                           weight_version="{version}", step_delay_s=STEP_DELAY_S)  # fmt: skip
    restart = restart_command(pidfile, logs / "sglang.log", argv)
    first = [a.replace("{path}", str(v0)).replace("{version}", "default") for a in restart]
    subprocess.run(first, check=True, timeout=60, capture_output=True)
    try:
        wait_until(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, 120, 0.2, "the stand-in")
        worker = engine_worker("s0", "sglang", url, root / "api.key", restart,
                               admin_token_file=str(root / "admin.key"))  # fmt: skip
        cfg = make_config_file(
            root / "config.toml",
            daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "log_level": "debug"},
            database={"url": f"sqlite:///{root / 'hotswap.db'}"},
            sources=[{"path": str(watch), "rescan_interval_s": 1.0, "quiet_period_s": 0.3}],
            checks=FEW_CHECKS,
            # max_infra_retries = 0: a worker that dies mid-update rejects the version at once (by
            # default it is retried as the fleet's fault; daemon/rollout/attribution.py);
            # restart_rollouts = false: a checkpoint of other shapes is rejected, not relaunched on
            rollout={"mode": "pause", "health_window_s": 1.0, "health_poll_s": 1.0, "restart_timeout_s": 120.0,
                     "max_infra_retries": 0, "restart_rollouts": False},
            workers=[worker],
        )
        env = {"HOTSWAP_TEST_HOLD_STATE": "PAUSED", "HOTSWAP_TEST_HOLD_VERSION": "v4,v5",
               "HOTSWAP_TEST_HOLD_RELEASE": str(release)}  # fmt: skip (released by release.v4, release.v5)
        d = DaemonProcess(root, cfg, f"sqlite:///{root / 'hotswap.db'}", watch, state, env, hooked=True)
        d.start(timeout=90)
        try:
            d.wait_status("v0", "deployed", timeout=120)
            yield Fleet(d, watch, url, pidfile, release, logs)
        finally:
            for v in ("v4", "v5"):
                release.with_name(f"release.{v}").touch()
            d.close()
    finally:
        kill_pidfile(pidfile)


def test_daemon_serves_a_dropped_checkpoint_like_a_fresh_server_requests_during_it_all_succeed(
    fleet: Fleet,
) -> None:
    api = fleet.api()
    assert api.weight_version() == "v0"
    before = api.greedy(PROMPT, 8)[0]  # PROMPT now cached under v0
    load = Load(fleet.url)
    try:
        time.sleep(0.5)
        v1 = publish_ckpt(fleet.watch, "v1", tiny(11))
        fleet.daemon.wait_status("v1", "deployed", timeout=120)
    finally:
        load.stop()
    assert load.errors == [] and load.ok > 0
    want = fresh_tokens(v1, fleet.logs / "fresh-v1.log")[0]
    assert want != before
    assert api.greedy(PROMPT, 8) == (want, "v1")  # the cached prompt: new weights' tokens
    paths = worker_paths(fleet.daemon.registry)[("s0", "v1")]
    assert paths[-1] == ["RUNNING", "PAUSED", "UPDATED", "RUNNING"]
    ready = httpx.get(f"{fleet.daemon.api_url}/v1/workers/s0/ready", timeout=10)
    assert ready.status_code == 200 and ready.json() == {"ready": True, "state": "RUNNING"}
    assert httpx.get(f"{fleet.daemon.api_url}/v1/workers/nobody/ready", timeout=10).status_code == 404


def test_corrupt_and_incompatible_checkpoints_are_rejected_and_v1_keeps_serving(fleet: Fleet) -> None:
    api = fleet.api()
    before = api.greedy(PROMPT, 8)

    bad = publish_ckpt(fleet.watch, "v2", lambda d: make_tiny_checkpoint(d, seed=12))
    corrupt_bytes(bad)  # after the manifest: the bytes no longer match it
    publish_ckpt(fleet.watch, "v3", tiny(13, intermediate_size=96))
    fleet.daemon.wait_status("v2", "rejected", timeout=60)
    fleet.daemon.wait_status("v3", "rejected", timeout=60)
    assert api.greedy(PROMPT, 8) == before and before[1] == "v1"
    assert not [r for r in rollouts(fleet.daemon.registry) if r["version"] in ("v2", "v3")]


def test_a_shard_changed_after_verify_is_refused_before_sglang_reads_it(fleet: Fleet) -> None:
    """Once, SGLang loaded such a shard, failed, "rolled back" by reloading it, failed again and
    died (the restart command brought last good back). Now the client hashes the files in
    prepare and stats them again before the load: nothing reaches SGLang, which keeps serving."""
    api = fleet.api()
    before = api.greedy(PROMPT, 8)
    v4 = publish_ckpt(fleet.watch, "v4", lambda d: make_tiny_checkpoint(d, seed=14, shards=2))
    wait_until(lambda: "test_hold_begin" in fleet.daemon.log(), 120, 0.1, "the daemon to hold v4 at PAUSED")
    r = httpx.get(f"{fleet.daemon.api_url}/v1/workers/s0/ready", timeout=10)
    assert r.status_code == 503 and r.json()["state"] == "PAUSED"
    # After verify and the client's hash, before the load: a tensor of the wrong shape in shard 2.
    from safetensors.torch import load_file, save_file

    shard = sorted(v4.glob("model-*.safetensors"))[-1]
    tensors = load_file(str(shard))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].flatten()[:-1].clone()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    old_pid = int(fleet.pidfile.read_text())
    fleet.release.with_name("release.v4").touch()
    fleet.daemon.wait_status("v4", "rejected", timeout=180)
    assert int(fleet.pidfile.read_text()) == old_pid  # never read by SGLang: no crash, no restart
    assert api.greedy(PROMPT, 8) == before  # v1's tokens, v1's label
    (rollout,) = [r for r in rollouts(fleet.daemon.registry) if r["version"] == "v4"]
    assert rollout["outcome"] == "failed"
    path = worker_paths(fleet.daemon.registry)[("s0", "v4")][-1]
    assert path == ["RUNNING", "PAUSED", "RUNNING"], path  # refused, resumed as it was: never UNHEALTHY
    events = worker_events(fleet.daemon.registry, rollout["id"])
    refused = events[1]["detail"]
    assert refused["kind"] == "refused" and shard.name in refused["error"] and "nothing was loaded" in refused["error"]
    assert refused["action"] == "refused" and refused["kept"] == "v1", events
    assert "Scheduler hit an exception" not in (fleet.logs / "sglang.log").read_text()


def test_sglang_killed_mid_update_ends_on_last_good_after_its_restart_command(fleet: Fleet) -> None:
    api = fleet.api()
    before = api.greedy(PROMPT, 8)
    log_at = len(fleet.daemon.log())
    publish_ckpt(fleet.watch, "v5", lambda d: make_tiny_checkpoint(d, seed=15))
    wait_until(lambda: "test_hold_begin" in fleet.daemon.log()[log_at:], 120, 0.1, "the daemon to hold v5 at PAUSED")
    old_pid = int(fleet.pidfile.read_text())
    kill_pidfile(fleet.pidfile)  # SIGKILL the server's whole process group, paused mid-rollout
    fleet.release.with_name("release.v5").touch()
    fleet.daemon.wait_status("v5", "rejected", timeout=240)
    assert int(fleet.pidfile.read_text()) != old_pid  # the restart command ran
    assert api.greedy(PROMPT, 8) == before  # v1's tokens, v1's label
    (rollout,) = [r for r in rollouts(fleet.daemon.registry) if r["version"] == "v5"]
    assert rollout["outcome"] == "failed"
    path = worker_paths(fleet.daemon.registry)[("s0", "v5")][-1]
    assert path[:2] == ["RUNNING", "PAUSED"] and "UNHEALTHY" in path and path[-1] == "RUNNING", path
    events = worker_events(fleet.daemon.registry, rollout["id"])
    assert any(e["detail"].get("action") == "restart" for e in events), events
    assert events[-1]["detail"].get("restored_to") == "v1", events[-1]
