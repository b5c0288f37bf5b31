"""Fleet mode: many hosts on one PostgreSQL registry, each rolling out under a fleet-wide lease.

- `LeasedEngine`: the rollout engine that moves workers only inside a lease slot
  (`daemon.fleet.lease`): at most `[fleet] max_updating_hosts` hosts move workers at once.
- the fleet target (`daemon.fleet.target`): what late joiners converge to.
- `FleetAgent.tick` (every `[fleet] poll_s`): when this host serves something older than the
  target, has the target's bytes here, is not pinned and is idle, it asks the rollout service to
  converge (a rollout with trigger `fleet`, under the lease like any other). A version some host
  verified but no host finished deploying (its registering host may have died mid-rollout) is
  deployed here as a new version (with its health window), once this host has its own copy.
- staged rollouts (`daemon.fleet.stages`, when `[fleet] stages` is set): each tick first takes a
  decision pass (any host may: one decides), then a host follows the stage it is in: an admitted
  host converges to the version (with its health window), the others stay on the previous fleet
  version, and hosts on a halted or aborted version go back to it. The rollout service asks
  `admits` before it deploys a version this host verified itself.
- `FleetAgent.behind` (every tick): why this host is not on the target, if it is not
  (`daemon.fleet.behind`): the daemon's `host_behind` warning (`FleetAgent.problems`, a probe
  of its health monitor) and this host's row of `fleet_host_reasons`, written when it changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from daemon.common import Problem, get_logger
from daemon.fleet import behind as why
from daemon.fleet import stages, trust
from daemon.fleet.lease import FleetLeases, holders
from daemon.fleet.settings import FleetSettings
from daemon.fleet.target import Target, fleet_mark, fleet_target
from daemon.registry import CheckpointRef, CheckpointStatus, Journal
from daemon.rollout import RolloutEngine, newer, newest

log = get_logger(__name__)
SETTLED = frozenset({"updating", "waiting", "converging", "busy"})  # behind, and nothing to do but wait
FULL_LOOK_S = 300.0  # a host in sync with nothing changed still looks in full this often
RETRY_S = 30.0  # a converge that did not reach the target is tried again after this long


class LeasedEngine(RolloutEngine):
    """Every rollout waits for a fleet lease slot before a worker leaves RUNNING (its staging is
    done while it waits), renews it while workers move and releases it once they are back."""

    leases: FleetLeases
    stopping: Callable[[], bool]

    @contextmanager
    def slot(self, ckpt: CheckpointRef, stop_waiting: Callable[[], bool]) -> Iterator[Callable[[], bool] | None]:
        # Only the part that takes workers out of rotation holds the slot: the rollout's row, its
        # staging and its outcome are written while waiting or after releasing, so a slot is free
        # again as soon as this host's workers are back (issue 28: those writes inside the hold
        # made each 2 s slot up to 0.25 s longer at 1,000 hosts).
        with self.leases.held(ckpt.version, ckpt.id, lambda: self.stopping() or stop_waiting()) as slot:
            # a lost slot (another host took it after an expiry) stops at the next batch boundary
            yield None if slot is None else (lambda: self.leases.lost)


@contextmanager
def holding(leases: FleetLeases | None, ckpt: CheckpointRef, stop: Callable[[], bool]) -> Iterator[None]:
    """A block that moves workers outside a rollout (crash recovery at start) under a lease too."""
    with leases.held(ckpt.version, ckpt.id, stop) if leases is not None else nullcontext():
        yield


def leased(engine: RolloutEngine, leases: FleetLeases, stopping: Callable[[], bool]) -> LeasedEngine:
    """`engine` as a LeasedEngine (same journal, fleet, driver and stager)."""
    out = LeasedEngine(engine.journal, engine.fleet, engine.settings, engine.driver, engine.stager)
    out.leases, out.stopping = leases, stopping
    out.before_workers = engine.before_workers
    return out


class FleetAgent:
    """Moves this host to the fleet target when it is behind (see the module docstring)."""

    def __init__(self, journal: Journal, settings: FleetSettings, *, idle: Callable[[], bool],
                 pinned: Callable[[], str | None], converge: Callable[[str], object],
                 submit: Callable[[int], object]) -> None:  # fmt: skip
        self.journal = journal
        self.settings = settings
        self.idle, self.pinned, self.converge, self.submit = idle, pinned, converge, submit
        self._tried: dict[str, float] = {}
        self._fetched: dict[str, float] = {}
        # set by the daemon (Coordinator.fetch_here): fetch this host's copy of a checkpoint id
        self.fetch: Callable[[int], bool] | None = None
        # set by the daemon: the job this host's rollout service runs now ("deploy v3"), if any
        self.doing: Callable[[], str | None] = lambda: None
        self._missing_logged: set[str] = set()
        self._attempt: why.Attempt | None = None  # the last converge asked for, and its Future
        self.behind: why.Behind | None = None  # why this host is not on the fleet target (last tick)
        self._recorded: object = ()  # what fleet_host_reasons holds for this host (() = not written yet)
        self._plan: stages.HostStage | None = None  # the staged rollout as this tick read it
        self._plan_read = False  # outside a tick: read it when asked
        self._quiet: tuple[Any, ...] | None = None  # fleet_mark at the last look that found this host in sync
        self._looked = -FULL_LOOK_S  # time.monotonic() of the last full look
        self._staging = False  # a staged rollout was in progress at the last look
        self.trust = trust.Trust.from_file(settings.signing_key)  # how decisions are signed and checked
        self.stall = trust.Stall()  # polls in a row a due decision waited for a lock held elsewhere
        self.refused: list[str] = []  # forged admissions or target seen at the last look
        self.looks = 0  # full looks taken (a test's positive signal that a tick happened)

    def wanted(self) -> tuple[CheckpointRef, bool] | None:
        """What this host should do now: (version, True) converge to the fleet target, (version,
        False) deploy a version the fleet verified that no host has finished yet; else None."""
        if self.pinned() is not None:
            return None
        serving = self.journal.alias("serving")
        target, plan = self.target(serving)
        if target is not None:
            ckpt = target.checkpoint
            if serving is None or (serving.id != ckpt.id and (target.explicit or newer(ckpt, serving))):
                return (ckpt, True) if self._here(ckpt) else None
            if target.explicit:
                return None  # an operator's target holds the fleet there
        if plan is not None and plan.state in stages.ACTIVE:
            return None  # a staged rollout decides who deploys its version, and nothing else moves
        # verified by some host (maybe one that died rolling it out) and not deployed anywhere yet
        waiting = newest([c for c in self.journal.waiting() if serving is None or newer(c, serving)])
        return (waiting, False) if waiting is not None and self._here(waiting) else None

    def target(self, serving: CheckpointRef | None) -> tuple[Target | None, stages.HostStage | None]:
        """The fleet target for this host, with the staged rollout in progress (if any) applied."""
        target = fleet_target(self.journal, self.trust)
        if target is not None and target.explicit:
            return target, None  # an operator's target holds the fleet, stages or not
        plan = self._plan if self._plan_read else stages.for_host(self.journal, self.journal.registry.host, self.trust)
        if plan is None:
            return target, None
        if plan.state in stages.ACTIVE and plan.version.status != CheckpointStatus.REJECTED:
            if plan.admitted and plan.state == "running":
                return Target(plan.version, True, staged=True), plan
            on = serving is not None and serving.id == plan.version.id
            if on or plan.previous is None:
                return None, plan  # admitted before a pause, or nothing to hold to: stay
            return Target(plan.previous, False, staged=True), plan
        if serving is not None and serving.id == plan.version.id and plan.previous is not None:
            return Target(plan.previous, True, staged=True), plan  # halted or aborted: back to the previous version
        return target, plan

    def admits(self, ckpt: CheckpointRef) -> bool:
        """May this host deploy `ckpt`, which it verified itself (begins its staged rollout)?"""
        if self.pinned() is not None:
            return True  # the rollout service holds it anyway; nothing to decide
        target = fleet_target(self.journal, self.trust)
        previous = target.checkpoint if target is not None and newer(ckpt, target.checkpoint) else None
        ok = stages.admitted(self.journal, ckpt, self.settings, previous, self.trust)
        if not ok:
            log.info("fleet_stage_holds", version=ckpt.version, host=self.journal.registry.host)
        return ok

    def staged(self, ckpt: CheckpointRef) -> bool:
        """`ckpt` is the version of the staged rollout in progress: converging to it runs a health window."""
        plan = stages.for_host(self.journal, self.journal.registry.host, self.trust)
        return plan is not None and plan.state in stages.ACTIVE and plan.version.id == ckpt.id

    def _here(self, ckpt: CheckpointRef) -> bool:
        if ckpt.local_path and Path(ckpt.local_path).is_dir():
            return True
        now = time.monotonic()
        if self.fetch is not None and now - self._fetched.get(ckpt.version, -RETRY_S) >= RETRY_S:
            self._fetched[ckpt.version] = now
            if self.fetch(ckpt.id):  # its source brings this host's own copy (S3, a shared folder)
                return True
        if ckpt.version not in self._missing_logged:
            self._missing_logged.add(ckpt.version)
            log.warning("fleet_version_not_on_this_host", version=ckpt.version, host=self.journal.registry.host)
        return False

    def tick(self) -> str | None:
        """One look: converge (or deploy) when wanted, then note why this host is behind, if it
        is. The version asked for, if any. A host that was in sync at its last look, or already on
        its way (SETTLED), with nothing it depends on changed since (`fleet_mark`: one statement,
        and its converge still running or not), has nothing to decide; it looks in full at least
        every FULL_LOOK_S all the same."""
        mark = self._mark()
        if mark is not None and mark == self._quiet and time.monotonic() - self._looked < FULL_LOOK_S:
            return None
        self._looked = time.monotonic()
        asked = self._look()
        # in sync, or moving already (its converge waits for a slot, runs, or waits behind another job):
        # nothing to decide until something in the mark changes (the converge ending changes it)
        settled = self.behind is None or self.behind.cause in SETTLED
        quiet = asked is None and settled and not self._staging and self.pinned() is None
        self._quiet = mark if quiet else None
        return asked

    def _mark(self) -> tuple[Any, ...] | None:
        try:
            running = self._attempt is not None and self._attempt.running()
            return (self.pinned(), self.idle(), running, *fleet_mark(self.journal.registry))
        except Exception as exc:  # noqa: BLE001 - a database blip: a full look says what is wrong
            log.warning("fleet_mark_failed", error=str(exc))
            return None

    def _look(self) -> str | None:
        self.looks += 1
        host = self.journal.registry.host
        try:
            # one read of the staged rollout per tick (none in progress: that one query is all it costs)
            self._plan, self._plan_read = stages.for_host(self.journal, host, self.trust), True
            self._staging = self._plan is not None and self._plan.state in stages.ACTIVE  # its passes go on each tick
            due: list[str] = []
            if self._plan is not None and self._plan.state in stages.ACTIVE:
                if stages.step(self.journal, trust=self.trust, blocked=due):
                    self._plan = stages.for_host(self.journal, host, self.trust)  # it moved: read again
                self._note_stall(due)
            else:
                self.stall.observe(None, [], "")
            self._refusals()
        except Exception as exc:  # noqa: BLE001 - a database blip: the next tick (here or elsewhere) decides
            log.warning("fleet_stage_step_failed", error=str(exc))
        try:
            asked = self._act() if self.idle() else None
            try:
                self.observe()
            except Exception as exc:  # noqa: BLE001 - a database blip: the next tick looks again
                log.warning("fleet_observe_failed", error=str(exc))
        finally:
            self._plan, self._plan_read = None, False
        return asked

    def _note_stall(self, due: list[str]) -> None:
        """A decision due while another session holds the lock: after STALL_POLLS polls, a problem
        here and a line on the rollout's row (`status --fleet`, `fleet rollout status`)."""
        plan = self._plan
        assert plan is not None
        before = self.stall.reason
        mark = (plan.rollout_id, plan.stage, plan.state)
        reason = self.stall.observe(mark, due, f"staged rollout of {plan.version.version}, stage {plan.stage}")
        if reason is not None and (before is None or plan.stalled is None):
            stages.note_stalled(self.journal.registry, plan.rollout_id, reason)
            log.warning("fleet_stalled", rollout_id=plan.rollout_id, reason=reason)

    def _refusals(self) -> None:
        with self.journal.registry.session() as s:
            _, target = trust.refused_target(s, self.trust)
        self.refused = [*(self._plan.refused if self._plan is not None else ()), *([target] if target else [])]

    def observe(self) -> why.Behind | None:
        """Why this host is not on the fleet target now (None: it is, or it is ahead of it)."""
        serving = self.journal.alias("serving")
        target, _ = self.target(serving)
        behind = None
        if why.is_behind(target, serving):
            assert target is not None
            t = target.checkpoint
            running = self._attempt is not None and self._attempt.running()
            behind = why.explain(target, serving, pinned=self.pinned(), doing=self.doing(), attempt=self._attempt,
                                 here=bool(t.local_path and Path(t.local_path).is_dir()),
                                 leases=holders(self.journal.registry) if running else [],
                                 host=self.journal.registry.host, slots=self.settings.max_updating_hosts)  # fmt: skip
        self.behind = behind
        if behind != self._recorded:
            why.record(self.journal.registry, behind)
            self._recorded = behind
            if behind is not None:
                log.info("fleet_behind", target=behind.target, cause=behind.cause, reason=behind.reason)
        return behind

    def problems(self) -> list[Problem]:
        """The daemon's `host_behind`, `fleet_stalled` and `fleet_decision_refused` warnings (a probe
        of daemon.process.health.HealthMonitor)."""
        host = self.journal.registry.host
        return why.problem(host, self.behind) + trust.problems(host, self.stall.reason, self.refused)

    def _act(self) -> str | None:
        wanted = self.wanted()
        if wanted is None:
            return None
        ckpt, converge = wanted
        now = time.monotonic()
        if now - self._tried.get(ckpt.version, -RETRY_S) < RETRY_S:
            return None
        self._tried[ckpt.version] = now
        log.info("fleet_converge" if converge else "fleet_deploy_verified", version=ckpt.version,
                 host=self.journal.registry.host)  # fmt: skip
        if converge:
            self._attempt = why.Attempt(ckpt.version, self.converge(ckpt.version))
        else:
            self.submit(ckpt.id)
        return ckpt.version
