"""Helpers for the engine adapter tests: published checkpoints for vLLM / the SGLang stand-in, a
daemon configured with `kind = "vllm"|"sglang"`, and restart commands that relaunch an engine.

Restart command CLI (what a `restart_command` runs; like `systemctl restart`, it returns at once):

    python tests/support_engines.py relaunch --pidfile F --log F -- ENGINE_ARGV...

kills the process group recorded in F (if alive), starts ENGINE_ARGV detached in its own
session (environment for vLLM: support_vllm.vllm_env), records its pid in F, prints it, exits.
`kill_pidfile(F)` ends what it started (tests call it at teardown).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

TESTS = Path(__file__).resolve().parent
SCRIPT = Path(__file__).resolve()
FEW_CHECKS = {"enabled": ["manifest", "headers", "crc32c", "compat", "finite"]}
PROMPT = [11, 23, 37, 41, 53, 67, 79, 97, 101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157,
          163, 167, 173, 179, 181, 191, 193, 197, 199, 211, 223, 227, 229, 233, 239, 241]  # fmt: skip


def publish_ckpt(watch_dir: Path, version: str, make: Callable[[Path], Path]) -> Path:
    """`make(dir)` writes a checkpoint; a manifest is added and the folder renamed into the watched
    folder in one step (the source ignores the hidden build folder)."""
    from daemon.manifest import publish

    watch_dir.mkdir(parents=True, exist_ok=True)
    tmp = watch_dir / f".build-{version}"
    make(tmp)
    publish(tmp, version=version)
    final = watch_dir / version
    os.replace(tmp, final)
    return final


def corrupt_bytes(directory: Path) -> None:
    """Flip bytes inside the first tensor data of the (first) shard: the CRC check must catch it."""
    shard = sorted(directory.glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        f.seek(8 + header_len + 16)
        chunk = f.read(64)
        f.seek(8 + header_len + 16)
        f.write(bytes(b ^ 0xFF for b in chunk))


def engine_worker(name: str, kind: str, url: str, token_file: Path, restart: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "kind": kind, "url": url, "token_file": str(token_file), "restart_command": restart, **extra}


def restart_command(pidfile: Path, log: Path, argv: list[str]) -> list[str]:
    return [sys.executable, str(SCRIPT), "relaunch", "--pidfile", str(pidfile), "--log", str(log), "--", *argv]


def greedy_vllm(url: str, token: str, prompt: list[int], n: int, timeout: float = 120) -> list[int]:
    model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=timeout)
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


# --------------------------------------------------------------------------- relaunch


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def kill_pidfile(pidfile: Path, wait_s: float = 20.0) -> None:
    """SIGKILL the process group recorded in `pidfile` (started by `relaunch`) and wait for it."""
    try:
        pid = int(pidfile.read_text())
    except (OSError, ValueError):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _relaunch(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="support_engines.py relaunch")
    p.add_argument("--pidfile", required=True, type=Path)
    p.add_argument("--log", required=True, type=Path)
    p.add_argument("argv", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    kill_pidfile(args.pidfile)
    sys.path.insert(0, str(TESTS))
    from support_vllm import vllm_env

    lora = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if "--enable-lora" in cmd else None  # runtime LoRA routes
    env = vllm_env(lora) if "vllm.entrypoints.openai.api_server" in cmd else {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(args.log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=str(args.log.parent), start_new_session=True)  # fmt: skip
    tmp = args.pidfile.with_suffix(".tmp")
    tmp.write_text(str(proc.pid))
    os.replace(tmp, args.pidfile)
    print(json.dumps({"pid": proc.pid}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "relaunch":
        raise SystemExit(_relaunch(sys.argv[2:]))
    raise SystemExit("usage: support_engines.py relaunch --pidfile F --log F -- ARGV")
