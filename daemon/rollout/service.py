"""The rollout service: the one object the daemon talks to for "roll this out" and manual control.

One runner thread does everything that moves workers, in order: bootstrap
(launch managed workers, then crash recovery), then jobs from the queue:
operator commands first, then the newest waiting checkpoint. A periodic health
poll (APScheduler, on the daemon's scheduler) keeps `workers` current.

    service = RolloutService.from_config(config, registry)
    service.start(scheduler)
    coordinator.add_step("roll out", lambda c: service.submit(c.checkpoint_id))
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.adapters import make_client
from daemon.adapters.base import WorkerError
from daemon.logging import get_logger
from daemon.registry import Registry
from daemon.rollout import commands, health, poll, startup
from daemon.rollout.commands import CommandError
from daemon.rollout.driver import WorkerDriver
from daemon.rollout.engine import RolloutEngine, RolloutResult
from daemon.rollout.faults import Faults
from daemon.rollout.fleet import Fleet, WorkerHandle
from daemon.rollout.journal import CheckpointRef, Journal
from daemon.rollout.managed import ManagedWorker
from daemon.rollout.queue import Job, JobKind, RolloutQueue
from daemon.rollout.restart import Restarter
from daemon.rollout.settings import LoaderSettings, RolloutSettings, WorkerSpec
from daemon.rollout.stage import Stager

if TYPE_CHECKING:
    from apscheduler.schedulers.base import BaseScheduler

    from daemon.config import Config

log = get_logger(__name__)

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
    ) -> None:
        self.settings = settings
        self.state_dir = state_dir
        self.journal = Journal(registry)
        handles = []
        for spec in workers:
            managed = ManagedWorker(spec, state_dir) if spec.launch == "managed" else None
            url = managed.url if managed else spec.url.rstrip("/")
            token_file = str(managed.token_file) if managed else spec.token_file
            client = make_client(spec, url=url, token_file=token_file, settings=settings)
            handles.append(WorkerHandle(spec=spec, client=client, url=url, managed=managed))
        self.fleet = Fleet(handles)
        self.faults = Faults.from_env()
        self.driver = WorkerDriver(self.journal, settings, Restarter(), self.faults)
        self.stager = Stager(settings, _loader_client(loader, settings, state_dir) if settings.transport == "ipc" else None)
        self.engine = RolloutEngine(self.journal, self.fleet, settings, self.driver, self.stager)
        self.queue = RolloutQueue()
        self.pinned: str | None = None
        self.serving_version: str | None = None
        self.current_job: str | None = None
        self.blocked: CheckpointRef | None = None  # waiting for unavailable workers to come back
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: Config, registry: Registry) -> RolloutService:
        return cls(registry, config.rollout, list(config.workers), config.state_dir, config.loader)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, scheduler: BaseScheduler | None = None) -> None:
        self.journal.register_workers((h.spec, h.url) for h in self.fleet)
        # On the caller's thread, before the coordinator starts: making the seed imports
        # transformers, and two threads importing it at once can fail.
        startup.seed_if_empty(self)
        self._thread = threading.Thread(target=self._run, name="rollout", daemon=True)
        self._thread.start()
        if scheduler is not None:
            scheduler.add_job(
                poll.poll, "interval", args=[self], seconds=self.settings.health_poll_s, id="worker-health",
                max_instances=1, coalesce=True,
            )  # fmt: skip

    def stop(self, stop_managed: bool = True, timeout: float = 30.0) -> None:
        self._stopping.set()
        self.queue.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        if stop_managed:
            for h in self.fleet:
                if h.managed is not None:
                    h.managed.stop()
        self.fleet.close()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once bootstrap and crash recovery are done."""
        return self._ready.wait(timeout)

    # -- inputs ----------------------------------------------------------------------------
    def submit(self, checkpoint_id: int) -> None:
        """A verified checkpoint to roll out (from the coordinator). Returns at once."""
        ckpt = self.journal.checkpoint(checkpoint_id)
        if ckpt is None:
            return
        replaced = self.queue.offer(ckpt)
        if replaced is not None:
            self.supersede(replaced, by=ckpt if replaced.id != ckpt.id else self.queue.pending)
        blocked = self.blocked
        if blocked is not None and blocked.id < ckpt.id:  # a newer version takes its turn
            self.blocked = None
            self.supersede(blocked, by=ckpt)
        log.info("rollout_queued", version=ckpt.version, pinned=self.pinned, busy=self.current_job)

    def rollback(self, to: str | None = None) -> Future[dict[str, Any]]:
        return self.queue.command(Job("rollback", version=to))

    def pin(self, version: str) -> Future[dict[str, Any]]:
        return self.queue.command(Job("pin", version=version))

    def unpin(self) -> Future[dict[str, Any]]:
        return self.queue.command(Job("unpin"))

    def status(self) -> dict[str, Any]:
        pending = self.queue.pending
        last_good = self.journal.alias("last_good")
        return {
            "ready": self._ready.is_set(),
            "current": self.current_job,
            "pending": pending.version if pending else None,
            "pinned": self.pinned,
            "serving": self.serving_version,
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
            startup.bootstrap(self)
        except Exception:
            log.exception("rollout_bootstrap_failed")
        finally:
            self._ready.set()
        while not self._stopping.is_set():
            job = self.queue.take(0.5, deploy_allowed=self.pinned is None)
            if job is None:
                continue
            self.current_job = job.describe()
            try:
                job.future.set_result(self._execute(job))
            except CommandError as exc:
                log.warning("command_refused", job=job.describe(), reason=str(exc))
                job.future.set_exception(exc)
            except Exception as exc:
                log.exception("rollout_job_failed", job=job.describe())
                job.future.set_exception(exc)
            finally:
                self.current_job = None

    def _execute(self, job: Job) -> dict[str, Any]:
        if job.kind == "deploy":
            assert job.checkpoint is not None
            return self._deploy_new(job.checkpoint)
        if job.kind == "rollback":
            return commands.rollback(self, job.version)
        if job.kind == "pin":
            assert job.version is not None
            return commands.pin(self, job.version)
        if job.kind == "unpin":
            return commands.unpin(self)
        return commands.reconcile(self)

    def _yield_wanted(self, checkpoint_id: int) -> bool:
        """Stop a rollout at the next batch boundary: something that moves every worker anyway is waiting."""
        return self.queue.newer_than(checkpoint_id) or self.queue.has_command(MOVES_FLEET) or self.stopping

    def _deploy_new(self, ckpt: CheckpointRef) -> dict[str, Any]:
        # Newer checkpoints still being verified would supersede this one: wait for them.
        deadline = time.monotonic() + LOOKAHEAD_MAX_S
        while (
            not self.queue.newer_than(ckpt.id)
            and not self._stopping.is_set()
            and time.monotonic() < deadline
            and self.journal.newer_in_verification(ckpt.id)
        ):
            time.sleep(0.1)
        if self.queue.newer_than(ckpt.id):
            self.supersede(ckpt, by=self.queue.pending)
            return {"version": ckpt.version, "outcome": "superseded"}
        fresh = self.journal.checkpoint(ckpt.id)
        if fresh is None or fresh.status not in ("verified", "staged"):
            return {"version": ckpt.version, "outcome": "skipped", "status": fresh.status if fresh else None}
        serving = self.journal.alias("serving")
        fallback = self.fallback()
        result = self.engine.deploy(
            fresh, trigger="new", fallback=fallback, should_yield=lambda: self._yield_wanted(fresh.id)
        )
        return self.conclude(fresh, result, serving, fallback, trigger="new")

    def conclude(
        self,
        ckpt: CheckpointRef,
        result: RolloutResult,
        previous: CheckpointRef | None,
        fallback: CheckpointRef | None,
        *,
        trigger: str,
    ) -> dict[str, Any]:
        out = {"rollout_id": result.rollout_id, "version": ckpt.version, "outcome": result.outcome, "reason": result.reason}
        if result.outcome == "succeeded":
            self.mark_serving(ckpt, previous, f"serving on every worker (rollout {result.rollout_id})")
            if trigger == "new" and self.settings.health_window_s > 0:
                out.update(self.health_window(ckpt, result.rollout_id, fallback))
            else:
                self.journal.set_alias("last_good", ckpt.id)
        elif result.outcome == "failed" and result.kind == "unavailable":
            # Not the version's fault: it waits until every worker answers again (see poll).
            self.blocked = ckpt
            self.journal.set_status(
                ckpt.id, ckpt.status, f"not deployed yet (rollout {result.rollout_id}): {result.reason}; "
                "retried when every worker is back",
            )  # fmt: skip
        elif result.outcome == "failed":
            where = fallback.version if fallback else "their previous version"
            self.journal.set_status(
                ckpt.id, "rejected", f"rollout {result.rollout_id} failed: {result.reason}; workers restored to {where}"
            )
        elif result.outcome == "superseded":
            newer = self.queue.pending
            if newer is not None and newer.id > ckpt.id:
                self.supersede(ckpt, by=newer, rollout_id=result.rollout_id)
            else:
                why = "the daemon shutting down (resumed on its next start)" if self.stopping else "an operator command"
                self.journal.set_status(ckpt.id, ckpt.status, f"rollout {result.rollout_id} stopped for {why}")
        return out

    def health_window(self, ckpt: CheckpointRef, rid: int, fallback: CheckpointRef | None) -> dict[str, Any]:
        verdict = health.watch(self.fleet, self.settings, lambda: self.queue.has_command(MOVES_FLEET) or self.stopping)
        window = {"seconds": self.settings.health_window_s, "workers": verdict.workers}
        if verdict.aborted:
            self.journal.amend_rollout(rid, detail={"health_window": {**window, "aborted": True}})
            return {"health_window": "aborted"}
        if verdict.ok:
            self.journal.amend_rollout(rid, detail={"health_window": {**window, "ok": True}})
            self.journal.set_alias("last_good", ckpt.id)
            return {"health_window": "ok"}
        log.warning("health_window_failed", version=ckpt.version, reason=verdict.reason)
        self.journal.amend_rollout(
            rid, outcome="rolled_back", detail={"health_window": {**window, "ok": False, "reason": verdict.reason}}
        )
        if fallback is None or fallback.id == ckpt.id:
            self.journal.set_status(ckpt.id, "deployed", f"health window failed ({verdict.reason}) but no earlier version to roll back to")
            return {"health_window": "failed", "rolled_back": None}
        # Recorded before the rollback runs: a daemon killed during it finds the verdict written.
        self.journal.set_status(ckpt.id, "rejected", f"rolled back to {fallback.version} after deploy: {verdict.reason}")
        self.journal.checkpoint_event(
            ckpt.id, "rolled_back", {"to": fallback.version, "by": "health_window", "reason": verdict.reason}, rid
        )
        rb = self.engine.deploy(
            fallback, trigger="rollback", fallback=fallback,
            detail={"by": "health_window", "from": ckpt.version, "reason": verdict.reason, "rolled_back_rollout": rid},
        )  # fmt: skip
        if rb.outcome == "succeeded" or (rb.outcome == "failed" and rb.kind != "unavailable"):
            # A failed rollback still restored every worker it reached to the fallback.
            self.mark_serving(fallback, None, f"restored by automatic rollback (rollout {rb.rollout_id})")
            self.journal.set_alias("last_good", fallback.id)
        else:
            log.error("automatic_rollback_incomplete", version=ckpt.version, outcome=rb.outcome, reason=rb.reason)
        return {"health_window": "failed", "rolled_back": fallback.version, "rollback_rollout_id": rb.rollout_id,
                "rollback_outcome": rb.outcome, "reason": verdict.reason}  # fmt: skip

    def mark_serving(self, ckpt: CheckpointRef, previous: CheckpointRef | None, message: str) -> None:
        self.journal.set_alias("serving", ckpt.id)
        self.serving_version = ckpt.version
        fresh = self.journal.checkpoint(ckpt.id)
        if fresh is not None and fresh.status != "deployed":
            self.journal.set_status(ckpt.id, "deployed", message)
        if previous is not None and previous.id != ckpt.id:
            old = self.journal.checkpoint(previous.id)
            if old is not None and old.status == "deployed":
                self.journal.set_status(previous.id, "retired", f"replaced by {ckpt.version}")
        last_good = self.journal.alias("last_good")
        self.stager.retain({ckpt.version} | ({last_good.version} if last_good else set()))

    def supersede(self, ckpt: CheckpointRef, by: CheckpointRef | None, rollout_id: int | None = None) -> None:
        fresh = self.journal.checkpoint(ckpt.id)
        if fresh is None or fresh.status not in ("verified", "staged"):
            return
        where = f" during rollout {rollout_id}" if rollout_id else " before it was deployed"
        self.journal.set_status(
            ckpt.id, "superseded", f"superseded by {by.version if by else 'a newer version'}{where}",
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

def _loader_client(loader: LoaderSettings | None, settings: RolloutSettings, state_dir: Path) -> Any:
    from daemon.loader.client import LoaderClient

    socket_path = (loader.socket if loader and loader.socket else "") or str(state_dir / "loader.sock")
    return LoaderClient(socket_path, timeout=settings.request_timeout_s, stage_timeout=settings.stage_timeout_s)
