"""The rollout service: the one object the daemon talks to for "roll this out" and manual control.

One runner thread does everything that moves workers, in order: start-up (launch managed
workers, then crash recovery), then jobs from the queue: operator commands first (rollback,
pin, unpin, reconcile), then the newest waiting checkpoint. A new version's health window is a
condition the runner steps on its passes, not a wait inside the job. A periodic health poll (on
the daemon's scheduler) keeps `workers` current. What the runner decided (serving, pinned, the
job in progress, a version held back for unavailable workers) is one `RolloutState`, guarded by
a lock, read by the API and the poll threads.

    service = RolloutService.from_config(config, registry)
    service.start(scheduler)
    coordinator.on_verified = service.submit

What each job does and what its result means for the registry is daemon.controller.decisions
(the health window: daemon.controller.health_window), start-up and crash recovery is
daemon.controller.startup. Each is handed what it needs here, and none imports this module back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

from apscheduler.events import EVENT_JOB_MAX_INSTANCES
from apscheduler.schedulers.base import BaseScheduler

from daemon.checks import CheckSettings
from daemon.common import get_logger
from daemon.config import Config, ConfigError, LoaderSettings, RolloutSettings, WorkerSpec
from daemon.controller.adapter_rollout import AdapterRollout
from daemon.controller.adapters import AdapterDecisions
from daemon.controller.commands import (
    AdapterDeploy,
    AdapterPin,
    AdapterReconcile,
    AdapterRollback,
    AdapterUnpin,
    Command,
    Converge,
    Pin,
    Reconcile,
    Rollback,
    Unpin,
)
from daemon.controller.decisions import RolloutDecisions
from daemon.controller.health_window import Windowed
from daemon.controller.poll import BoundedPoll, Unanswered, back_in_rotation, serving_port_problem
from daemon.controller.queue import CommandError, RolloutQueue, RolloutState
from daemon.controller.served import ServedVersions
from daemon.controller.startup import Startup
from daemon.controller.supervise import Supervisor
from daemon.engines import Timeouts, WorkerError, make_client
from daemon.fleet import FleetAgent, FleetLeases, FleetSettings, leased
from daemon.gates import GateSettings
from daemon.registry import WORKER_STATES, AdapterJournal, Journal, Registry, unreachable
from daemon.rollout import (
    ManagedWorker,
    Restarter,
    RolloutEngine,
    Stager,
    TransitionObserver,
    WorkerAsks,
    WorkerDriver,
    WorkerHandle,
    WorkerSet,
    WorkerState,
    check_worker,
    parse_state,
    registry_expect,
)
from daemon.transport import SenderOptions

log = get_logger(__name__)


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
        checks: CheckSettings | None = None,
        gates: GateSettings | None = None,
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
        self.fleet = WorkerSet(handles)
        self.driver = WorkerDriver(self.journal, settings, restarter or Restarter(partial(registry_expect, self.journal)), observers)
        options = SenderOptions(state_dir, settings.update_mode, settings.request_timeout_s, settings.stage_timeout_s,
                                loader.socket if loader else "")  # fmt: skip
        self.stager = Stager(settings.transport, options, journal=self.journal)
        if settings.workers_ahead:  # workers open (ipc) or read (disk) a version while it is verified
            self.stager.asks = WorkerAsks(self.fleet)
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
        self._stopping = threading.Event()
        self.adapter_journal = AdapterJournal(registry)
        # the one writer of serving and last_good, the base's and each adapter name's (daemon/controller/served.py)
        self.served = ServedVersions(self.journal, self.adapter_journal, self.state, self.stager.retain)
        self.decisions = RolloutDecisions(self.journal, self.fleet, settings, self.engine, self.driver, self.state,
                                          self.queue, self._stopping, served=self.served, submit=self.submit,
                                          gates=gates)  # fmt: skip
        if self.fleet_agent is not None:  # a staged rollout's hosts watch it like a new version
            self.decisions.watch_fleet = self.fleet_agent.staged
        # managed children: watched from launch, relaunched with backoff (daemon/controller/supervise.py)
        self.supervisor = Supervisor(self.journal, self.fleet, self.driver, settings, self.decisions.fell_back)
        # LoRA adapters: their own jobs, per name, on the same runner (daemon/controller/adapters.py)
        self.adapters = AdapterDecisions(self.journal, self.adapter_journal,
                                         AdapterRollout(self.journal, self.adapter_journal, self.fleet), settings,
                                         interrupted=self._stopping.is_set, checks=checks, served=self.served,
                                         submit=self.submit)  # fmt: skip
        self.engine.before_workers = self.adapters.binding.prepare  # no adapter serves on a base unverified
        self.startup = Startup(self.journal, self.fleet, settings, state_dir, self.state, self.queue, self.supervisor,
                               self.leases, self._stopping, self.engine, self.driver, self.decisions,
                               submit=self.submit, observe=self._observe_all)  # fmt: skip
        self._ready = threading.Event()
        self.polls = 0  # health poll passes finished (GET /v1/rollout shows them)
        # each pass bounded as a whole; hung managed workers killed (daemon/controller/poll.py)
        self.poller = BoundedPoll(self.journal, lambda: self.settings.request_timeout_s)
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(
        cls, config: Config, registry: Registry, observers: Iterable[TransitionObserver] = ()
    ) -> RolloutService:
        try:
            return cls(registry, config.rollout, list(config.workers), config.state_dir, config.loader, observers,
                       fleet=config.fleet, checks=config.checks, gates=config.gates)  # fmt: skip
        except ConfigError as exc:
            raise ConfigError(f"{config.source_file}: {exc}") from None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, scheduler: BaseScheduler | None = None) -> None:
        self.journal.register_workers((h.name, h.spec.kind, h.url, h.spec.device) for h in self.fleet)
        # On the caller's thread, before the coordinator starts: making the seed imports
        # transformers, and two threads importing it at once can fail.
        self.startup.seed_if_empty()
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
            scheduler.add_listener(self._poll_skipped, EVENT_JOB_MAX_INSTANCES)

    def _poll_skipped(self, event: Any) -> None:
        if getattr(event, "job_id", None) == "worker-health":
            self.poller.skip()  # the previous pass still ran (a metric; a problem past a bound)

    def stop(self, stop_managed: bool = True, timeout: float = 30.0) -> None:
        self._stopping.set()
        self.queue.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self.supervisor.stop()
        self.poller.close()
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
        if self.adapter_journal.is_adapter(checkpoint_id):  # a LoRA adapter: its own job, nothing is paused
            self.queue.command(AdapterDeploy(ckpt))
            return
        if self.fleet_agent is not None and not self.fleet_agent.admits(ckpt):
            return  # a staged fleet rollout holds it here: the fleet agent converges when this host's stage comes
        replaced = self.queue.offer(ckpt)
        if replaced is not None:
            self.decisions.supersede(replaced, by=ckpt if replaced.id != ckpt.id else self.queue.pending)
        blocked = self.state.take_blocked(older_than=ckpt)  # a newer version takes its turn
        if blocked is not None:
            self.decisions.supersede(blocked, by=ckpt)
        log.info("rollout_queued", version=ckpt.version, pinned=self.state.pinned, busy=self.state.current_job)

    def rollback(self, to: str | None = None, adapter: str | None = None, by: str = "operator") -> Future[dict[str, Any]]:
        """Back to the version before (or `to`); `adapter`, or a `to` that is an adapter version:
        that adapter name only."""
        if adapter is not None or (to is not None and self.adapter_journal.by_version(to) is not None):
            return self.queue.command(AdapterRollback(adapter, to, by))
        return self.queue.command(Rollback(to, by))

    def pin(self, version: str, force: bool = False, by: str = "operator") -> Future[dict[str, Any]]:
        """Deploy `version` and hold it; a `rejected` one only with `force`. An adapter version
        pins its adapter name only."""
        adapter = self.adapter_journal.by_version(version) is not None
        return self.queue.command(AdapterPin(version, force, by) if adapter else Pin(version, force, by))

    def unpin(self, adapter: str | None = None, by: str = "operator") -> Future[dict[str, Any]]:
        return self.queue.command(AdapterUnpin(adapter, by) if adapter else Unpin(by))

    def converge(self, version: str) -> Future[dict[str, Any]]:
        """Fleet mode: move this host to the fleet target `version` (daemon.fleet.FleetAgent)."""
        return self.queue.command(Converge(version))

    def _idle(self) -> bool:
        return (self._ready.is_set() and self.state.current_job is None and self.queue.pending is None
                and not self.queue.has_command((Converge, Rollback, Pin, Reconcile)))  # fmt: skip

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
            "window": self.window(),
            "adapters": self.adapter_journal.aliases(),  # adapter name -> serving, last_good, pinned
            "passes": {"health_poll": self.polls, "supervisor": self.supervisor.passes,  # the loops are alive
                       **({"fleet_agent": self.fleet_agent.looks} if self.fleet_agent is not None else {})},  # fmt: skip
            "workers": [
                {"name": h.name, "url": h.url, "group": h.spec.group, "launch": h.spec.launch,
                 "state": h.state.value if h.state else None}
                for h in self.fleet
            ],  # fmt: skip
        }

    # -- the runner ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.startup.run()
        except Exception:
            log.exception("rollout_bootstrap_failed")
        finally:
            self._ready.set()
        held: tuple[Command, dict[str, Any]] | None = None  # a job whose health window is open
        while not self._stopping.is_set() or held is not None:
            if held is not None:  # the window is a condition: one step of it when due, then look again
                held = self._step_window(*held)
                continue
            job = self.queue.take(0.5, deploy_allowed=self.state.pinned is None)
            if job is None:
                continue
            self.state.set_current_job(job.describe())
            held = self._finish(job, partial(self._execute_through_outage, job))

    def _finish(self, job: Command, step: Callable[[], dict[str, Any]]) -> tuple[Command, dict[str, Any]] | None:
        """Run `step` (the job, or a step of its open health window) and answer the job's Future;
        the job and its result so far while its window is open (it ends with the window's verdict,
        and status's `current` names it until then)."""
        try:
            out = step()
            if self._windowed() is not None:
                return job, out
            job.future.set_result(out)
        except Exception as exc:
            self.decisions.window = self.adapters.window = None  # decides nothing: not last_good (watched again at start)
            if isinstance(exc, CommandError):
                log.warning("command_refused", job=job.describe(), reason=str(exc))
            else:
                log.exception("rollout_job_failed", job=job.describe())
            job.future.set_exception(exc)
        self.state.set_current_job(None)
        return None

    def _step_window(self, job: Command, out: dict[str, Any]) -> tuple[Command, dict[str, Any]] | None:
        """A step of the held job's window; then sleep until the next is due (sooner when a command
        that ends the window arrives, or on shutdown). With the verdict, the job's rest runs."""
        owner = self._windowed()
        assert owner is not None and owner.window is not None
        window = owner.window

        def step() -> dict[str, Any]:
            verdict = owner.settle()
            return out if verdict is None else job.settled(self, {**out, **verdict})

        if (held := self._finish(job, step)) is not None:
            self.queue.wait(window.due, unless=window.interrupted)
        return held

    def window(self) -> dict[str, Any] | None:
        """The health window the runner steps now, if any: whose, and about how long is left."""
        owner = self._windowed()
        window = owner.window if owner is not None else None
        return window.describe() if window is not None else None

    def _windowed(self) -> Windowed | None:
        """The decider whose job left a health window open (the base's or an adapter name's)."""
        return next((d for d in (self.decisions, self.adapters) if d.window is not None), None)

    def _execute_through_outage(self, job: Command) -> dict[str, Any]:
        """A job the database cut short (a read it needed failed) runs again once the database
        answers and what was kept meanwhile is recorded (daemon.registry.outbox); until then no
        worker is left drained or paused by it."""
        while True:
            try:
                return job.run(self)
            except Exception as exc:
                if not unreachable(exc) or self.stopping:
                    raise
                log.warning("rollout_job_waits_for_database", job=job.describe(), error=" ".join(str(exc).split())[:300])
                self._all_back_in_rotation()
                if not self.journal.registry.wait_until_writable(self._stopping):
                    raise

    def _all_back_in_rotation(self) -> None:
        for h in self.fleet:
            if h.busy.acquire(blocking=False):
                try:
                    back_in_rotation(self.driver, h)
                finally:
                    h.busy.release()

    def gate_problems(self) -> list[tuple[str, str]]:
        """Gates of a trial that cannot run now, with why (the problem gate_cannot_run)."""
        return self.decisions.gate_problems()

    def adapter_problems(self) -> list[tuple[str, str]]:
        """Adapters unloaded because they do not fit the serving base (the problem adapter_not_on_base)."""
        return self.adapters.binding.problems()

    # -- the health poll (an APScheduler job on the daemon's scheduler) ---------------------
    def poll(self) -> None:
        """Keep each idle worker's `workers` row current from its /weight_info: one that stops
        answering is UNREACHABLE (an `events` row when the state changes), a managed worker whose
        process died is relaunched, a worker on another version than serving asks for a reconcile,
        and a version held back for an unavailable worker is retried once all are back."""
        try:
            self._poll()
        finally:
            self.polls += 1  # a pass finished (or had nothing to do): what "the next poll" waits on

    def _poll(self) -> None:
        if not self.wait_ready(0) or self.stopping or self._busy():
            return  # during a job the engine itself records every state change
        box = self.journal.registry.outbox
        if box.pending() and not box.flush():
            # The registry lags what happened (writes kept through an outage): judged against it,
            # a worker on the version it was just moved to would look drifted and be moved back.
            self._all_back_in_rotation()
            return
        drift = any(self.poller.run(self.fleet, self._poll_held).values())
        running = sum(h.state == WorkerState.RUNNING for h in self.fleet)
        if self._busy():
            return
        if drift:
            self.queue.command(Reconcile())
        elif running == len(self.fleet) and self.adapters.drifted():  # e.g. a relaunched worker lost its adapters
            self.queue.command(AdapterReconcile())
        if running == len(self.fleet):
            blocked = self.state.take_blocked()
            if blocked is not None:
                log.info("fleet_back", retrying=blocked.version)
                self.submit(blocked.id)

    def _observe_all(self) -> None:
        """Start-up, before the first job: what the health poll does for each worker, once."""
        for h in self.fleet:
            with h.busy:
                try:
                    self._poll_one(h)
                except Unanswered:
                    pass  # recorded UNREACHABLE
                except Exception:
                    log.exception("health_poll_failed", worker=h.name)

    def _poll_held(self, h: WorkerHandle) -> bool:
        if not h.busy.acquire(blocking=False):
            return False  # the engine drives it and records every change itself
        try:
            return self._poll_one(h)
        finally:
            h.busy.release()

    def _busy(self) -> bool:
        return self.state.current_job is not None

    def _poll_one(self, h: WorkerHandle) -> bool:
        if h.managed is not None and (self.supervisor.owns(h) or h.managed.needs_relaunch()):
            return False  # launching, failed or just died: the supervisor reports it (daemon/controller/supervise.py)
        try:
            info = h.client.weight_info()
        except WorkerError as exc:
            self.journal.observe(h.name, state="UNREACHABLE", weight_version=None, error=str(exc))
            h.observed(None)
            raise Unanswered(str(exc)) from None
        info = back_in_rotation(self.driver, h, info) or info
        if check_worker(self.journal, self.driver, h, info) is not None:  # reports what the registry does not
            self.journal.observe(h.name, state=WorkerState.UNCERTAIN.value, weight_version=info.version,
                                 error="its report does not match the registry", device=info.device)  # fmt: skip
            return True
        state = info.state if info.state in WORKER_STATES else "UNKNOWN"
        if state == WorkerState.RUNNING.value and (why := serving_port_problem(h.url, self.settings.request_timeout_s / 2)):
            log.warning("serving_port_unanswered", worker=h.name, error=why)  # its clients see no worker at all
            self.journal.observe(h.name, state="UNREACHABLE", weight_version=info.version, error=why, device=info.device)
            h.observed(None)
            return False
        self.journal.observe(h.name, state=state, weight_version=info.version, error=None, device=info.device)
        h.observed(parse_state(info.state))
        serving_version = self.state.serving
        return info.state == WorkerState.RUNNING.value and serving_version is not None and info.version != serving_version
