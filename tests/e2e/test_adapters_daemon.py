"""LoRA adapters through a real hotswap daemon: two workers, the daemon's own managed reference
worker and the SGLang 0.5.23 stand-in (started with --enable-lora; its routes are checked against
the wheel by test_engine_routes.py and test_sglang_standin.py), one tiny base both serve.

A published adapter is verified and loaded on both with no pause (base requests under load all
succeed, nobody leaves RUNNING), its greedy tokens equal the base with the adapter merged
(support_adapters, float64, independent of hotswap); a second version replaces it; bad adapters
are refused with their reason and change nothing; rollback, pin and unpin work per adapter;
`hotswap history --adapter` and the SQL view `worker_adapter_versions` say what serves where; a
worker that comes back without its adapters gets them again.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import DaemonProcess, hotswap_cli, make_config_file, wait_until
from sqlalchemy import text
from support_adapters import make_adapter, make_base, merged_greedy, publish_adapter
from support_engines import corrupt_bytes, engine_worker, kill_pidfile, publish_ckpt, restart_command
from support_rollout import rollouts, worker_events
from support_sglang import standin_command
from support_vllm import free_port

from bench.loadgen import LoadGen
from daemon.engines.sglang_api import SGLangAPI

pytestmark = pytest.mark.timeout(900)
PROMPT = [5, 17, 33, 2, 71, 9, 120, 44]
N = 10
# The test's adapters are random and strong (they must change greedy answers of a sharpened base):
# far from the base by KL, so the canary's bound is set above them (its refusal: test_adapter_checks.py)
CHECKS = {"enabled": ["manifest", "headers", "crc32c", "compat", "finite", "forward"], "adapter_kl_max": 50.0}


@dataclass
class Env:
    daemon: DaemonProcess
    watch: Path
    base: Path
    builtin_url: str
    sglang_url: str
    root: Path
    expected: dict[str, list[int]]  # version -> merged greedy tokens

    def builtin(self, model: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
        if model:
            body["model"] = model
        r = httpx.post(self.builtin_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    def sglang(self, lora: str | None) -> list[int]:
        return SGLangAPI("t", self.sglang_url).greedy(PROMPT, N, lora=lora)[0]

    def adapter(self, version: str, seed: int, **kw: Any) -> Path:
        d = publish_adapter(self.watch, version, "sql", lambda x: make_adapter(x, self.base, seed=seed, **kw))
        tokens, margin = merged_greedy(self.base, d, PROMPT, N)
        assert margin > 1e-3, f"{version}: greedy margin {margin}: the reference is ambiguous, pick another seed"
        self.expected[version] = tokens
        return d

    def settled(self, version: str, status: str, timeout: float = 300) -> dict[str, Any]:
        """Wait until `version` is done with (deployed, rejected, ...), then insist on `status`."""
        row = self.daemon.wait_status(version, ("deployed", "rejected", "superseded", "verified", "retired"), timeout)
        if row["status"] == "verified":  # verified, not yet rolled out: wait for the outcome
            row = self.daemon.wait_status(version, ("deployed", "rejected", "superseded"), timeout)
        assert row["status"] == status, f"{version}: {row['status']}: {row['status_message']}"
        return row

    def serving(self, version: str) -> None:
        """Both workers answer `model: sql` with `version`'s merged tokens."""
        doc = self.builtin("sql")
        assert doc["adapter_version"] == version and doc["choices"][0]["token_ids"] == self.expected[version]
        assert self.sglang("sql") == self.expected[version]

    def view(self) -> list[tuple[str, str, str, str | None]]:
        with self.daemon.registry.engine.connect() as c:
            rows = c.execute(text("SELECT worker, adapter, version, serving FROM worker_adapter_versions "
                                  "ORDER BY worker")).all()  # fmt: skip
        return [tuple(r) for r in rows]  # type: ignore[misc]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("lora-daemon")
    watch, state = root / "checkpoints", root / "state"
    base = publish_ckpt(watch, "base-v0", lambda d: make_base(d, seed=0, lm_head_scale=8.0))
    port = free_port()
    sglang_url = f"http://127.0.0.1:{port}"
    pidfile = root / "sglang.pid"
    restart = restart_command(pidfile, root / "sglang.log", standin_command("{path}", port, enable_lora=True))
    subprocess.run([a.replace("{path}", str(base)) for a in restart], check=True, timeout=60, capture_output=True)
    (root / "none.key").write_text("unused\n")
    cfg = make_config_file(
        root / "config.toml",
        daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "keep_workers_on_stop": False},
        database={"url": f"sqlite:///{root / 'hotswap.db'}"},
        sources=[{"path": str(watch), "rescan_interval_s": 1.0, "quiet_period_s": 0.3}],
        checks=CHECKS,
        rollout={"mode": "pause", "health_window_s": 1.0, "health_poll_s": 1.0, "restart_timeout_s": 120.0},
        workers=[{"name": "local", "launch": "managed", "device": "cpu", "model": str(base)},
                 engine_worker("s0", "sglang", sglang_url, root / "none.key", restart)],
    )  # fmt: skip
    d = DaemonProcess(root, cfg, f"sqlite:///{root / 'hotswap.db'}", watch, state, {})
    try:
        wait_until(lambda: httpx.get(sglang_url + "/health", timeout=2).status_code == 200, 120, 0.2, "the stand-in")
        d.start(timeout=120)
        d.wait_status("base-v0", "deployed", timeout=300)
        port_file = state / "worker-local.json"
        builtin = f"http://127.0.0.1:{wait_until(lambda: json.loads(port_file.read_text())['port'], 60, 0.1, 'launch')}"
        wait_until(lambda: httpx.get(builtin + "/ready", timeout=5).status_code == 200, 180, 0.2, "the managed worker")
        yield Env(d, watch, base, builtin, sglang_url, root, {})
    finally:
        d.close()
        kill_pidfile(pidfile)
        with contextlib.suppress(OSError, ValueError, KeyError):  # never leave the managed worker behind
            pid = int(json.loads((state / "worker-local.json").read_text())["pid"])
            if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes():  # still that worker, not a reused pid
                os.kill(pid, signal.SIGKILL)


def _sglang_base_load(env: Env, stop: threading.Event, codes: list[int]) -> None:
    while not stop.is_set():
        try:
            r = httpx.post(env.sglang_url + "/generate", json={"input_ids": PROMPT, "sampling_params": {
                "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}, timeout=60)  # fmt: skip
            codes.append(r.status_code)
        except httpx.HTTPError:
            codes.append(-1)


def test_a_published_adapter_is_verified_and_loaded_on_both_workers_with_no_pause(env: Env) -> None:
    base_tokens = env.builtin(None)["choices"][0]["token_ids"]
    load = LoadGen([env.builtin_url], concurrency=2, max_seconds=300)
    stop, codes = threading.Event(), []
    t = threading.Thread(target=_sglang_base_load, args=(env, stop, codes), daemon=True)
    with load:
        t.start()
        load.wait_requests(5, timeout=120)
        env.adapter("sql@1", seed=1)
        row = env.settled("sql@1", "deployed")
        load.wait_requests(5, timeout=120)
        stop.set()
        t.join(60)
    assert load.stats.failed == load.stats.retried_503 == load.stats.retried_unready == 0, load.stats.errors[:5]  # never drained or paused
    assert codes and set(codes) == {200}, codes[-10:]
    assert row["adapter_name"] == "sql" and row["kind"] == "adapter" and row["serving"] == 1
    assert re.fullmatch(r"local=\d+ms s0=\d+ms", row["worker_update_ms"] or ""), row["worker_update_ms"]  # each load
    env.serving("sql@1")
    assert env.expected["sql@1"] != base_tokens  # the adapter changes the answer
    assert env.builtin(None)["choices"][0]["token_ids"] == base_tokens  # the base's own requests are untouched
    r = next(r for r in rollouts(env.daemon.registry) if r["version"] == "sql@1")
    assert (r["transport"], r["mode"], r["outcome"]) == ("adapter", "live", "succeeded")
    events = worker_events(env.daemon.registry, r["id"])
    assert sorted((e["worker"], e["to"]) for e in events) == [("local", "adapter_loaded"), ("s0", "adapter_loaded")]
    assert env.view() == [("local", "sql", "sql@1", "sql@1"), ("s0", "sql", "sql@1", "sql@1")]
    # "deployed" is written when every worker has it, before its health window (health_window_s 1)
    # ends: the window's verdict is amended onto the rollout after it
    window = wait_until(lambda: next(x for x in rollouts(env.daemon.registry) if x["id"] == r["id"])["detail"]
                        .get("health_window"), 60, 0.2, "the adapter's health window verdict")  # fmt: skip
    assert window["ok"] is True, window


def test_a_second_version_replaces_the_first_on_both_workers(env: Env) -> None:
    env.adapter("sql@2", seed=2)
    env.settled("sql@2", "deployed")
    env.serving("sql@2")
    assert env.daemon.row("sql@1")["status"] == "retired"  # type: ignore[index]
    assert env.view() == [("local", "sql", "sql@2", "sql@2"), ("s0", "sql", "sql@2", "sql@2")]


@pytest.mark.parametrize("bad,check,why", [
    ("corrupt", "crc32c", "adapter_model.safetensors"),
    ("rank", "compat", "lora_A shape [8, 64] != [4, 64]"),
    ("base", "compat", "trained for base 'someone/else'"),
    ("nan", "finite", "NaN"),
])  # fmt: skip
def test_a_bad_adapter_is_refused_with_the_reason_and_changes_nothing(env: Env, bad: str, check: str, why: str) -> None:
    kw = {"rank": {"config_rank": 4}, "base": {"base_model": "someone/else"}, "nan": {"nan": True}}.get(bad, {})
    before = env.builtin("sql")["adapter_version"]
    d = publish_adapter(env.watch, f"sql@bad-{bad}", "sql", lambda x: make_adapter(x, env.base, seed=7, **kw))  # type: ignore[arg-type]
    if bad == "corrupt":
        corrupt_bytes(d)
    row = env.settled(f"sql@bad-{bad}", "rejected", timeout=120)
    assert row["status_message"].startswith(f"{check}: ") and why in row["status_message"], row["status_message"]
    env.serving(before)
    assert not [r for r in rollouts(env.daemon.registry) if r["version"] == f"sql@bad-{bad}"]


def test_rollback_restores_the_previous_adapter_version_on_both_workers(env: Env) -> None:
    serving = env.builtin("sql")["adapter_version"]
    out = hotswap_cli("rollback", "--adapter", "sql", "--json", "-c", str(env.daemon.config_path), cwd=env.root)
    assert out.returncode == 0, out.stderr + out.stdout
    doc = json.loads(out.stdout)
    assert (doc["adapter"], doc["from"], doc["outcome"]) == ("sql", serving, "succeeded")
    env.serving(doc["version"])
    assert doc["version"] != serving
    hist = hotswap_cli("history", "--adapter", "sql", "--json", "-c", str(env.daemon.config_path), cwd=env.root)
    rows = [json.loads(line) for line in hist.stdout.splitlines()]
    assert rows and {r["adapter_name"] for r in rows} == {"sql"} and "base-v0" not in {r["version"] for r in rows}
    assert {r["version"]: r["serving"] for r in rows}[doc["version"]] == 1
    assert env.daemon.row(serving)["rolled_back_at"] is not None  # type: ignore[index]


def test_pin_holds_the_adapter_and_unpin_lets_the_newest_deploy(env: Env) -> None:
    cfg = str(env.daemon.config_path)
    assert hotswap_cli("pin", "sql@2", "-c", cfg, cwd=env.root).returncode == 0
    env.serving("sql@2")
    env.adapter("sql@3", seed=3)
    row = env.daemon.wait_status("sql@3", "verified", timeout=120)
    wait_until(lambda: "pinned to sql@2" in (env.daemon.row("sql@3") or {}).get("status_message", "") or None, 60,
               0.2, "sql@3 to be held by the pin")  # fmt: skip
    env.serving("sql@2")
    assert row["serving"] == 0
    out = hotswap_cli("unpin", "--adapter", "sql", "--json", "-c", cfg, cwd=env.root)
    assert out.returncode == 0 and json.loads(out.stdout)["next"] == "sql@3", out.stdout + out.stderr
    env.settled("sql@3", "deployed")
    env.serving("sql@3")


def test_a_worker_that_comes_back_without_its_adapters_gets_them_again(env: Env) -> None:
    serving = env.builtin("sql")["adapter_version"]
    pid = int(json.loads((env.daemon.state_dir / "worker-local.json").read_text())["pid"])
    os.kill(pid, signal.SIGKILL)  # the supervisor relaunches it on the base; its adapters are gone

    def back() -> bool:
        try:
            doc = env.builtin("sql")
        except (httpx.HTTPError, AssertionError):
            return False
        return doc.get("adapter_version") == serving

    wait_until(back, 300, 0.5, "the relaunched worker to serve the adapter again")
    env.serving(serving)
    reconciles = [r for r in rollouts(env.daemon.registry) if r["detail"].get("by") == "reconcile"]
    assert reconciles and reconciles[-1]["detail"]["workers"] == ["local"]
