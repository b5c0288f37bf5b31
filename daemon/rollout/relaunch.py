"""Restart rollouts: a verified version whose tensors cannot be written in place (other shapes,
names or dtypes than what the worker serves, e.g. a resized vocabulary) reaches a worker by
relaunching it on that version, in the worker's own turn of the ordinary rollout: the same
batches, `max_unavailable`, drain or pause, post-check, failure path and health window.

    RUNNING ─drain (readiness off, in-flight finish)──▶ DRAINING ─relaunch─▶ UPDATED ─post-check─▶ RUNNING
            └pause (managed, new connections wait)───▶ PAUSED

- managed workers: the new directory is checked against its verified digests first (a mismatch
  refuses the step with the old child still serving). The daemon holds the serving port's
  listening socket and hands it to each child (`--listen-fd`), so the port is never free.
  In a "pause" group (a lone worker's: no other worker serves meanwhile), with room for a second
  worker (`overlap_room`: RAM, GPU memory on CUDA, the admin API on its Unix socket) and
  `restart_overlap = "auto"`, the new child starts BESIDE the old one on that
  socket, its admin API on `<name>.next.sock`; the old one serves (RUNNING) while the new one
  loads; once the new one's /ready is 200 its admin socket is renamed onto the worker's and the
  old one is stopped (SIGTERM: it finishes what it holds; queued connections are the new one's).
  A new child that exits or is not ready in `restart_timeout_s` is stopped and the old one,
  never touched, serves on (the step is refused). Otherwise the old child STOPS FIRST (said in
  the log and the event): connections wait in the backlog for the new child; in a "pause"
  group that backlog is the pause.
- external workers: their `restart_command`, with {path} and {version} of the new version, then
  the daemon waits until the worker reports it (`restart_timeout_s`). A pause cannot outlive a
  process, so an external worker is drained whatever its group's mode (recorded in the event).
- failure: the worker is UNHEALTHY and the engine's failure path relaunches it on the fallback;
  the workers this rollout already moved are relaunched back the same way (their turn sees the
  fallback's layout differ from what they now serve).

Whether a worker needs it (`needed`): the tensor tables (headers only) of the version it serves
(by its reported label; else the serving version's) and of the target differ. An external
worker without a `restart_command` cannot be relaunched: its step is refused before it leaves
RUNNING. With `[rollout] restart_rollouts = false` nothing is relaunched: compat rejects such
versions at verify, and an in-place update of one is refused by the worker's table check.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import psutil

from daemon.common import get_logger, write_private
from daemon.config import RolloutMode, RolloutSettings
from daemon.engines import UpdateRefused, WeightInfo, WorkerError
from daemon.formats import HeaderError, LayoutError, tensor_table
from daemon.registry import Journal
from daemon.rollout.managed import STOP_TIMEOUT_S, ManagedWorker, Restarter, target_problem
from daemon.rollout.stage import Target, registry_expect
from daemon.rollout.states import WorkerHandle, WorkerState, parse_state
from daemon.transport import Expect

log = get_logger(__name__)
S = WorkerState
MAX_LISTED = 3
_LAYOUTS: OrderedDict[tuple[str, int], dict[str, tuple[str, tuple[int, ...]]]] = OrderedDict()  # (dir, mtime) -> table


class Driver(Protocol):
    """What a relaunch needs of daemon.rollout.driver.WorkerDriver (its recording steps)."""

    def begin(self, h: WorkerHandle, rollout_id: int, mode: RolloutMode, target_version: str | None,
              why: str | None = None) -> None: ...  # fmt: skip
    def move(self, h: WorkerHandle, rollout_id: int | None, to: WorkerState, *, duration_ms: float | None,
             detail: dict[str, Any] | None = None, version: str | None = None, error: str | None = None,
             target_version: str | None = None) -> None: ...  # fmt: skip
    def fail(self, h: WorkerHandle, rollout_id: int | None, step: str, exc: Exception | str, t0: float) -> Exception: ...
    def refused(self, h: WorkerHandle, rollout_id: int, exc: UpdateRefused, t0: float) -> Exception: ...
    def finish(self, h: WorkerHandle, rollout_id: int | None, target: Target, detail: dict[str, Any] | None = None) -> None: ...


def _layout(directory: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    key = (str(Path(directory).resolve()), Path(directory).stat().st_mtime_ns)
    table = _LAYOUTS.get(key)
    if table is None:
        table = {n: (loc.entry.dtype, tuple(loc.entry.shape)) for n, loc in tensor_table(directory)[0].items()}
        _LAYOUTS[key] = table
        while len(_LAYOUTS) > 16:
            _LAYOUTS.popitem(last=False)
    return table


def layout_difference(current: str, target: str) -> str | None:
    """One line naming how `target`'s tensors differ from `current`'s, or None when the same."""
    try:
        a, b = _layout(current), _layout(target)
    except (LayoutError, HeaderError, OSError):
        return None  # unreadable here: the in-place path checks the table itself and refuses
    diffs = [f"{n} {list(a[n][1])} -> {list(b[n][1])}" for n in sorted(set(a) & set(b)) if a[n][1] != b[n][1]]
    diffs += [f"{n} dtype {a[n][0]} -> {b[n][0]}" for n in sorted(set(a) & set(b)) if a[n][0] != b[n][0]]
    diffs += [f"{n} only in {Path(current).name}" for n in sorted(set(a) - set(b))]
    diffs += [f"{n} only in {Path(target).name}" for n in sorted(set(b) - set(a))]
    if not diffs:
        return None
    more = f" (and {len(diffs) - MAX_LISTED} more)" if len(diffs) > MAX_LISTED else ""
    return f"cannot be written in place: {'; '.join(diffs[:MAX_LISTED])}{more}"


def _weight_bytes(directory: str | None) -> int:
    try:
        return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors")) if directory else 0
    except OSError:
        return 0


class Relauncher:
    def __init__(self, journal: Journal, settings: RolloutSettings, restarter: Restarter) -> None:
        self.journal = journal
        self.settings = settings
        self.restarter = restarter

    def needed(self, info: WeightInfo, target: Target) -> str | None:
        """Why `target` cannot be written into the worker that reported `info`, or None (always
        None with restart rollouts off: compat rejected such versions, and a worker refuses them)."""
        if not self.settings.restart_rollouts:
            return None
        current = self.journal.checkpoint_by_version(info.version) if info.version else None
        if current is None or not current.local_path:
            current = self.journal.alias("serving")  # what verify compared the target with
        if current is None or current.id == target.checkpoint.id or not current.local_path or not target.checkpoint.local_path:
            return None
        return layout_difference(current.local_path, target.checkpoint.local_path)

    def refusal(self, h: WorkerHandle, target: Target, why: str) -> str | None:
        """Why this worker cannot be relaunched on `target` (it stays RUNNING on what it has)."""
        if h.managed is None and not h.spec.restart_argv():
            return f"worker {h.name}: {target.version} needs a restart rollout ({why}), and it has no restart_command"
        return None

    def relaunch(self, driver: Driver, h: WorkerHandle, rid: int, target: Target, mode: RolloutMode,
                 why: str) -> str | None:  # fmt: skip
        """The worker's turn of a restart rollout (module docstring); raises the driver's StepFailed.
        Returns a refusal (the worker never left RUNNING) when a new process beside it failed."""
        stop_first: str | None = None
        if h.managed is not None and mode == "pause":  # drain: the group's other workers serve meanwhile
            stop_first = ("[rollout] restart_overlap = \"off\"" if self.settings.restart_overlap == "off"
                          else overlap_room(h.managed, _weight_bytes(target.checkpoint.local_path)))  # fmt: skip
            if stop_first is None:
                return self._beside(driver, h, rid, target, why)
            log.warning("restart_rollout_stop_first", worker=h.name, version=target.version, reason=stop_first)
        self._stop_first(driver, h, rid, target, mode, why, stop_first)
        return None

    def _beside(self, driver: Driver, h: WorkerHandle, rid: int, target: Target, why: str) -> str | None:
        """The new process beside the old one, then the handover (daemon.rollout.handover)."""
        m = h.managed
        assert m is not None
        t1 = time.perf_counter()
        path, version = target.checkpoint.local_path or "", target.version
        try:
            prev = start_beside(m, path, version, registry_expect(self.journal, target.checkpoint))
        except (RuntimeError, OSError) as exc:  # nothing started: the old child serves
            return f"worker {h.name}: relaunch beside: {exc}"
        if not wait_ready(m, self.settings.restart_timeout_s):
            exited = not m.alive()
            tail = f"exited ({m.exit_code()})" if exited else f"was not ready {self.settings.restart_timeout_s:g} s after launch"
            abandon(m, prev)
            return f"worker {h.name}: relaunch beside: the new worker on {version} {tail}; the old one serves on"
        driver.move(h, rid, S.PAUSED, duration_ms=(time.perf_counter() - t1) * 1e3, target_version=target.version,
                    detail={"mode": "beside", "restart": why, "how": "the new process started beside the old one and "
                            "serves on the same listening socket; the old one finishes what it holds and exits",
                            "old_pid": prev.pid, "pid": m.pid})  # fmt: skip
        t2 = time.perf_counter()
        stopped_s = hand_over(m, prev)
        if self._wait_up(h, version) is None:
            raise driver.fail(h, rid, "relaunch", f"worker {h.name}: relaunch: the new worker does not report "
                              f"{version} after the handover", t2)  # fmt: skip
        driver.move(h, rid, S.UPDATED, duration_ms=(time.perf_counter() - t2) * 1e3, version=version,
                    detail={"version": version, "how": "managed relaunch beside", "restart": why, "pid": m.pid,
                            "old_stopped_s": round(stopped_s, 3)})  # fmt: skip
        log.info("worker_relaunched", worker=h.name, version=version, how="beside",
                 ms=round((time.perf_counter() - t1) * 1e3), old_stopped_s=round(stopped_s, 3))  # fmt: skip
        driver.finish(h, rid, target, {"restart": True})
        return None

    def _stop_first(self, driver: Driver, h: WorkerHandle, rid: int, target: Target, mode: RolloutMode, why: str,
                    stop_first: str | None) -> None:  # fmt: skip
        t0 = time.perf_counter()
        held = mode == "pause" and h.managed is not None
        if held:  # the daemon's listening socket holds new connections while the child is replaced
            driver.move(h, rid, S.PAUSED, duration_ms=0.0, target_version=target.version,
                        detail={"mode": "pause", "restart": why, "how": "new connections wait in the listening "
                                "socket the daemon holds; the child finishes what it holds and exits",
                                "stop_first": stop_first})  # fmt: skip
        else:
            note = "" if mode == "drain" else "; an external worker is drained: a pause cannot outlive its process"
            driver.begin(h, rid, "drain", target.version, why=f"restart rollout: {why}{note}")
        t1 = time.perf_counter()
        path, version = target.checkpoint.local_path or "", target.version
        pid: int | None = None
        if h.managed is not None:
            how = "managed relaunch"
            try:
                pid = h.managed.relaunch(path, version, registry_expect(self.journal, target.checkpoint))
            except RuntimeError as exc:  # refused before the stop (files changed since verify): the old child serves
                if h.managed.alive():
                    raise driver.refused(h, rid, UpdateRefused(f"worker {h.name}: relaunch: {exc}"), t1) from None
                raise driver.fail(h, rid, "relaunch", f"worker {h.name}: relaunch: {exc}", t1) from None
            except OSError as exc:
                raise driver.fail(h, rid, "relaunch", f"worker {h.name}: relaunch: {exc}", t1) from None
        else:
            how = "restart_command"
            done = self.restarter.restart(h.spec, h.url, None, target.checkpoint)
            if not done.get("issued"):
                raise driver.fail(h, rid, "relaunch", f"worker {h.name}: relaunch: {done.get('error') or 'not issued'}", t1)
        if self._wait_up(h, version) is None:
            exited = h.managed is not None and not h.managed.alive()
            raise driver.fail(h, rid, "relaunch", f"worker {h.name}: relaunch: "
                              + ("the relaunched worker exited" if exited else
                                 f"not serving {version} {self.settings.restart_timeout_s:g} s after the relaunch"), t1)  # fmt: skip
        driver.move(h, rid, S.UPDATED, duration_ms=(time.perf_counter() - t1) * 1e3, version=version,
                    detail={"version": version, "how": how, "restart": why, **({"pid": pid} if pid else {})})  # fmt: skip
        log.info("worker_relaunched", worker=h.name, version=version, how=how, ms=round((time.perf_counter() - t0) * 1e3))
        driver.finish(h, rid, target, {"restart": True})

    def _wait_up(self, h: WorkerHandle, version: str) -> WeightInfo | None:
        deadline = time.monotonic() + self.settings.restart_timeout_s
        delay = 0.05
        while time.monotonic() < deadline:
            if h.managed is not None and not h.managed.alive():
                return None
            try:
                info = h.client.weight_info()
                if info.version == version and parse_state(info.state) == S.RUNNING:
                    return info
            except WorkerError:
                pass
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        return None


# -- the handover: a new managed child beside the old one (module docstring, "managed workers") ----

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


def start_beside(m: ManagedWorker, model: str, version: str, expect: Expect | None) -> Previous:
    """Launch the new child beside the running one. RuntimeError (nothing started) when `model`
    is missing or its files do not match `expect`."""
    problem = target_problem(model, expect)
    if problem is not None:
        raise RuntimeError(f"managed worker {m.spec.name}: not relaunched on {version}: {problem}")
    assert m.pid is not None
    prev = Previous(m.pid, m.proc, m.model, m.version, m.expect, *(p.read_bytes() if p.exists() else None
                                                                   for p in (m.token_file, m.runtime_file)))  # fmt: skip
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
