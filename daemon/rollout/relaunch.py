"""Restart rollouts: a verified version whose tensors cannot be written in place (other shapes,
names or dtypes than what the worker serves, e.g. a resized vocabulary) reaches a worker by
relaunching it on that version, in the worker's own turn of the ordinary rollout: the same
batches, `max_unavailable`, drain or pause, post-check, failure path and health window.

    RUNNING ─drain (readiness off, in-flight finish)──▶ DRAINING ─relaunch─▶ UPDATED ─post-check─▶ RUNNING
            └pause (managed, new connections wait)───▶ PAUSED

- managed workers: the daemon stops the child and starts it on the new directory, checked
  against its verified digests before the stop (a mismatch refuses the step with the old child
  still serving). The daemon holds the serving port's listening socket and hands it to each
  child (`--listen-fd`), so the port is never free and connections that arrive meanwhile wait in
  its backlog for the new child. In a "pause" group that backlog is the pause: the child stops
  accepting, finishes what it holds and exits; nothing is refused.
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

import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

from daemon.adapters.base import UpdateRefused, WeightInfo, WorkerError
from daemon.common.logging import get_logger
from daemon.config import RolloutMode, RolloutSettings
from daemon.formats.checkpoint import LayoutError, tensor_table
from daemon.formats.safetensors import HeaderError
from daemon.registry.journal import Journal
from daemon.rollout import handover
from daemon.rollout.handover import overlap_room, start_beside
from daemon.rollout.managed import Restarter
from daemon.rollout.stage import Target, registry_expect
from daemon.rollout.states import WorkerHandle, WorkerState, parse_state

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
        if h.managed is not None:
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
        if not handover.wait_ready(m, self.settings.restart_timeout_s):
            exited = not m.alive()
            tail = f"exited ({m.exit_code()})" if exited else f"was not ready {self.settings.restart_timeout_s:g} s after launch"
            handover.abandon(m, prev)
            return f"worker {h.name}: relaunch beside: the new worker on {version} {tail}; the old one serves on"
        driver.move(h, rid, S.PAUSED, duration_ms=(time.perf_counter() - t1) * 1e3, target_version=target.version,
                    detail={"mode": "beside", "restart": why, "how": "the new process started beside the old one and "
                            "serves on the same listening socket; the old one finishes what it holds and exits",
                            "old_pid": prev.pid, "pid": m.pid})  # fmt: skip
        t2 = time.perf_counter()
        stopped_s = handover.hand_over(m, prev)
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
