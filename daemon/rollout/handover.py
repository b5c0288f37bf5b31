"""A restart rollout of a managed worker with no outage: the new child starts beside the old one.

The daemon holds the serving port's listening socket and every child it launches inherits it
(daemon.rollout.managed), so two children can accept on it at once. When the host has room for a
second worker (`overlap_room`), the relaunch is:

    start beside   the new child on the new version, on the same listening socket, with its admin
                   API on a socket of its own (`<name>.next.sock`); the old child keeps serving
                   (RUNNING) while the new one loads and checks its files
    ready          the new child's admin /ready answers 200: it accepts on the shared socket
    hand over      its admin socket is renamed onto the worker's (the daemon's client reaches it
                   from then on), the old child is stopped (SIGTERM: it stops accepting, finishes
                   what it holds and exits; connections queued meanwhile are the new child's)
    abandon        the new child exited or was not ready in `restart_timeout_s`: it is stopped
                   and the old one, never touched, keeps serving (its token and runtime file back)

Without room (RAM, or GPU memory on a CUDA device, for a second copy; the admin API on TCP,
where two children cannot be told apart) the old child must stop first: the relaunch says why
in the log and the worker's event, and new connections wait in the daemon's socket meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from daemon.common.logging import get_logger
from daemon.common.private import write_private
from daemon.rollout.managed import STOP_TIMEOUT_S, ManagedWorker, target_problem
from daemon.transport.base import Expect

log = get_logger(__name__)
OVERLAP_FACTOR = 1.2  # room for this much more than the running child holds (or the new version's bytes)
GiB = 2**30


def next_socket(m: ManagedWorker) -> Path | None:
    return m.admin_socket.with_name(m.admin_socket.stem + ".next.sock") if m.admin_socket is not None else None


def _gpu_room(device: str, pid: int, need_bytes: int) -> str | None:
    """None when the GPU has `need_bytes` free beside the running child; else why not (or why we cannot tell)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cannot tell the GPU's free memory (no nvidia-smi)"
    index = device.split(":", 1)[1] if ":" in device else "0"
    try:
        out = subprocess.run([smi, "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", index],
                             capture_output=True, text=True, timeout=10, check=True).stdout  # fmt: skip
        apps = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10, check=True).stdout  # fmt: skip
        free = int(out.split()[0]) * 2**20
        used = sum(int(u) for p, u in (line.split(",") for line in apps.splitlines() if "," in line)
                   if int(p) == pid) * 2**20  # fmt: skip
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return f"cannot tell the GPU's free memory ({exc})"
    need = int(max(used, need_bytes) * OVERLAP_FACTOR)
    if free < need:
        return (f"GPU {device}: {free / GiB:.1f} GiB free < {need / GiB:.1f} GiB for a second worker "
                f"({OVERLAP_FACTOR:g} x the running one's {used / GiB:.1f} GiB)")  # fmt: skip
    return None


def overlap_room(m: ManagedWorker, target_bytes: int) -> str | None:
    """None when a second child fits beside the running one; else why the old one must stop first."""
    if m.admin_socket is None:
        return "its admin API is on the TCP port (admin = \"tcp\"), where two workers cannot be told apart"
    if m.pid is None or not m.alive():
        return "no running worker to keep serving"
    try:
        rss = psutil.Process(m.pid).memory_info().rss
    except psutil.Error as exc:
        return f"cannot read the running worker's memory ({exc})"
    need = int(max(rss, target_bytes) * OVERLAP_FACTOR)
    available = psutil.virtual_memory().available
    if available < need:
        return (f"host RAM: {available / GiB:.1f} GiB available < {need / GiB:.1f} GiB for a second worker "
                f"({OVERLAP_FACTOR:g} x the running one's {rss / GiB:.1f} GiB)")  # fmt: skip
    if m.spec.device.startswith("cuda"):
        return _gpu_room(m.spec.device, m.pid, target_bytes)
    return None


@dataclass
class Previous:
    """The old child while the new one starts beside it, and what to put back if it is abandoned."""

    pid: int
    proc: subprocess.Popen[bytes] | None
    model: str | None
    version: str | None
    expect: Expect | None
    token: bytes | None
    runtime: bytes | None


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def start_beside(m: ManagedWorker, model: str, version: str, expect: Expect | None) -> Previous:
    """Launch the new child beside the running one. RuntimeError (nothing started) when `model`
    is missing or its files do not match `expect`."""
    problem = target_problem(model, expect)
    if problem is not None:
        raise RuntimeError(f"managed worker {m.spec.name}: not relaunched on {version}: {problem}")
    assert m.pid is not None
    prev = Previous(m.pid, m.proc, m.model, m.version, m.expect, _read(m.token_file), _read(m.runtime_file))
    nxt = next_socket(m)
    if nxt is not None:
        with contextlib.suppress(FileNotFoundError):
            nxt.unlink()  # a stale one from an abandoned handover
    m.forget_child()
    try:
        m.launch(model, version, expect, admin_socket=nxt)
    except BaseException:
        _put_back(m, prev)
        raise
    log.info("restart_beside_started", worker=m.spec.name, old_pid=prev.pid, new_pid=m.pid, version=version)
    return prev


def wait_ready(m: ManagedWorker, timeout_s: float) -> bool:
    """Until the new child's admin /ready says 200 (True), or it exited or the time passed (False)."""
    nxt = next_socket(m)
    assert nxt is not None
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(nxt)), base_url="http://worker", timeout=5.0) as c:
        while time.monotonic() < deadline and m.alive():
            with contextlib.suppress(httpx.HTTPError):
                if nxt.exists() and c.get("/ready").status_code == 200:
                    return True
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)
    return False


def hand_over(m: ManagedWorker, prev: Previous) -> float:
    """The new child's admin socket becomes the worker's; the old child is stopped gracefully.
    Returns how long the old one took to finish what it held and exit (seconds)."""
    nxt = next_socket(m)
    assert nxt is not None and m.admin_socket is not None
    os.replace(nxt, m.admin_socket)
    t0 = time.monotonic()
    _stop_pid(prev.pid, prev.proc)
    return time.monotonic() - t0


def abandon(m: ManagedWorker, prev: Previous) -> None:
    """Stop the new child; the old one (never touched) is the worker again."""
    m.stop()
    nxt = next_socket(m)
    if nxt is not None:
        with contextlib.suppress(FileNotFoundError):
            nxt.unlink()
    _put_back(m, prev)
    log.warning("restart_beside_abandoned", worker=m.spec.name, kept_pid=prev.pid)


def _put_back(m: ManagedWorker, prev: Previous) -> None:
    m.adopt_child(prev.pid, prev.proc, prev.model, prev.version, prev.expect)
    if prev.token is not None:
        write_private(m.token_file, prev.token)
    if prev.runtime is not None:
        write_private(m.runtime_file, prev.runtime)


def _stop_pid(pid: int, proc: subprocess.Popen[bytes] | None) -> None:
    def alive() -> bool:
        if proc is not None:
            return proc.poll() is None
        try:
            return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and alive():
        time.sleep(0.02)
    if alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
