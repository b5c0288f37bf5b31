"""LoRA adapters belong to a base (daemon/controller/adapter_base.py), through a real daemon with
two real workers: its managed reference worker and the SGLang 0.5.23 stand-in (--enable-lora).

Base base-v0 serves two adapters: `sql` (trained for the base's name, so it may fit a later base
of that name) and `old` (trained for the version base-v0 itself). Then base-v1 is published:

Both are held to base-v1 before any worker takes it (its rollout's first worker event comes after
their events):

- `sql` is re-verified on base-v1 (compat + forward canary) and stays: both workers answer
  `model: sql` with base-v1 merged with sql@1 (computed in float64, independent of hotswap), and
  base-v1 is recorded among the bases sql@1 was verified on;
- `old` fails its compat on base-v1: it is unloaded from both workers (an `adapter_unloaded`
  event each, an `adapter_unbound` event on old@1), retired, has no serving and no last_good, and
  the problem `adapter_not_on_base` names it in /health (which stays 200: the base serves).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import DaemonProcess, make_config_file, wait_until
from sqlalchemy import text
from support_adapters import make_adapter, make_base, merged_greedy, publish_adapter
from support_engines import engine_worker, kill_pidfile, publish_ckpt, restart_command
from support_sglang import standin_command
from support_vllm import free_port

from daemon.engines.sglang_api import SGLangAPI

pytestmark = pytest.mark.timeout(900)
PROMPT = [5, 17, 33, 2, 71, 9, 120, 44]
N = 10
CHECKS = {"enabled": ["manifest", "headers", "crc32c", "compat", "finite", "forward"], "adapter_kl_max": 1000.0}


@dataclass
class Env:
    daemon: DaemonProcess
    watch: Path
    builtin_url: str
    sglang_url: str
    root: Path

    def builtin(self, model: str) -> httpx.Response:
        body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True, "model": model}
        return httpx.post(self.builtin_url + "/v1/completions", json=body, timeout=60)

    def sglang_adapters(self) -> dict[str, str]:
        return SGLangAPI("t", self.sglang_url).lora_adapters()

    def sql(self, query: str) -> list[Any]:
        with self.daemon.registry.engine.connect() as c:
            return list(c.execute(text(query)).all())


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("lora-base")
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
        yield Env(d, watch, builtin, sglang_url, root)
    finally:
        d.close()
        kill_pidfile(pidfile)
        with contextlib.suppress(OSError, ValueError, KeyError):  # never leave the managed worker behind
            pid = int(json.loads((state / "worker-local.json").read_text())["pid"])
            if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


def test_a_new_base_keeps_the_adapters_that_pass_on_it_and_unloads_the_others_on_every_worker(env: Env) -> None:
    base0 = env.watch / "base-v0"
    sql = publish_adapter(env.watch, "sql@1", "sql", lambda x: make_adapter(x, base0, seed=1))
    publish_adapter(env.watch, "old@1", "old", lambda x: make_adapter(x, base0, seed=2, base_model="base-v0"))
    for v in ("sql@1", "old@1"):
        row = env.daemon.wait_status(v, ("deployed", "rejected"), timeout=300)
        assert row["status"] == "deployed", row
    assert env.builtin("old").status_code == 200 and set(env.sglang_adapters()) == {"sql", "old"}

    base1 = publish_ckpt(env.watch, "base-v1", lambda d: make_base(d, seed=1, lm_head_scale=8.0))
    env.daemon.wait_status("base-v1", "deployed", timeout=300)
    unbound = wait_until(lambda: env.sql("SELECT detail FROM events WHERE to_state = 'adapter_unbound'") or None,
                         120, 0.2, "old@1 to be unbound from base-v1")  # fmt: skip
    detail = unbound[0][0] if isinstance(unbound[0][0], dict) else json.loads(unbound[0][0])
    assert detail["adapter"] == "old" and detail["base"] == "base-v1" and detail["not_unloaded"] == [], detail
    assert "trained for base 'base-v0'" in detail["reason"], detail

    # old: off every worker, no serving, no last_good, a problem naming it; the base still serves
    r = env.builtin("old")
    assert r.status_code != 200, r.text
    assert "old" not in env.sglang_adapters()
    assert sorted(w for (w,) in env.sql("SELECT worker FROM events WHERE to_state = 'adapter_unloaded'")) == ["local", "s0"]
    assert env.daemon.row("old@1")["status"] == "retired"  # type: ignore[index]
    aliases = env.sql("SELECT a.adapter, a.name, c.version FROM adapter_aliases a JOIN checkpoints c ON c.id = a.checkpoint_id")
    assert not [a for a in aliases if a[0] == "old"], aliases
    health = wait_until(lambda: (h := httpx.get(env.daemon.api_url + "/health", timeout=10)).json().get("problems")
                        and h, 30, 0.2, "the problem")  # fmt: skip
    assert health.status_code == 200
    (problem,) = [p for p in health.json()["problems"] if p["kind"] == "adapter_not_on_base"]
    assert problem["subject"] == "old" and "old@1" in problem["reason"], problem

    # sql: re-verified on base-v1, kept, and both workers serve base-v1 + sql@1
    expected, margin = merged_greedy(base1, sql, PROMPT, N)
    assert margin > 1e-3, margin
    doc = env.builtin("sql").json()
    assert doc["adapter_version"] == "sql@1" and doc["choices"][0]["token_ids"] == expected, doc
    assert SGLangAPI("t", env.sglang_url).greedy(PROMPT, N, lora="sql")[0] == expected
    verified = [json.loads(d) if isinstance(d, str) else d
                for (d,) in env.sql("SELECT detail FROM events WHERE to_state = 'adapter_base_verified'")]  # fmt: skip
    assert [v["base"] for v in verified] == ["base-v1"], verified

    # both held to base-v1 before any worker took it: sql re-verified, old unloaded from each worker
    # (an adapter never serves, even for a moment, on a base it was not verified on)
    (first_move,) = env.sql(
        "SELECT min(e.id) FROM events e JOIN rollouts r ON r.id = e.rollout_id JOIN checkpoints c ON c.id = r.checkpoint_id "
        "WHERE c.version = 'base-v1' AND e.worker IS NOT NULL AND e.to_state IN ('PAUSED', 'DRAINING', 'UPDATED')"
    )  # fmt: skip
    assert first_move[0] is not None
    held = env.sql("SELECT e.id, e.to_state, e.worker FROM events e WHERE e.to_state IN "
                   "('adapter_base_verified', 'adapter_unloaded', 'adapter_unbound')")  # fmt: skip
    assert len(held) == 4 and all(i < first_move[0] for i, _, _ in held), (held, first_move)
    assert {a[1]: a[2] for a in aliases if a[0] == "sql"} == {"serving": "sql@1", "last_good": "sql@1"}
