"""vLLM with hotswap's worker extension, as docs/how-to/vllm.md says to start it, for the ipc tests.

    ext = install_extension(python, dir)      # pip install --no-deps --target dir <this repo>
    argv = extension_command(python, ext, model_dir, port)   # PYTHONPATH=dir + --worker-extension-cls

The argv starts with `env PYTHONPATH=...`, so the same list serves as a daemon restart command
(tests/support_engines.py relaunch) and as a direct start.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from support_vllm import REPO, vllm_command

from daemon.engines.vllm_ipc import EXTENSION_CLS


def install_extension(python: str, target: Path) -> Path:
    """hotswap's wheel without dependencies into `target` (vLLM's venv has torch; the extension
    needs nothing else), exactly the docs' `pip install --no-deps --target`."""
    if not (target / "daemon" / "engines" / "vllm_extension.py").is_file():
        proc = subprocess.run(
            [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
             "--target", str(target), str(REPO)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if proc.returncode != 0:
            raise AssertionError(f"pip install of hotswap into {target} failed:\n{proc.stderr[-3000:]}")
    return target


def extension_command(
    python: str, ext: Path, model_dir: Path | str, port: int, extra_args: list[str] | None = None
) -> list[str]:
    return ["env", f"PYTHONPATH={ext}",
            *vllm_command(python, model_dir, port, ["--worker-extension-cls", EXTENSION_CLS, *(extra_args or [])])]  # fmt: skip
