"""Watching the daemon's managed workers from launch (issue 16, "worker supervision").

A thread looks at every `launch = "managed"` worker a few times a second. A child just launched
(or relaunched by the rollout engine, or adopted) is LAUNCHING until its admin API answers
RUNNING (one found DRAINING or PAUSED, as a killed daemon left it, is resumed first); one that
exits first, or is not healthy within `restart_timeout_s`, has failed. A
failure is recorded at once through the state machine (UNHEALTHY, an `events` row with
`action = "launch_failed"`, or `action = "crashed"` for a worker that was healthy and died: no
launch failed, so the problem is `worker_crashed`, not `worker_launch_failed`) with `workers.last_error` = one line of cause, then the last lines
of that launch's log. The next launch waits `relaunch_backoff_s`, doubling per consecutive
failure up to `relaunch_backoff_max_s` (daemon/common/backoff.py); a worker healthy for
`relaunch_reset_s` starts again from the base.

What a (re)launch runs on: the serving version when its files are on this host and (after a
failure) still match their verified digests; else the newest good version that does, recorded
as `action = "fallback"` with why each newer one was skipped, after which the service makes it
serving (`on_fallback`). No usable version at all: nothing is launched, the worker is UNHEALTHY
with that reason, and the check is repeated on the same backoff.

The supervisor never touches a worker the rollout engine holds (`WorkerHandle.busy`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from daemon.common import Backoff, get_logger
from daemon.config import RolloutSettings
from daemon.engines import WeightInfo, WorkerError
from daemon.registry import CheckpointRef, Journal
from daemon.rollout import (
    FAILED,
    ManagedWorker,
    PortTaken,
    WorkerDriver,
    WorkerHandle,
    WorkerSet,
    WorkerState,
    parse_state,
    registry_expect,
    target_problem,
)
from daemon.transport import Expect, files_problem

log = get_logger(__name__)

TICK_S = 0.25
LOG_TAIL_LINES = 20
LOG_TAIL_BYTES = 64 * 1024


class Phase(StrEnum):
    IDLE = "idle"  # not launched by us (yet), or stopped
    LAUNCHING = "launching"  # alive, not yet healthy
    HEALTHY = "healthy"
    WAITING = "waiting"  # failed; the next launch is due at `retry_at`


@dataclass
class Watch:
    backoff: Backoff
    phase: Phase = Phase.IDLE
    since: float = 0.0  # monotonic time the phase began
    retry_at: float = 0.0
    launches_seen: int = 0
    error: str | None = None  # the failure reported while not healthy (daemon /health)
    fell_back: tuple[str, str] | None = None  # (wanted, using) of the launch being watched
    crashed: bool = False  # the failure is a healthy worker's death, not a launch's
    stat_only: bool = False  # the next launch follows a healthy worker's first crash: its files are only stat'ed


@dataclass(frozen=True, slots=True)
class Choice:
    """What to launch on: `model` None when nothing usable is on this host (`why` says so)."""

    model: str | None
    version: str | None = None
    checkpoint: CheckpointRef | None = None
    expect: Expect | None = None
    wanted: str | None = None  # the serving version, when it was skipped
    skipped: dict[str, str] = field(default_factory=dict)  # version -> why it cannot be launched


def log_tail(path: Path, offset: int = 0, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of `path` written from `offset` on ("" when there are none)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(offset, size - LOG_TAIL_BYTES, 0))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace").rstrip("\n")
    return "\n".join(text.splitlines()[-lines:]) if text else ""


def choose_launch(journal: Journal, default_model: str, deep: bool) -> Choice:
    """The serving version if it can be launched here, else the newest good one that can.

    `deep` (after a failed launch), and always for a version other than serving: the files are
    hashed against their verified digests too, not only found with the verified sizes, so changed
    bytes are skipped instead of launched (the worker would refuse them and exit)."""
    serving = journal.alias("serving")
    if serving is None:
        if default_model:
            return Choice(default_model)
        return Choice(None, skipped={"-": "the registry has no version and no `model` is configured"})
    skipped: dict[str, str] = {}
    for c in [serving, *journal.good_versions(exclude_ids=[serving.id])]:
        expect = registry_expect(journal, c)
        problem = files_problem(c.local_path, expect)
        if problem is None and (deep or c.id != serving.id) and c.local_path:
            problem = target_problem(c.local_path, expect)
        if problem is None and c.local_path:
            wanted = serving.version if c.id != serving.id else None
            return Choice(c.local_path, c.version, c, expect, wanted, skipped)
        skipped[c.version] = problem or "no local copy"
    if default_model and Path(default_model).is_dir():  # the configured `model`, as a last resort
        return Choice(default_model, wanted=serving.version, skipped=skipped)
    return Choice(None, wanted=serving.version, skipped=skipped)


def _describe_exit(m: ManagedWorker) -> str:
    if m.kill_reason:
        return f"the worker process was {m.kill_reason}"
    code = m.exit_code()
    if code is None:
        return "the worker process exited"
    if code < 0:
        return f"the worker process was killed by signal {-code}"
    return f"the worker process exited with status {code}"


class Supervisor:
    """`on_fallback(version)`: a managed worker now serves `version` instead of the serving one."""

    def __init__(
        self, journal: Journal, fleet: WorkerSet, driver: WorkerDriver, settings: RolloutSettings,
        on_fallback: Callable[[str], None] = lambda _v: None,
    ) -> None:  # fmt: skip
        self.journal, self.fleet, self.driver, self.settings = journal, fleet, driver, settings
        self.on_fallback = on_fallback
        self.handles = [h for h in fleet if h.managed is not None]
        self.watches = {h.name: Watch(self._backoff()) for h in self.handles}
        self._lock = threading.Lock()  # one tick at a time (thread and wait_settled)
        self._stop = threading.Event()
        self._wake = threading.Event()  # a child exited: tick now, not at the next TICK_S
        self._waited: set[int] = set()  # pids a thread waits on
        self.passes = 0  # ticks finished: what a caller waiting for "the next tick" counts
        self._thread: threading.Thread | None = None

    def _backoff(self) -> Backoff:
        s = self.settings
        return Backoff(s.relaunch_backoff_s, s.relaunch_backoff_max_s, s.relaunch_reset_s)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self.handles and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="supervise", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(TICK_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception:
                log.exception("supervise_tick_failed")
            self.passes += 1

    # -- what others ask ---------------------------------------------------------------------
    def launch(self, h: WorkerHandle) -> None:
        """Start-up: launch `h` on what `choose_launch` picks (the worker is then watched)."""
        with self._lock:
            self._launch(h, self.watches[h.name], time.monotonic())

    def wait_settled(self, h: WorkerHandle, timeout_s: float) -> bool:
        """Wait until `h` is healthy (True) or has failed / is not launched (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if self._thread is None:
                with self._lock:
                    self._tick_one(h, time.monotonic())
            w = self.watches[h.name]
            seen = h.managed is None or h.managed.launches == w.launches_seen
            # IDLE and meant to run: adopted at start-up and not looked at yet (not settled)
            adopted = h.managed is not None and h.managed.should_run and w.phase == Phase.IDLE
            if seen and w.phase != Phase.LAUNCHING and not adopted:
                return w.phase == Phase.HEALTHY
            time.sleep(TICK_S / 2)
        return False

    def owns(self, h: WorkerHandle) -> bool:
        """True while `h` is launching or failed: its `workers` row is the supervisor's to write."""
        w = self.watches.get(h.name)
        return w is not None and w.phase in (Phase.LAUNCHING, Phase.WAITING)

    def launch_problems(self) -> list[tuple[str, str]]:
        """(worker, first line of the cause) per managed worker whose launch failed and that is not
        healthy again."""
        return [(name, (w.error or "").splitlines()[0]) for name, w in self._failing() if not w.crashed]

    def crash_problems(self) -> list[tuple[str, str]]:
        """(worker, first line of the cause) per managed worker that died while healthy and is being
        relaunched (no launch has failed since)."""
        return [(name, (w.error or "").splitlines()[0]) for name, w in self._failing() if w.crashed]

    def _failing(self) -> list[tuple[str, Watch]]:
        return [(name, w) for name, w in self.watches.items()
                if w.phase in (Phase.WAITING, Phase.LAUNCHING) and w.error]  # fmt: skip

    # -- the watch ---------------------------------------------------------------------------
    def tick(self) -> None:
        with self._lock:
            now = time.monotonic()
            for h in self.handles:
                if not h.busy.acquire(blocking=False):
                    continue  # the engine drives it; a relaunch it made is seen next tick
                try:
                    self._tick_one(h, now)
                finally:
                    h.busy.release()

    def _tick_one(self, h: WorkerHandle, now: float) -> None:
        m, w = h.managed, self.watches[h.name]
        assert m is not None
        w.backoff.configure(self.settings.relaunch_backoff_s, self.settings.relaunch_backoff_max_s,
                            self.settings.relaunch_reset_s)  # fmt: skip
        if m.launches != w.launches_seen:  # launched since we last looked (here, or by the engine)
            w.launches_seen, w.phase, w.since = m.launches, Phase.LAUNCHING, now
            self._watch_exit(m)
        if not m.should_run:
            w.phase = Phase.IDLE
            return
        if w.phase == Phase.WAITING:
            if now >= w.retry_at:
                self._launch(h, w, now)
            return
        if w.phase == Phase.IDLE:  # adopted at start-up: watched like a launch
            w.phase, w.since = Phase.LAUNCHING, now
        if not m.alive():
            if w.phase == Phase.HEALTHY:  # it served: no launch failed
                self._crashed(h, w, now)
                return
            self._failed(h, w, now, _describe_exit(m))
            return
        if w.phase == Phase.HEALTHY:
            w.backoff.healthy_for(now - w.since)
            return
        info = None
        with contextlib.suppress(WorkerError):
            info = self._in_rotation(h, h.client.weight_info())
        if info is not None and parse_state(info.state) == WorkerState.RUNNING:
            self._healthy(h, w, now, info.version, info.device)
        elif now - w.since > self.settings.restart_timeout_s:
            m.stop()
            m.should_run = True  # stopped by us to relaunch it, not by the operator
            self._failed(h, w, now, f"the worker was not healthy {self.settings.restart_timeout_s:g} s after launch")

    def _in_rotation(self, h: WorkerHandle, info: WeightInfo) -> WeightInfo:
        """A worker adopted DRAINING or PAUSED (a daemon killed mid-update left it so; nothing moves it
        now: the supervisor holds `busy`) is whole (an update that fails mid-write reports UNHEALTHY)
        and serves nobody: resume it. Waiting for RUNNING instead kept a lone worker out of rotation
        for `restart_timeout_s` (the fault matrix's 194 s)."""
        if parse_state(info.state) not in (WorkerState.DRAINING, WorkerState.PAUSED):
            return info
        log.warning("worker_resumed", worker=h.name, was=info.state, version=info.version,
                    reason="adopted out of rotation with no rollout moving it")  # fmt: skip
        h.client.resume()
        return h.client.weight_info()

    def _healthy(self, h: WorkerHandle, w: Watch, now: float, version: str | None, device: str | None) -> None:
        assert h.managed is not None
        w.phase, w.since, w.error = Phase.HEALTHY, now, None
        fell_back, w.fell_back = w.fell_back, None
        note = f"serving {fell_back[1]}: {fell_back[0]} cannot be launched on this host" if fell_back else None
        if h.state in FAILED:
            self.driver.move(h, None, WorkerState.RUNNING, duration_ms=None, version=version, error=note,
                             detail={"action": "launched", "pid": h.managed.pid, "launch": h.managed.launches,
                                     **({"fell_back_from": fell_back[0]} if fell_back else {})})  # fmt: skip
        else:
            self.journal.observe(h.name, state=WorkerState.RUNNING.value, weight_version=version, error=note,
                                 device=device)  # fmt: skip
            h.observed(WorkerState.RUNNING)
        log.info("managed_worker_healthy", worker=h.name, version=version, pid=h.managed.pid)
        if fell_back is not None and version == fell_back[1]:
            self.on_fallback(fell_back[1])

    def _watch_exit(self, m: ManagedWorker) -> None:
        """A thread that waits on the child and wakes the supervisor the moment it exits (a crash
        is seen at once, not at the next tick)."""
        proc = m.proc
        if proc is None or proc.pid in self._waited:
            return
        self._waited.add(proc.pid)

        def wait() -> None:
            with contextlib.suppress(Exception):
                proc.wait()
            self._waited.discard(proc.pid)
            self._wake.set()

        threading.Thread(target=wait, name=f"supervise-wait-{proc.pid}", daemon=True).start()

    def _crashed(self, h: WorkerHandle, w: Watch, now: float) -> None:
        """A worker that was healthy died (kill -9, OOM, a segfault): recorded as a failure, and
        relaunched at once when it is the first since it was last healthy for relaunch_reset_s (a
        crash loop waits relaunch_backoff_s, doubling, as launch failures do). The relaunch only
        stats the serving version's files: the child itself checks every byte it loads against
        the verified digests (--expect-file), and a mismatch fails that launch, after which the
        next one hashes them here (choose_launch deep)."""
        first = w.backoff.failures == 0
        cause = (_describe_exit(h.managed) if h.managed is not None else "exited") + " while serving"
        self._failed(h, w, now, cause, crashed=True, at_once=first)
        if first:
            w.stat_only = True
            self._launch(h, w, now)

    def _failed(self, h: WorkerHandle, w: Watch, now: float, cause: str, *, crashed: bool = False,
                at_once: bool = False) -> None:
        m = h.managed
        assert m is not None
        delay = 0.0 if at_once else w.backoff.failed()
        if at_once:
            w.backoff.failures += 1  # counted: a second crash before relaunch_reset_s waits relaunch_backoff_s
        tail = log_tail(m.log_file, m.log_offset)
        when = "relaunched at once" if at_once else f"relaunch in {delay:g} s"
        self._unhealthy(h, w, f"{cause}; {when} (failure {w.backoff.failures})", tail, {
            "action": "crashed" if crashed else "launch_failed", "cause": cause, "exit_code": m.exit_code(), "version": m.version,
            "log_file": str(m.log_file), "log_tail": tail, "retry_in_s": delay, "failures": w.backoff.failures,
        })  # fmt: skip
        w.phase, w.since, w.retry_at, w.fell_back = Phase.WAITING, now, now + delay, None

    def _unhealthy(
        self, h: WorkerHandle, w: Watch, line: str, tail: str, detail: dict[str, Any], after: str | None = None
    ) -> None:
        """`after`: the failure this follows (kept under the new line, so its log lines stay in view)."""
        assert h.managed is not None
        error = line + (f"\n--- last lines of {h.managed.log_file} ---\n{tail}" if tail else "")
        error += f"\nafter: {after}" if after else ""
        w.error = error
        if detail.get("action") != "fallback":  # a fallback follows the failure it names: its kind stays
            w.crashed = detail.get("action") == "crashed"
        log.error("managed_worker_crashed" if w.crashed else "managed_worker_failed", worker=h.name, error=line, log_file=str(h.managed.log_file))
        self.driver.move(h, None, WorkerState.UNHEALTHY, duration_ms=None, detail=detail, error=error)

    def _launch(self, h: WorkerHandle, w: Watch, now: float) -> None:
        m = h.managed
        assert m is not None
        stat_only, w.stat_only = w.stat_only, False
        choice = choose_launch(self.journal, h.spec.model, deep=w.backoff.failures > (1 if stat_only else 0))
        if choice.model is None:
            delay = w.backoff.failed()
            why = "; ".join(f"{v}: {p}" for v, p in choice.skipped.items())
            line = f"no version can be launched on this host ({why}); checked again in {delay:g} s"
            if w.error is None or w.error.splitlines()[0].split("; checked again")[0] != line.split("; checked again")[0]:
                self._unhealthy(h, w, line, "", {"action": "no_launch_target", "skipped": choice.skipped,
                                                 "retry_in_s": delay})  # fmt: skip
            w.phase, w.since, w.retry_at = Phase.WAITING, now, now + delay
            m.should_run = True  # still meant to run: launched once something usable is back
            return
        if choice.wanted is not None:
            using = choice.version or choice.model
            detail = {"action": "fallback", "wanted": choice.wanted, "using": using, "skipped": choice.skipped}
            line = (f"{choice.wanted} cannot be launched on this host ({choice.skipped.get(choice.wanted)}); "
                    f"launching {using}, the newest good version that can")  # fmt: skip
            log.warning("managed_worker_fallback", worker=h.name, **detail)
            self._unhealthy(h, w, line, "", detail, after=w.error)
            w.fell_back = (choice.wanted, choice.version) if choice.version else None
        try:
            if m.alive():
                m.stop()
            m.launch(choice.model, choice.version, choice.expect)
        except (PortTaken, OSError) as exc:
            delay = w.backoff.failed()
            line = f"not launched: {exc}; tried again in {delay:g} s"
            if isinstance(exc, PortTaken):  # something else answers on its port: not our worker at all
                w.error, w.crashed = line, False
                log.error("managed_worker_port_taken", worker=h.name, error=line)
                self.journal.observe(h.name, state="UNREACHABLE", weight_version=None, error=line)
                h.observed(None)
            else:
                self._unhealthy(h, w, line, "", {"action": "launch_failed", "cause": str(exc), "retry_in_s": delay})
            w.phase, w.since, w.retry_at = Phase.WAITING, now, now + delay
            m.should_run = True
            return
        w.launches_seen, w.phase, w.since = m.launches, Phase.LAUNCHING, now
