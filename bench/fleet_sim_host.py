"""One simulated host of bench/fleet_sim.py, and the ledger every host reports to.

A host is what a fleet-mode daemon runs against the registry, with in-process fake workers:
its own `Registry` (own engine and pool: one connection path per host, as in production), a
`FleetLeases`, and the real `FleetAgent` ticking every `[fleet] poll_s`. The agent's `converge`
does what `LeasedEngine.deploy` and the daemon's conclusion do: `start_rollout`, wait for a slot
(`FleetLeases.acquire`), renew it while the fake update runs (`update_s` of sleep), release, then
`finish_rollout` and set `serving`. So every statement a host sends is the production SQL; only
the workers are fake. Each host's statements and pool checkouts (pre-ping round trips) are
counted on its engine, and so are its pool's liveness pings.

The ledger is the simulation's own truth, beside the database's: who holds which slot from the
moment `acquire` returned until just before `release` was called, so two live holders of one
slot (a double grant) or more holders than slots are seen even if the database never shows them.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import event

from bench.fleet_sim_bytes import Origin
from daemon.fleet.agent import FleetAgent
from daemon.fleet.lease import FleetLeases
from daemon.fleet.settings import FleetSettings
from daemon.registry import Registry, hosts
from daemon.registry import queries as q
from daemon.registry.journal import Journal
from daemon.registry.models import RolloutOutcome, RolloutTrigger
from daemon.registry.status import CheckpointStatus


@dataclass
class Ledger:
    """What every host did, with monotonic times; thread-safe."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    holders: dict[int, str] = field(default_factory=dict)  # slot -> live host holding it (sim's view)
    dead: set[str] = field(default_factory=set)  # hosts killed holding a slot
    peak: int = 0  # most live holders at once
    double_grants: int = 0  # a slot acquired while another live host held it
    takeovers: list[dict[str, Any]] = field(default_factory=list)  # a dead host's slot taken again
    acquisitions: list[tuple[float, str, int, str]] = field(default_factory=list)  # (t, host, slot, version)
    releases: list[tuple[float, str, int]] = field(default_factory=list)
    kills: list[tuple[float, str, int]] = field(default_factory=list)
    converged: dict[str, dict[str, float]] = field(default_factory=dict)  # version -> host -> t
    errors: list[str] = field(default_factory=list)
    kill_at_acquisition: int | None = None  # the n-th acquisition of `kill_version` is killed
    kill_version: str = ""
    # the bytes dimension (bench/fleet_sim_bytes.py): None = every host has every version's copy
    origin_bps: float | None = None
    version_bytes: dict[str, float] = field(default_factory=dict)  # bytes each host fetches per version
    links: dict[str, float] = field(default_factory=dict)  # host -> its link, bytes/s
    copies: str = ""  # the folder whose <version> directory a finished fetch records as the host's copy
    origins: dict[str, Origin] = field(default_factory=dict)  # version -> its origin model (real time)

    def acquired(self, host: str, slot: int, version: str) -> bool:
        """Record it; True when this host is the one to kill."""
        now = time.monotonic()
        with self.lock:
            prev = self.holders.get(slot)
            if prev is not None and prev != host:
                if prev in self.dead:
                    killed = next(t for t, h, s in self.kills if h == prev)
                    self.takeovers.append(
                        {"slot": slot, "dead_host": prev, "by": host, "after_kill_s": now - killed}
                    )
                else:
                    self.double_grants += 1
            self.holders[slot] = host
            self.peak = max(self.peak, sum(1 for h in self.holders.values() if h not in self.dead))
            self.acquisitions.append((now, host, slot, version))
            mine = [a for a in self.acquisitions if a[3] == version]
            return version == self.kill_version and len(mine) == self.kill_at_acquisition

    def releasing(self, host: str, slot: int) -> None:
        with self.lock:
            if self.holders.get(slot) == host:
                del self.holders[slot]
            self.releases.append((time.monotonic(), host, slot))

    def killed(self, host: str, slot: int) -> None:
        with self.lock:
            self.dead.add(host)
            self.kills.append((time.monotonic(), host, slot))

    def done(self, host: str, version: str) -> None:
        with self.lock:
            self.converged.setdefault(version, {})[host] = time.monotonic()

    def error(self, text: str) -> None:
        with self.lock:
            if len(self.errors) < 50:
                self.errors.append(text)

    def fetching(self) -> bool:
        """Hosts fetch each version through the origin model (else: every copy is there)."""
        return self.origin_bps is not None

    def copy_path(self, version: str) -> str:
        return f"{self.copies}/{version}"

    def fetch_begin(self, host: str, version: str) -> None:
        with self.lock:
            assert self.origin_bps is not None
            origin = self.origins.setdefault(version, Origin(self.origin_bps, now=time.monotonic()))
            origin.begin(host, self.version_bytes[version], self.links[host], time.monotonic())

    def fetch_left_s(self, host: str, version: str) -> float:
        with self.lock:
            return self.origins[version].left_s(host, time.monotonic())

    def fetch_summary(self, version: str, t0: float) -> dict[str, Any]:
        with self.lock:
            origin = self.origins.get(version)
            return origin.summary(t0) if origin is not None else {}

    # Read by the simulation; methods, so a ledger shared across processes (a manager's proxy,
    # bench/fleet_sim_procs.py) answers them too.

    def converged_at(self, version: str, names: list[str]) -> float | None:
        """When the last of `names` (killed ones excepted) served `version`; None: not all yet."""
        with self.lock:
            done = self.converged.get(version, {})
            if not all(n in done or n in self.dead for n in names):
                return None
            return max(done.values(), default=0.0)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"peak": self.peak, "double_grants": self.double_grants, "errors": list(self.errors),
                    "kills": list(self.kills), "takeovers": list(self.takeovers),
                    "acquisitions": list(self.acquisitions), "releases": list(self.releases),
                    "converged": {v: dict(d) for v, d in self.converged.items()}}  # fmt: skip


@dataclass
class Counts:
    statements: int = 0  # SQL statements the host's code sent
    checkouts: int = 0  # pool checkouts: one per session
    pings: int = 0  # the pool's liveness round trips before a session (every checkout, or only after idle)


class SimHost:
    def __init__(self, name: str, url: str, settings: FleetSettings, update_s: float, ledger: Ledger,
                 stop_all: threading.Event) -> None:  # fmt: skip
        self.name = name
        self.registry = Registry(url, name)
        self.counts = Counts()
        self._count_lock = threading.Lock()
        event.listen(self.registry.engine, "before_cursor_execute", self._statement)
        event.listen(self.registry.engine.pool, "checkout", self._checkout)
        dialect, ping = self.registry.engine.dialect, self.registry.engine.dialect.do_ping

        def counted_ping(dbapi: Any) -> bool:
            with self._count_lock:
                self.counts.pings += 1
            return ping(dbapi)

        dialect.do_ping = counted_ping  # type: ignore[method-assign,assignment]
        self.journal = Journal(self.registry)
        self.settings = settings
        self.leases = FleetLeases(self.registry, settings)
        self.agent = FleetAgent(self.journal, settings, idle=self.idle, pinned=lambda: None, converge=self.converge,
                                submit=self.submit)  # fmt: skip
        if ledger.fetching():
            self.agent.fetch = self.fetch  # as the daemon's Coordinator.fetch_here, through the origin model
        self.update_s = update_s
        self.ledger = ledger
        self.stop_all = stop_all
        self.dead = threading.Event()  # SIGKILLed: no more ticks, renewals or releases
        self._job: Future[dict[str, Any]] | None = None
        self.bad: set[str] = set()  # versions whose health window fails here (bench/fleet_sim_staged.py)
        self.submits = 0  # the agent asked to deploy a verified version nobody finished (not expected here)
        self.thread: threading.Thread | None = None

    def _statement(self, *_args: Any) -> None:
        with self._count_lock:
            self.counts.statements += 1

    def _checkout(self, *_args: Any) -> None:
        with self._count_lock:
            self.counts.checkouts += 1

    def idle(self) -> bool:
        return self._job is None or self._job.done()

    def submit(self, _checkpoint_id: int) -> None:
        self.submits += 1

    def fetch(self, checkpoint_id: int) -> bool:
        """daemon.fleet.fetch.fetch_here with the bytes moved by the origin model: this host's
        fetch takes as long as its share of the origin and its link allow, then its copy is
        recorded (its location row), as the real fetch does."""
        with self.registry.session() as s:
            ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
            assert ckpt is not None
            version = ckpt.version
        self.ledger.fetch_begin(self.name, version)
        while (left := self.ledger.fetch_left_s(self.name, version)) > 0:
            if self.stop_all.wait(min(left, 0.2)) or self.dead.is_set():
                return False
        with self.registry.session() as s:
            ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
            assert ckpt is not None
            hosts.record_copy(s, ckpt, self.ledger.copy_path(version), None)
        return True

    def converge(self, version: str) -> Future[dict[str, Any]]:
        job: Future[dict[str, Any]] = Future()
        self._job = job
        threading.Thread(
            target=self._update, args=(version, job), name=f"update-{self.name}", daemon=True
        ).start()
        return job

    def _stopped(self) -> bool:
        return self.dead.is_set() or self.stop_all.is_set()

    def _update(self, version: str, job: Future[dict[str, Any]]) -> None:
        try:
            job.set_result(self._rollout(version))
        except Exception as exc:  # noqa: BLE001 - counted; the agent tries again after RETRY_S
            self.ledger.error(f"{self.name}: {type(exc).__name__}: {exc}"[:300])
            job.set_result({"outcome": "failed", "reason": str(exc)[:200]})

    def _rollout(self, version: str) -> dict[str, Any]:
        """`LeasedEngine.deploy` and its conclusion around a fake update: the rollout's row, then
        the slot (renewed) only while the workers move, then its outcome and `serving`."""
        ckpt = self.journal.checkpoint_by_version(version)
        assert ckpt is not None
        rid = self.journal.start_rollout(ckpt.id, trigger=RolloutTrigger.FLEET, transport="sim", mode="sim",
                                         detail={"version": version})  # fmt: skip
        slot = self.leases.acquire(ckpt.version, ckpt.id, self._stopped)
        if slot is None:
            self.journal.finish_rollout(rid, RolloutOutcome.SUPERSEDED)
            return {"outcome": "superseded"}
        kill = self.ledger.acquired(self.name, slot, version)
        with self.leases.renewing():
            if kill and not self.dead.wait(self.update_s / 2):
                self._die(slot)  # mid-update: never returns
            stopped = self.stop_all.wait(self.update_s)
        self.ledger.releasing(self.name, slot)
        self.leases.release(ckpt.id)
        if stopped:
            return {"outcome": "superseded"}
        previous = self.journal.alias("serving")
        if version in self.bad and previous is not None:  # its health window fails: rejected, rolled back
            self.journal.finish_rollout(rid, RolloutOutcome.SUCCEEDED)
            self.journal.set_alias("serving", ckpt.id)
            self.journal.move_status(ckpt.id, CheckpointStatus.DEPLOYED, "serving on every worker (simulated)")
            self.journal.move_status(ckpt.id, CheckpointStatus.REJECTED,
                                     f"rolled back to {previous.version} after deploy: simulated health window")  # fmt: skip
            self.journal.set_alias("serving", previous.id)
            self.journal.amend_rollout(rid, outcome=RolloutOutcome.ROLLED_BACK, detail={"health_window": "failed"})
        else:
            self.journal.finish_rollout(rid, RolloutOutcome.SUCCEEDED)
            self.journal.set_alias("serving", ckpt.id)
        self.ledger.done(self.name, version)
        return {"outcome": "succeeded", "rollout_id": rid}

    def _die(self, slot: int) -> None:
        """SIGKILL: every thread of this host stops where it is; the slot stays held in the database
        until its expiry passes (nothing renews it, nothing releases it)."""
        self.leases.renew = lambda: True  # type: ignore[method-assign]  # the renewal thread is gone too
        self.dead.set()
        self.ledger.killed(self.name, slot)
        threading.Event().wait()

    def run(self, first_after_s: float) -> None:
        """The daemon's scheduler: `FleetAgent.tick` every poll_s, from a random phase."""
        if self.stop_all.wait(first_after_s):
            return
        while not self._stopped():
            began = time.monotonic()
            try:
                self.agent.tick()
            except Exception as exc:  # noqa: BLE001 - the scheduler logs and ticks again
                self.ledger.error(f"{self.name} tick: {type(exc).__name__}: {exc}"[:300])
            self.stop_all.wait(max(0.0, self.settings.poll_s - (time.monotonic() - began)))

    def start(self, first_after_s: float) -> None:
        self.thread = threading.Thread(
            target=self.run, args=(first_after_s,), name=f"tick-{self.name}", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        if not self.dead.is_set():
            self.registry.close()
