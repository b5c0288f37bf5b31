"""Start the SGLang 0.5.23 stand-in (tests/sglang_standin.py) as a real server process.

    with SGLangStandIn.start(ckpt_dir, tmp_path / "sglang.log", api_key="k") as srv:
        SGLangAPI("s0", srv.url, api_key="k")...

It runs in the project's venv (torch, transformers, FastAPI, uvicorn), binds a free loopback
port, and is stopped (SIGTERM, then SIGKILL) when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from support_vllm import die_with_parent, free_port

STANDIN = Path(__file__).resolve().parent / "sglang_standin.py"


def standin_command(
    model_dir: Path | str, port: int, *, api_key: str | None = None, admin_api_key: str | None = None,
    weight_version: str = "default", step_delay_s: float = 0.0, enable_lora: bool = False,
) -> list[str]:
    """The stand-in's argv (also used by restart commands: tests/support_engines.py)."""
    cmd = [sys.executable, str(STANDIN), "--model", str(model_dir), "--port", str(port),
           "--weight-version", weight_version, "--step-delay-s", str(step_delay_s)]
    if enable_lora:
        cmd += ["--enable-lora"]
    if api_key:
        cmd += ["--api-key", api_key]
    if admin_api_key:
        cmd += ["--admin-api-key", admin_api_key]
    return cmd


class SGLangStandIn:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, model_dir: Path, log_path: Path) -> None:
        self.proc = proc
        self.url = url
        self.model_dir = model_dir
        self.log_path = log_path

    @classmethod
    def start(
        cls,
        model_dir: Path,
        log_path: Path,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        weight_version: str = "default",
        step_delay_s: float = 0.0,
        timeout_s: float = 120.0,
        port: int | None = None,
        enable_lora: bool = False,
    ) -> SGLangStandIn:
        port = port or free_port()
        cmd = standin_command(model_dir, port, api_key=api_key, admin_api_key=admin_api_key,
                              weight_version=weight_version, step_delay_s=step_delay_s, enable_lora=enable_lora)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=die_with_parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        srv = cls(proc, f"http://127.0.0.1:{port}", model_dir, log_path)
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"SGLang stand-in exited with {proc.returncode}:\n{srv.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                    return srv
            if time.monotonic() > deadline:
                srv.stop()
                raise AssertionError(f"SGLang stand-in did not answer /health in {timeout_s} s:\n{srv.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_exit(self, timeout_s: float = 30.0) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.proc.wait(timeout_s)
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def __enter__(self) -> SGLangStandIn:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
