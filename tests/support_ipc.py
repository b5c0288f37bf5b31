"""Helpers for the ipc/loader tests: a real `hotswap loader` process on a private shm directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from daemon.handoff.loader_client import LoaderClient

REPO = Path(__file__).resolve().parents[1]


class LoaderProcess:
    def __init__(self, socket_path: Path, shm_dir: Path, *extra: str, device: str = "cpu") -> None:
        self.socket_path = socket_path
        self.shm_dir = shm_dir
        self.log_path = socket_path.with_suffix(".log")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.loader.server", "--socket", str(socket_path), "--device", device,
             "--shm-dir", str(shm_dir), "--threads", "2", *extra],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
        )
        self.client = LoaderClient(socket_path, timeout=10)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.status()
                break
            except Exception:  # noqa: BLE001 - not up yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"loader did not start:\n{self.log()}") from None
                time.sleep(0.05)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def segments(self) -> list[str]:
        return sorted(p.name for p in self.shm_dir.iterdir())

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


@contextmanager
def shm_dir() -> Iterator[Path]:
    """A private directory in /dev/shm (a tmpfs like production), removed afterwards."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    d = base / f"hotswap-test-{uuid.uuid4().hex[:10]}"
    d.mkdir(mode=0o700)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def load_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def open_fds() -> set[tuple[str, str]]:
    """This process's open descriptors as (number, what it points at). Compare sets, not counts:
    in a test process that ran other tests first, the garbage collector may close their files
    in the middle of a test (seen: 20 descriptors before, 16 after), which is no leak."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own descriptor among them)
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    return out


def segment_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/hotswap-" in line and "hotswap-test-" in line)
