"""vLLM with hotswap's worker extension, as docs/how-to/vllm.md says to start it, for the ipc tests.

    ext = install_extension(python, dir)      # pip install --no-deps --target dir <this repo>
    argv = extension_command(python, ext, model_dir, port)   # PYTHONPATH=dir + --worker-extension-cls

The argv starts with `env PYTHONPATH=...`, so the same list serves as a daemon restart command
(tests/support_engines.py relaunch) and as a direct start.
"""

from __future__ import annotations

import fcntl
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from conftest import DaemonProcess, make_config_file, wait_until
from support_engines import (
    FEW_CHECKS,
    PROMPT,
    engine_worker,
    greedy_vllm,
    kill_pidfile,
    publish_ckpt,
    restart_command,
)
from support_ipc import LoaderProcess, shm_dir
from support_vllm import REPO, TOKEN, free_port, make_vllm_checkpoint, vllm_command, vllm_python

from daemon.engines.vllm_ipc import EXTENSION_CLS
from daemon.manifest import publish

START_S = 420.0


def install_extension(python: str, target: Path) -> Path:
    """hotswap's wheel without dependencies into `target` (vLLM's venv has torch; the extension
    needs nothing else), exactly the docs' `pip install --no-deps --target`.

    One install at a time per checkout: setuptools builds in the repository's `build/`, and two
    xdist workers building there at once failed with "File exists: build/bdist...dist-info"."""
    if (target / "daemon" / "engines" / "vllm_extension.py").is_file():
        return target
    (REPO / "build").mkdir(exist_ok=True)  # gitignored; the lock lives beside what it guards
    with open(REPO / "build" / ".install.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run(
            [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
             "--target", str(target), str(REPO)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if proc.returncode != 0:
            raise AssertionError(f"pip install of hotswap into {target} failed:\n{proc.stderr[-3000:]}")
    return target


def extension_command(
    python: str, ext: Path, model_dir: Path | str, port: int, extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> list[str]:
    return ["env", f"PYTHONPATH={ext}", *(f"{k}={v}" for k, v in (env or {}).items()),
            *vllm_command(python, model_dir, port, ["--worker-extension-cls", EXTENSION_CLS, *(extra_args or [])])]  # fmt: skip


@dataclass
class Rig:
    """A vLLM with the extension (started fresh on v1), a loader, a daemon with transport ipc on v0."""

    daemon: DaemonProcess
    loader: LoaderProcess
    watch: Path
    root: Path
    url: str
    pidfile: Path
    release: Path
    fresh_v1: list[int]  # PROMPT's tokens on the vLLM that loaded v1 from disk at start
    tokens: dict[str, list[int]]  # version -> PROMPT's tokens seen while it served

    def greedy(self) -> list[int]:
        return list(greedy_vllm(self.url, TOKEN, PROMPT, 8))

    def label(self) -> str:
        return str(httpx.get(self.url + "/weight_info", timeout=10).json()["weight_version"])


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def ipc_rig(root: Path, *, tp: int = 1, hold_version: str = "none") -> Iterator[Rig]:
    """`tp` > 1: `--tensor-parallel-size tp`, each rank's threads bound to one core
    (VLLM_CPU_OMP_THREADS_BIND="0|1": vLLM's automatic binding wants a NUMA node per rank)."""
    python = vllm_python()  # skips on HOTSWAP_SKIP_VLLM=1
    ext = install_extension(python, root / "ext")
    watch, state, staging = root / "checkpoints", root / "state", root / "staging"
    v1 = make_vllm_checkpoint(staging / "v1", seed=21)
    publish(v1, version="v1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    (root / "vllm.key").write_text(TOKEN + "\n")
    pidfile, release, log = root / "vllm.pid", root / "release", root / "vllm.log"
    extra = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp))} if tp > 1 else {}
    restart = restart_command(pidfile, log, extension_command(python, ext, "{path}", port, extra, env))
    with shm_dir() as shm:
        loader = LoaderProcess(root / "loader.sock", shm, "--max-versions", "6")
        try:
            subprocess.run([a.replace("{path}", str(v1)) for a in restart], check=True, timeout=60, capture_output=True)
            try:
                wait_until(lambda: _healthy(url), START_S, 0.5, "vLLM /health")
            except AssertionError:
                raise AssertionError(f"vLLM did not start:\n{log.read_text(errors='replace')[-4000:]}") from None
            greedy_vllm(url, TOKEN, list(range(3, 11)), 1)  # first forward >= 5 tokens (support_vllm.py)
            fresh = list(greedy_vllm(url, TOKEN, PROMPT, 8))
            publish_ckpt(watch, "v0", lambda d: make_vllm_checkpoint(d, seed=20))
            cfg = make_config_file(
                root / "config.toml",
                daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "log_level": "debug"},
                database={"url": f"sqlite:///{root / 'hotswap.db'}"},
                sources=[{"path": str(watch), "rescan_interval_s": 1.0, "quiet_period_s": 0.3}],
                checks=FEW_CHECKS,
                rollout={"transport": "ipc", "mode": "pause", "health_window_s": 2.0, "health_poll_s": 2.0,
                         "request_timeout_s": 30.0, "restart_timeout_s": START_S, "max_infra_retries": 0,
                         "restart_rollouts": False},  # fmt: skip
                workers=[engine_worker("vllm0", "vllm", url, root / "vllm.key", restart)],
                loader={"socket": str(loader.socket_path)},
            )
            hold = {"HOTSWAP_TEST_HOLD_STATE": "PAUSED", "HOTSWAP_TEST_HOLD_VERSION": hold_version,
                    "HOTSWAP_TEST_HOLD_RELEASE": str(release)}  # fmt: skip
            d = DaemonProcess(root, cfg, f"sqlite:///{root / 'hotswap.db'}", watch, state, hold, hooked=True)
            d.start(timeout=90)
            try:
                d.wait_status("v0", "deployed", timeout=300)
                rig = Rig(d, loader, watch, root, url, pidfile, release, fresh, {})
                rig.tokens["v0"] = rig.greedy()
                yield rig
            finally:
                release.touch()
                d.close()
        finally:
            kill_pidfile(pidfile)
            loader.stop()
