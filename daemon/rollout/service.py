"""The rollout service: the one object the daemon talks to for "roll this out" and manual control.

One runner thread does everything that moves workers, in order: start-up (launch managed
workers, then crash recovery), then jobs from the queue: operator commands first (rollback,
pin, unpin, reconcile), then the newest waiting checkpoint. A periodic health poll (on the
daemon's scheduler) keeps `workers` current. What the runner decided (serving, pinned, the job
in progress, a version held back for unavailable workers) is one `RolloutState`, guarded by a
lock, read by the API and the poll threads.

    service = RolloutService.from_config(config, registry)
    service.start(scheduler)
    coordinator.on_verified = service.submit

One module on purpose, though long: every job runs on the one runner thread over the one
RolloutState, and splitting the jobs out (as commands/poll/startup once were) made modules
that import the service back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

from apscheduler.schedulers.base import BaseScheduler

from daemon.adapters import make_client
from daemon.adapters.base import Timeouts, WorkerError
from daemon.config import Config, ConfigError, LoaderSettings, RolloutSettings, WorkerSpec
from daemon.fleet import FleetAgent, holding, leased
from daemon.fleet_config import FleetSettings
from daemon.fleet_lease import FleetLeases
from daemon.logging import get_logger
from daemon.registry.db import Registry
from daemon.registry.journal import CheckpointRef, Journal, RolloutRef
from daemon.registry.models import WORKER_STATES
from daemon.registry.status import (
    DEPLOYABLE,
    WAITING,
    CheckpointStatus,
    FailureKind,
    RolloutOutcome,
    RolloutTrigger,
)
from daemon.rollout import health
from daemon.rollout.attribution import attribute
from daemon.rollout.driver import WorkerDriver
from daemon.rollout.engine import RolloutEngine, RolloutResult
from daemon.rollout.managed import ManagedWorker, Restarter, ensure_seed
from daemon.rollout.planner import newer, newest
from daemon.rollout.queue import CommandError, Job, JobKind, RolloutQueue, RolloutState
from daemon.rollout.recovery import Recovery, check_worker, fleet_version, recover_uncertain
from daemon.rollout.stage import Stager, registry_expect
from daemon.rollout.states import Fleet, TransitionObserver, WorkerHandle, WorkerState, parse_state
from daemon.supervise import Supervisor
from daemon.transport.base import SenderOptions

log = get_logger(__name__)
C, T = CheckpointStatus, RolloutTrigger

LOOKAHEAD_MAX_S = 600.0  # longest wait for newer checkpoints still being verified
MOVES_FLEET: tuple[JobKind, ...] = ("rollback", "pin")  # operator commands that redeploy every worker


class RolloutService:
    def __init__(
        self,
        registry: Registry,
        settings: RolloutSettings,
        workers: list[WorkerSpec],
        state_dir: Path,
        loader: LoaderSettings | None = None,
        observers: Iterable[TransitionObserver] = (),
        restarter: Restarter | None = None,
        fleet: FleetSettings | None = None,
    ) -> None:
        self.settings = settings
        self.state_dir = state_dir
        self.journal = Journal(registry)
        timeouts = Timeouts(settings.request_timeout_s, settings.update_timeout_s, settings.drain_timeout_s)
        handles = []
        for spec in workers:
            managed = ManagedWorker(spec, state_dir) if spec.launch == "managed" else None
            url = managed.url if managed else spec.url.rstrip("/")
            token_file = str(managed.token_file) if managed else spec.token_file
            client = make_client(spec.kind, spec.name, managed.admin_url if managed else url,
                                 token_file=token_file or None, timeouts=timeouts, options=spec.engine_options())
            if settings.transport not in client.capabilities.transports:
                raise ConfigError(f"[[workers]] {spec.name}: kind {spec.kind!r} takes transport "
                                  f"{' or '.join(map(repr, client.capabilities.transports))}, not "
                                  f"[rollout].transport = {settings.transport!r}")  # fmt: skip
            handles.append(WorkerHandle(spec=spec, client=client, url=url, managed=managed))
        self.fleet = Fleet(handles)
        self.driver = WorkerDriver(self.journal, settings, restarter or Restarter(partial(registry_expect, self.journal)), observers)
        options = SenderOptions(state_dir, settings.update_mode, settings.request_timeout_s, settings.stage_timeout_s,
                                loader.socket if loader else "")  # fmt: skip
        self.stager = Stager(settings.transport, options, journal=self.journal)
        self.engine = RolloutEngine(self.journal, self.fleet, settings, self.driver, self.stager)
        # fleet mode: every rollout under a fleet-wide lease; an agent converges to the fleet target
        self.leases = FleetLeases(registry, fleet) if fleet is not None and fleet.enabled else None
        self.fleet_agent: FleetAgent | None = None
        if fleet is not None and self.leases is not None:
            self.engine = leased(self.engine, self.leases, lambda: self.stopping)
            self.fleet_agent = FleetAgent(self.journal, fleet, idle=self._idle, pinned=lambda: self.state.pinned,
                                          converge=self.converge, submit=self.submit)  # fmt: skip
        self.queue = RolloutQueue()
        self.state = RolloutState()
        # managed children: watched from launch, relaunched with backoff (daemon/supervise.py)
        self.supervisor = Supervisor(self.journal, self.fleet, self.driver, settings, self._fell_back)
        self._fallback_to: str | None = None  # a managed worker fell back to it; made serving by reconcile
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(
        cls, config: Config, registry: Registry, observers: Iterable[TransitionObserver] = ()
    ) -> RolloutService:
        try:
            return cls(registry, config.rollout, list(config.workers), config.state_dir, config.loader, observers,
                       fleet=config.fleet)  # fmt: skip
        except ConfigError as exc:
            raise ConfigError(f"{config.source_file}: {exc}") from None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, scheduler: BaseScheduler | None = None) -> None:
        self.journal.register_workers((h.name, h.spec.kind, h.url, h.spec.device) for h in self.fleet)
        # On the caller's thread, before the coordinator starts: making the seed imports
        # transformers, and two threads importing it at once can fail.
        self._seed_if_empty()
        if self.leases is not None and (stale := self.leases.release_stale()):
            log.warning("fleet_lease_stale_released", slots=stale)  # this host's previous run died holding it
        self.supervisor.start()
        self._thread = threading.Thread(target=self._run, name="rollout", daemon=True)
        self._thread.start()
        if scheduler is not None and self.fleet_agent is not None:
            scheduler.add_job(self.fleet_agent.tick, "interval", seconds=self.fleet_agent.settings.poll_s,
                              id="fleet-converge", max_instances=1, coalesce=True)  # fmt: skip
        if scheduler is not None:
            scheduler.add_job(self.poll, "interval", seconds=self.settings.health_poll_s, id="worker-health",
                              max_instances=1, coalesce=True)  # fmt: skip

    def stop(self, stop_managed: bool = True, timeout: float = 30.0) -> None:
        self._stopping.set()
        self.queue.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self.supervisor.stop()
        if stop_managed:
            for h in self.fleet:
                if h.managed is not None:
                    h.managed.stop()
        self.stager.close()
        self.fleet.close()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once start-up and crash recovery are done."""
        return self._ready.wait(timeout)

    # -- inputs ----------------------------------------------------------------------------
    def submit(self, checkpoint_id: int) -> None:
        """A verified checkpoint to roll out (the coordinator's `on_verified`). Returns at once."""
        ckpt = self.journal.checkpoint(checkpoint_id)
        if ckpt is None:
            return
        replaced = self.queue.offer(ckpt)
        if replaced is not None:
            self.supersede(replaced, by=ckpt if replaced.id != ckpt.id else self.queue.pending)
        blocked = self.state.take_blocked(older_than=ckpt)  # a newer version takes its turn
        if blocked is not None:
            self.supersede(blocked, by=ckpt)
        log.info("rollout_queued", version=ckpt.version, pinned=self.state.pinned, busy=self.state.current_job)

    def rollback(self, to: str | None = None) -> Future[dict[str, Any]]:
        return self.queue.command(Job("rollback", version=to))

    def pin(self, version: str, force: bool = False) -> Future[dict[str, Any]]:
        """Deploy `version` and hold it; a `rejected` one only with `force`."""
        return self.queue.command(Job("pin", version=version, force=force))

    def unpin(self) -> Future[dict[str, Any]]:
        return self.queue.command(Job("unpin"))

    def converge(self, version: str) -> Future[dict[str, Any]]:
        """Fleet mode: move this host to the fleet target `version` (daemon.fleet.FleetAgent)."""
        return self.queue.command(Job("converge", version=version))

    def _idle(self) -> bool:
        return (self._ready.is_set() and self.state.current_job is None and self.queue.pending is None
                and not self.queue.has_command(("converge", "rollback", "pin", "reconcile")))  # fmt: skip

    def status(self) -> dict[str, Any]:
        pending = self.queue.pending
        last_good = self.journal.alias("last_good")
        return {
            "ready": self._ready.is_set(),
            "current": self.state.current_job,
            "pending": pending.version if pending else None,
            "pinned": self.state.pinned,
            "serving": self.state.serving,
            "last_good": last_good.version if last_good else None,
            "transport": self.settings.transport,
            "workers": [
                {"name": h.name, "url": h.url, "group": h.spec.group, "launch": h.spec.launch,
                 "state": h.state.value if h.state else None}
                for h in self.fleet
            ],  # fmt: skip
        }

    # -- the runner ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._bootstrap()
        except Exception:
            log.exception("rollout_bootstrap_failed")
        finally:
            self._ready.set()
        while not self._stopping.is_set():
            job = self.queue.take(0.5, deploy_allowed=self.state.pinned is None)
            if job is None:
                continue
            self.state.set_current_job(job.describe())
            try:
                job.future.set_result(self._execute(job))
            except CommandError as exc:
                log.warning("command_refused", job=job.describe(), reason=str(exc))
                job.future.set_exception(exc)
            except Exception as exc:
                log.exception("rollout_job_failed", job=job.describe())
                job.future.set_exception(exc)
            finally:
                self.state.set_current_job(None)

    def _execute(self, job: Job) -> dict[str, Any]:
        if job.kind == "deploy":
            assert job.checkpoint is not None
            return self._deploy_new(job.checkpoint)
        if job.kind == "rollback":
            return self._rollback(job.version)
        if job.kind == "pin":
            assert job.version is not None
            return self._pin(job.version, job.force)
        if job.kind == "unpin":
            return self._unpin()
        if job.kind == "converge":
            assert job.version is not None
            return self._converge(job.version)
        return self._reconcile()

    def _yield_wanted(self, ckpt: CheckpointRef) -> bool:
        """Stop a rollout at the next batch boundary: something that moves every worker anyway is waiting."""
        return self.queue.newer_than(ckpt) or self.queue.has_command(MOVES_FLEET) or self.stopping

    # -- jobs ------------------------------------------------------------------------------
    def _deploy_new(self, ckpt: CheckpointRef) -> dict[str, Any]:
        # Newer checkpoints still being verified would supersede this one: wait for them.
        deadline = time.monotonic() + LOOKAHEAD_MAX_S
        while (
            not self.queue.newer_than(ckpt)
            and not self._stopping.is_set()
            and time.monotonic() < deadline
            and self.journal.newer_in_verification(ckpt.id)
        ):
            time.sleep(0.1)
        if self.queue.newer_than(ckpt):
            self.supersede(ckpt, by=self.queue.pending)
            return {"version": ckpt.version, "outcome": "superseded"}
        fresh = self.journal.checkpoint(ckpt.id)
        if fresh is None or fresh.status not in WAITING:
            return {"version": ckpt.version, "outcome": "skipped", "status": fresh.status if fresh else None}
        serving = self.journal.alias("serving")
        if serving is not None and serving.id != fresh.id and newer(serving, fresh):
            # e.g. step-999 verified after step-1000 is serving: newer is the step, not arrival
            self.supersede(fresh, by=serving)
            return {"version": fresh.version, "outcome": "superseded", "by": serving.version}
        fallback = self.fallback()
        result = self.engine.deploy(
            fresh, trigger=T.NEW, fallback=fallback, should_yield=lambda: self._yield_wanted(fresh)
        )
        return self.conclude(fresh, result, serving, fallback, trigger=T.NEW)

    def _deployable(self, version: str) -> CheckpointRef:
        ckpt = self.journal.checkpoint_by_version(version)
        if ckpt is None:
            raise CommandError(f"unknown version {version!r} (see `hotswap history`)", 404)
        if not ckpt.verified or ckpt.status not in DEPLOYABLE:
            raise CommandError(f"version {version!r} is {ckpt.status}: only verified versions can be deployed")
        if not ckpt.local_path or not Path(ckpt.local_path).is_dir():
            raise CommandError(f"version {version!r} has no local copy (was {ckpt.local_path!r})")
        return ckpt

    def _rollback(self, to: str | None) -> dict[str, Any]:
        serving = self.journal.alias("serving")
        if to is not None:
            target = self._deployable(to)
        else:
            last_good = self.journal.alias("last_good")
            if last_good is not None and serving is not None and last_good.id != serving.id:
                candidate: CheckpointRef | None = last_good
            else:
                candidate = self.journal.previous_deployed(serving.id if serving else -1)
            if candidate is None:
                raise CommandError("nothing to roll back to: no earlier version was ever deployed")
            target = self._deployable(candidate.version)
        pinned = self.state.pinned
        if pinned is not None and pinned != target.version:
            raise CommandError(f"pinned to {pinned}: run `hotswap unpin` first")
        result = self.engine.deploy(
            target, trigger=T.ROLLBACK, fallback=target,
            detail={"by": "operator", "from": serving.version if serving else None},
        )  # fmt: skip
        if result.outcome == RolloutOutcome.SUCCEEDED:
            if serving is not None and serving.id != target.id:
                self.journal.checkpoint_event(
                    serving.id, "rolled_back", {"to": target.version, "by": "operator"}, result.rollout_id
                )
                self.journal.move_status(serving.id, C.RETIRED, f"rolled back by operator to {target.version}")
            self.mark_serving(target, None, f"restored by operator rollback (rollout {result.rollout_id})")
            self.journal.set_alias("last_good", target.id)
        return {"rollout_id": result.rollout_id, "version": target.version, "outcome": result.outcome.value,
                "reason": result.reason, "from": serving.version if serving else None}  # fmt: skip

    def _pin(self, version: str, force: bool = False) -> dict[str, Any]:
        target = self._deployable(version)
        if target.status == C.REJECTED and not force:
            raise CommandError(f"version {version!r} was rejected (see `hotswap history`): "
                               "pin it anyway with --force")  # fmt: skip
        serving = self.journal.alias("serving")
        self.journal.set_alias("pinned", target.id)
        self.state.set_pinned(target.version)
        out: dict[str, Any] = {"pinned": target.version, "outcome": "pinned", "rollout_id": None}
        fallback = self.fallback()
        result = self.engine.deploy(
            target, trigger=T.MANUAL, fallback=fallback if fallback and fallback.id != target.id else serving,
            detail={"by": "operator", "pin": True},
        )  # fmt: skip
        out.update(rollout_id=result.rollout_id, outcome=result.outcome.value, reason=result.reason)
        if result.outcome == RolloutOutcome.SUCCEEDED:
            self.mark_serving(target, serving, f"pinned by operator (rollout {result.rollout_id})")
            self.journal.set_alias("last_good", target.id)
        else:
            self.journal.set_alias("pinned", None)
            self.state.set_pinned(None)
            out["pinned"] = None
        return out

    def _converge(self, version: str) -> dict[str, Any]:
        target = self._deployable(version)
        serving = self.journal.alias("serving")
        if self.state.pinned is not None or (serving is not None and serving.id == target.id):
            return {"version": version, "outcome": "skipped", "pinned": self.state.pinned}
        fallback = self.fallback()
        result = self.engine.deploy(target, trigger=T.FLEET, fallback=fallback, detail={"by": "fleet"},
                                    should_yield=lambda: self.queue.has_command(MOVES_FLEET) or self.stopping)  # fmt: skip
        return self.conclude(target, result, serving, fallback, trigger=T.FLEET)

    def _unpin(self) -> dict[str, Any]:
        was = self.state.pinned
        self.journal.set_alias("pinned", None)
        self.state.set_pinned(None)
        pending = self.queue.pending
        self.queue.wake()
        return {"unpinned": was, "outcome": "unpinned", "next": pending.version if pending else None}

    def _fell_back(self, version: str) -> None:
        """The supervisor's `on_fallback`: a managed worker serves `version` because serving's
        files cannot be launched here; the runner makes it serving (and brings the rest to it)."""
        self._fallback_to = version
        self.queue.command(Job("reconcile"))

    def _take_fallback(self, serving: CheckpointRef | None) -> CheckpointRef | None:
        version, self._fallback_to = self._fallback_to, None
        ckpt = self.journal.checkpoint_by_version(version) if version else None
        if ckpt is None or serving is None or ckpt.id == serving.id:
            return serving
        why = f"{serving.version} cannot be launched on this host; a managed worker fell back to {ckpt.version}"
        self.journal.checkpoint_event(ckpt.id, "fallback", {"from": serving.version, "by": "supervisor"}, None)
        last_good = self.journal.alias("last_good")
        self.mark_serving(ckpt, serving, why)
        if last_good is None or last_good.id == serving.id:
            self.journal.set_alias("last_good", ckpt.id)
        log.warning("serving_fell_back", version=ckpt.version, was=serving.version)
        return ckpt

    def _reconcile(self) -> dict[str, Any]:
        """Bring workers that run something other than the serving version back to it."""
        serving = self._take_fallback(self.journal.alias("serving"))
        if serving is None:
            return {"outcome": "nothing to reconcile"}
        target = self.engine.fallback_target(serving)
        restored = recover_uncertain(self.driver, self.fleet, target)
        drifted = []
        for h in self.fleet:
            try:
                info = h.client.weight_info()
            except WorkerError:
                continue
            if info.state == WorkerState.RUNNING and target is not None and not target.matches(info):
                drifted.append(h.name)
        if not drifted:
            return {"outcome": "in sync", "restored": restored}
        log.warning("reconciling", workers=drifted, version=serving.version)
        result = self.engine.deploy(
            serving, trigger=T.ROLLBACK, fallback=serving, only=drifted, detail={"by": "reconcile"}
        )
        return {"rollout_id": result.rollout_id, "outcome": result.outcome.value, "workers": drifted}

    # -- what a rollout's result means for the registry ------------------------------------
    def conclude(
        self,
        ckpt: CheckpointRef,
        result: RolloutResult,
        previous: CheckpointRef | None,
        fallback: CheckpointRef | None,
        *,
        trigger: RolloutTrigger,
    ) -> dict[str, Any]:
        out = {"rollout_id": result.rollout_id, "version": ckpt.version, "outcome": result.outcome.value,
               "reason": result.reason}  # fmt: skip
        if result.outcome == RolloutOutcome.SUCCEEDED:
            self.mark_serving(ckpt, previous, f"serving on every worker (rollout {result.rollout_id})")
            if trigger == T.NEW and self.settings.health_window_s > 0:
                out.update(self.health_window(ckpt, result.rollout_id, fallback))
            else:
                self.journal.set_alias("last_good", ckpt.id)
        elif result.outcome == RolloutOutcome.FAILED and trigger == T.NEW:
            verdict = attribute(self.journal.registry, ckpt.id, result.kind, result.unrecovered, result.reason,
                                self.settings.max_infra_retries)  # fmt: skip
            out["attribution"] = verdict.verdict
            where = fallback.version if fallback else "their previous version"
            if verdict.verdict == "reject":
                self.journal.move_status(
                    ckpt.id, C.REJECTED, f"rollout {result.rollout_id} failed: {result.reason}; workers restored to {where}"
                    + (f" ({verdict.message})" if verdict.attempts else ""),
                )  # fmt: skip
            else:
                # Not the version's fault: it stays verified and is rolled out again (bounded).
                self.journal.note(ckpt.id, f"rollout {result.rollout_id}: {verdict.message}")
                log.warning("rollout_failed_not_the_checkpoint", version=ckpt.version, kind=result.kind,
                            attempts=verdict.attempts, retry=verdict.verdict)  # fmt: skip
                if verdict.verdict == "retry_when_back":
                    self.state.set_blocked(ckpt)  # see poll
                else:
                    self.submit(ckpt.id)
        elif result.outcome == RolloutOutcome.FAILED and result.kind == FailureKind.UNAVAILABLE:
            self.state.set_blocked(ckpt)  # an operator's target: retried when every worker is back
            self.journal.note(ckpt.id, f"not deployed yet (rollout {result.rollout_id}): {result.reason}")
        elif result.outcome == RolloutOutcome.SUPERSEDED:
            pending = self.queue.pending
            if pending is not None and newer(pending, ckpt):
                self.supersede(ckpt, by=pending, rollout_id=result.rollout_id)
            else:
                why = "the daemon shutting down (resumed on its next start)" if self.stopping else "an operator command"
                self.journal.note(ckpt.id, f"rollout {result.rollout_id} stopped for {why}")
        return out

    def health_window(self, ckpt: CheckpointRef, rid: int, fallback: CheckpointRef | None) -> dict[str, Any]:
        verdict = health.watch(self.fleet, self.settings, lambda: self.queue.has_command(MOVES_FLEET) or self.stopping,
                               ckpt.version)  # fmt: skip
        window = {"seconds": self.settings.health_window_s, "workers": verdict.workers}
        if verdict.aborted:
            self.journal.amend_rollout(rid, detail={"health_window": {**window, "aborted": True}})
            return {"health_window": "aborted"}
        if verdict.ok:
            self.journal.amend_rollout(rid, detail={"health_window": {**window, "ok": True}})
            self.journal.set_alias("last_good", ckpt.id)
            return {"health_window": "ok"}
        log.warning("health_window_failed", version=ckpt.version, reason=verdict.reason, infra=verdict.infra)
        self.journal.amend_rollout(
            rid, outcome=RolloutOutcome.ROLLED_BACK,
            detail={"health_window": {**window, "ok": False, "reason": verdict.reason, "infra": verdict.infra}},
        )  # fmt: skip
        # never back onto missing files: the newest earlier version whose files are all there
        usable = self.engine.fallback_target(fallback, exclude=[ckpt.id]) if fallback is not None else None
        fallback = usable.checkpoint if usable is not None else None
        if fallback is None or fallback.id == ckpt.id:
            self.journal.note(ckpt.id, f"health window failed ({verdict.reason}) but no earlier version to roll back to")
            return {"health_window": "failed", "rolled_back": None}
        # Recorded before the rollback runs: a daemon killed during it finds the verdict written.
        retry = None
        if verdict.infra:  # a worker stopped answering: like a crash mid-rollout (daemon.rollout.attribution)
            retry = attribute(self.journal.registry, ckpt.id, FailureKind.UNREACHABLE, [], verdict.reason,
                              self.settings.max_infra_retries)  # fmt: skip
        if retry is not None and retry.verdict != "reject":
            left = self.settings.max_infra_retries - retry.attempts
            self.journal.move_status(ckpt.id, C.VERIFIED, f"rolled back to {fallback.version} after deploy: {verdict.reason}; "
                                     f"not the checkpoint's fault: rolled out again ({left} retries left)")  # fmt: skip
        else:
            self.journal.move_status(ckpt.id, C.REJECTED, f"rolled back to {fallback.version} after deploy: {verdict.reason}"
                                     + (f" ({retry.message})" if retry is not None else ""))  # fmt: skip
        self.journal.checkpoint_event(
            ckpt.id, "rolled_back", {"to": fallback.version, "by": "health_window", "reason": verdict.reason}, rid
        )
        rb = self.engine.deploy(
            fallback, trigger=T.ROLLBACK, fallback=fallback,
            detail={"by": "health_window", "from": ckpt.version, "reason": verdict.reason, "rolled_back_rollout": rid},
        )  # fmt: skip
        reported = fleet_version(self.fleet)  # serving is what the workers say they serve
        if rb.outcome == RolloutOutcome.SUCCEEDED or (
            rb.outcome == RolloutOutcome.FAILED and rb.kind != FailureKind.UNAVAILABLE and reported == fallback.version
        ):
            # A failed rollback still restored every worker it reached to the fallback.
            self.mark_serving(fallback, None, f"restored by automatic rollback (rollout {rb.rollout_id})")
            self.journal.set_alias("last_good", fallback.id)
            if retry is not None and retry.verdict != "reject":
                self.submit(ckpt.id)
        else:
            log.error("automatic_rollback_incomplete", version=ckpt.version, outcome=rb.outcome, reason=rb.reason)
            if retry is not None and retry.verdict != "reject":
                self.state.set_blocked(ckpt)  # retried when every worker is back (see poll)
        return {"health_window": "failed", "rolled_back": fallback.version, "rollback_rollout_id": rb.rollout_id,
                "rollback_outcome": rb.outcome.value, "reason": verdict.reason}  # fmt: skip

    def mark_serving(self, ckpt: CheckpointRef, previous: CheckpointRef | None, message: str) -> None:
        self.journal.set_alias("serving", ckpt.id)
        self.state.set_serving(ckpt.version)
        fresh = self.journal.checkpoint(ckpt.id)
        if fresh is not None and fresh.status != C.DEPLOYED:
            self.journal.move_status(ckpt.id, C.DEPLOYED, message)
        if previous is not None and previous.id != ckpt.id:
            old = self.journal.checkpoint(previous.id)
            if old is not None and old.status == C.DEPLOYED:
                self.journal.move_status(previous.id, C.RETIRED, f"replaced by {ckpt.version}")
        last_good = self.journal.alias("last_good")
        self.stager.retain({ckpt.version} | ({last_good.version} if last_good else set()))

    def supersede(self, ckpt: CheckpointRef, by: CheckpointRef | None, rollout_id: int | None = None) -> None:
        fresh = self.journal.checkpoint(ckpt.id)
        if fresh is None or fresh.status not in WAITING:
            return
        where = f" during rollout {rollout_id}" if rollout_id else " before it was deployed"
        self.journal.move_status(
            ckpt.id, C.SUPERSEDED, f"superseded by {by.version if by else 'a newer version'}{where}",
            detail={"by": by.version if by else None, "rollout_id": rollout_id},
        )  # fmt: skip
        log.info("superseded", version=ckpt.version, by=by.version if by else None)

    def fallback(self) -> CheckpointRef | None:
        """The version a failed rollout returns to: last_good, else serving, else what workers run now."""
        fb = self.journal.alias("last_good") or self.journal.alias("serving")
        if fb is not None:
            return fb
        for h in self.fleet:
            try:
                info = h.client.weight_info()
            except WorkerError:
                continue
            known = self.journal.checkpoint_by_version(info.version) if info.version else None
            if known is not None and known.local_path:
                return known
        return None

    # -- start-up: seed, managed workers, crash recovery ------------------------------------
    def _bootstrap(self) -> None:
        """First on the runner's thread, before any queued checkpoint: unfinished rollouts are
        finished or undone, an interrupted health window is watched again, drifted workers are
        reconciled and a waiting version is resumed."""
        pinned = self.journal.alias("pinned")
        self.state.set_pinned(pinned.version if pinned else None)
        serving = self._launch_managed()
        self.state.set_serving(serving.version if serving else None)
        open_rollouts = self.journal.unfinished_rollouts()
        for r in open_rollouts[:-1]:
            self.journal.finish_rollout(r.id, RolloutOutcome.FAILED, {"reason": "left unfinished; a later rollout replaced it"})
        if open_rollouts:
            with holding(self.leases, open_rollouts[-1].checkpoint, lambda: self.stopping):
                self._recover_unfinished(open_rollouts[-1])
        else:
            serving = self.journal.alias("serving")
            last_good = self.journal.alias("last_good")
            rid = self.journal.last_rollout_of(serving.id) if serving else None
            if serving is not None and rid is not None and (last_good is None or last_good.id != serving.id):
                # The daemon stopped inside a health window: watch again before trusting the version.
                log.info("health_window_resumed", version=serving.version)
                self.health_window(serving, rid, last_good)
        self.queue.command(Job("reconcile"))
        serving = self.journal.alias("serving")
        waiting = newest([c for c in self.journal.waiting() if serving is None or newer(c, serving)])
        if waiting is not None:
            log.info("resuming_waiting_checkpoint", version=waiting.version)
            self.submit(waiting.id)

    def _seed_if_empty(self) -> None:
        """A fleet of managed workers only, with nothing deployed yet: serve the tiny seed."""
        managed = [h for h in self.fleet if h.managed is not None]
        if not managed or len(managed) != len(self.fleet) or any(h.spec.model for h in managed):
            return
        if self.journal.alias("serving") is None:
            seed = ensure_seed(self.journal, self.state_dir)
            self.journal.set_alias("serving", seed.id)
            self.journal.set_alias("last_good", seed.id)

    def _launch_managed(self) -> CheckpointRef | None:
        managed = [h for h in self.fleet if h.managed is not None]
        for h in managed:
            assert h.managed is not None
            if not h.managed.adopt():
                self.supervisor.launch(h)  # on serving, else the newest good version present here
        for h in managed:  # healthy, or failed (recorded with its log's last lines, relaunched with backoff)
            if not self.supervisor.wait_settled(h, self.settings.restart_timeout_s + 5):
                log.error("managed_worker_not_ready", worker=h.name,
                          log_file=str(h.managed.log_file if h.managed else ""))  # fmt: skip
        return self.journal.alias("serving")

    def _recover_unfinished(self, rollout: RolloutRef) -> None:
        fb_version = rollout.detail.get("fallback")
        fallback = self.journal.checkpoint_by_version(fb_version) if fb_version else None
        serving = self.journal.alias("serving")
        rec = Recovery(self.journal, self.engine, self.driver).run(rollout, fallback)
        detail = {"recovered": True, "recovered_to": rec.version, "unrecovered": rec.unrecovered}
        ckpt = rollout.checkpoint
        if rec.finished and not rec.unrecovered:
            self.journal.finish_rollout(rollout.id, RolloutOutcome.SUCCEEDED, detail)
            self.conclude(ckpt, RolloutResult(rollout.id, RolloutOutcome.SUCCEEDED), serving, fallback, trigger=rollout.trigger)
            if rollout.trigger != T.NEW:
                self.journal.set_alias("last_good", ckpt.id)
        else:
            reason = "daemon restarted after the rollout had failed; undone" if not rec.finished else "not every worker recovered"
            self.journal.finish_rollout(rollout.id, RolloutOutcome.FAILED, {**detail, "reason": reason})
            if rollout.trigger == T.NEW:
                self.journal.move_status(ckpt.id, C.REJECTED, f"rollout {rollout.id}: {reason}")

    # -- the health poll (an APScheduler job on the daemon's scheduler) ---------------------
    def poll(self) -> None:
        """Keep each idle worker's `workers` row current from its /weight_info: one that stops
        answering is UNREACHABLE (an `events` row when the state changes), a managed worker whose
        process died is relaunched, a worker on another version than serving asks for a reconcile,
        and a version held back for an unavailable worker is retried once all are back."""
        if not self.wait_ready(0) or self.stopping or self._busy():
            return  # during a job the engine itself records every state change
        drift = False
        running = 0
        for h in self.fleet:
            if not h.busy.acquire(blocking=False):
                continue
            try:
                drift |= self._poll_one(h)
                running += h.state == WorkerState.RUNNING
            except Exception:
                log.exception("health_poll_failed", worker=h.name)
            finally:
                h.busy.release()
        if self._busy():
            return
        if drift:
            self.queue.command(Job("reconcile"))
        if running == len(self.fleet):
            blocked = self.state.take_blocked()
            if blocked is not None:
                log.info("fleet_back", retrying=blocked.version)
                self.submit(blocked.id)

    def _busy(self) -> bool:
        return self.state.current_job is not None

    def _poll_one(self, h: WorkerHandle) -> bool:
        if h.managed is not None and (self.supervisor.owns(h) or h.managed.needs_relaunch()):
            return False  # launching, failed or just died: the supervisor reports it (daemon/supervise.py)
        try:
            info = h.client.weight_info()
        except WorkerError as exc:
            self.journal.observe(h.name, state="UNREACHABLE", weight_version=None, error=str(exc))
            h.observed(None)
            return False
        if check_worker(self.journal, self.driver, h, info) is not None:  # reports what the registry does not
            self.journal.observe(h.name, state=WorkerState.UNCERTAIN.value, weight_version=info.version,
                                 error="its report does not match the registry", device=info.device)  # fmt: skip
            return True
        state = info.state if info.state in WORKER_STATES else "UNKNOWN"
        self.journal.observe(h.name, state=state, weight_version=info.version, error=None, device=info.device)
        h.observed(parse_state(info.state))
        serving_version = self.state.serving
        return info.state == WorkerState.RUNNING.value and serving_version is not None and info.version != serving_version
