"""What the controller sees wrong with this host's workers and rollouts, as problems (daemon.common.problems).

Read from the controller's own observation on every pass, never from a memory of events:

    no_worker_serving       critical  a group none of whose workers serves: none RUNNING, and none
                                      held PAUSED by an update for less than PAUSE_SERVES_S (a
                                      paused worker keeps its requests; one hung inside its update,
                                      SIGSTOPped say, keeps them forever); a managed worker whose
                                      process is gone serves nobody, whatever it last reported
    worker_launch_failed    critical  a managed worker that failed to launch and is not healthy again
    worker_crashed          warning   a managed worker that died while serving, being relaunched
                                      (the host's outage, if any, is no_worker_serving)
    adapter_not_on_base     warning   a LoRA adapter unloaded because it failed its re-verify on the
                                      new serving base (daemon.controller.adapter_base); ends when a
                                      version of it serves again
    worker_out_of_rotation  warning   a worker not RUNNING that no rollout is driving
    worker_stuck            warning   a worker a rollout has held in one state for longer than the
                                      steps that state can take allow (STEP_BOUNDS)
    health_poll_skipped     warning   several health poll passes in a row skipped: the previous still ran
    rollout_failed          warning   the host's last finished rollout failed or was rolled back
                                      (clears when a later one succeeds)
    gate_cannot_run         warning   a gate of a version on trial that cannot run (Prometheus down,
                                      command missing): the version waits on trial (daemon.gates)

The times come from the worker handles (when each last changed state and left RUNNING): that is
observation (a worker's position over time), not an event the probe must not miss.
"""

from __future__ import annotations

import time
from typing import Protocol

from sqlalchemy import select

from daemon.common import WARNING, Problem
from daemon.config import RolloutSettings
from daemon.registry import Checkpoint, Journal, Registry, Rollout
from daemon.rollout import WorkerHandle, WorkerSet, WorkerState, registry_expect
from daemon.transport import files_problem

HELD_BY_UPDATE = (WorkerState.PAUSED, WorkerState.UPDATED)  # paused requests wait; none is refused
# A pause longer than this is an outage to its clients (requests wait, unanswered): the reference
# worker's pause is milliseconds (ipc) to under a second (disk, 8B); a hung worker's is forever.
PAUSE_SERVES_S = 1.0
FAILED_OUTCOMES = ("failed", "rolled_back")


class Launches(Protocol):
    def launch_problems(self) -> list[tuple[str, str]]: ...
    def crash_problems(self) -> list[tuple[str, str]]: ...


class Controlled(Protocol):
    """What the probe reads of the controller (daemon.controller.service.RolloutService)."""

    @property
    def fleet(self) -> WorkerSet: ...
    @property
    def journal(self) -> Journal: ...
    @property
    def settings(self) -> RolloutSettings: ...
    @property
    def supervisor(self) -> Launches: ...

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    def adapter_problems(self) -> list[tuple[str, str]]: ...
    def gate_problems(self) -> list[tuple[str, str]]: ...


class WorkerProbe:
    def __init__(self, service: Controlled) -> None:
        self.service = service

    def problems(self) -> list[Problem]:
        s = self.service
        groups: dict[str, list[WorkerHandle]] = {}
        for h in s.fleet:
            groups.setdefault(h.spec.group, []).append(h)
        out = []
        for group, handles in sorted(groups.items()):
            if not any(self._serves(h) for h in handles):
                states = ", ".join(f"{h.name} {_state(h)}" for h in handles)
                out.append(Problem("no_worker_serving", group, f"no worker of group {group!r} serves ({states})"))
        if not s.wait_ready(0):
            return out  # start-up: where its workers are is being found out; only "serving" is known
        poller = getattr(s, "poller", None)  # passes skipped in a row (daemon/controller/poll.py)
        if poller is not None:
            out += poller.problems()
        launch = dict(s.supervisor.launch_problems())
        out += [Problem("worker_launch_failed", name, why) for name, why in launch.items()]
        crashed = dict(s.supervisor.crash_problems())
        out += [Problem("worker_crashed", name, why, WARNING) for name, why in crashed.items()]
        launch.update(crashed)
        out += [Problem("adapter_not_on_base", name, why, WARNING) for name, why in s.adapter_problems()]
        out += [Problem("gate_cannot_run", name, why, WARNING) for name, why in s.gate_problems()]
        now = time.monotonic()
        for h in s.fleet:
            if h.state is WorkerState.RUNNING or h.name in launch:
                continue  # a launch failure is said above, with its cause
            if not h.driven:
                out.append(Problem("worker_out_of_rotation", h.name,
                                   f"{_state(h)} and no rollout is moving it", WARNING))  # fmt: skip
                continue
            bound = step_bound(s.settings, h.state)
            if now - h.changed_at > bound:
                out.append(Problem("worker_stuck", h.name,
                                   f"held {_state(h)} by a rollout for {now - h.changed_at:.0f} s "
                                   f"(the steps of that state allow {bound:.0f} s)", WARNING))  # fmt: skip
        return out

    @staticmethod
    def _serves(h: WorkerHandle) -> bool:
        return serves(h)


def serves(h: WorkerHandle) -> bool:
    """`h` answers its clients now: RUNNING, or held briefly by an update (its requests wait)."""
    if _gone(h):
        return False  # killed inside an update, say: the engine and the supervisor learn it later
    if h.state is WorkerState.RUNNING:
        return True
    return h.state in HELD_BY_UPDATE and h.driven and time.monotonic() - h.left_running_at <= PAUSE_SERVES_S


def groups_serving(fleet: WorkerSet) -> dict[str, list[str]]:
    """group -> the names of its workers that serve now (an empty list: none does)."""
    out: dict[str, list[str]] = {}
    for h in fleet:
        out.setdefault(h.spec.group, [])
        if serves(h):
            out[h.spec.group].append(h.name)
    return out


def step_bound(st: RolloutSettings, state: WorkerState | None) -> float:
    """How long a rollout may hold a worker in `state`: the timeouts of the steps taken in it
    (each admin call is bounded by request_timeout_s), not the sum of every step's."""
    call = st.request_timeout_s
    if state is WorkerState.DRAINING:  # the drain, then (drain mode) the transfer in it
        return st.drain_timeout_s + st.update_timeout_s + 2 * call
    if state is WorkerState.PAUSED:  # the transfer
        return st.update_timeout_s + 2 * call
    if state is WorkerState.UPDATED:  # the post-check: weight_info, a probe, resume
        return 3 * call
    return st.restart_timeout_s + 2 * call  # failed: restore, else restart and wait for it


def _gone(h: WorkerHandle) -> bool:
    """A managed worker launched (or adopted) whose process is no longer there (a poll of the child)."""
    return h.managed is not None and h.managed.pid is not None and not h.managed.alive()


def _state(h: WorkerHandle) -> str:
    said = h.state.value if h.state is not None else "no answer"
    return f"{said}, its process gone" if _gone(h) else said


def last_rollout_problem(journal: Journal) -> Problem | None:
    """The host's newest finished rollout, when it failed (rolled back, or left workers restored)."""
    reg = journal.registry
    with reg.session() as s:
        row = s.execute(
            select(Rollout.id, Rollout.outcome, Rollout.detail, Checkpoint.version)
            .join(Checkpoint, Checkpoint.id == Rollout.checkpoint_id)
            .where(Rollout.host == reg.host, Rollout.outcome.is_not(None), Rollout.outcome != "superseded")
            .order_by(Rollout.id.desc()).limit(1)
        ).first()  # fmt: skip
    if row is None or row.outcome not in FAILED_OUTCOMES:
        return None
    detail = row.detail or {}
    why = str(detail.get("reason") or detail.get("error") or row.outcome)
    return Problem("rollout_failed", reg.host,
                   f"rollout {row.id} of {row.version} {row.outcome}: {' '.join(why.split())[:300]}", WARNING)  # fmt: skip


def alias_problems(registry: Registry, names: tuple[str, ...] = ("serving", "last_good", "pinned")) -> dict[str, str]:
    """Why an alias's version could not be deployed on this host now (a stat of its verified
    files): e.g. a pinned version whose directory was deleted, which no rollout can reach."""
    journal = Journal(registry)
    out: dict[str, str] = {}
    for name in names:
        ref = journal.alias(name)
        problem = files_problem(ref.local_path, registry_expect(journal, ref)) if ref is not None else None
        if problem:
            out[name] = problem
    return out
