"""The hosts of bench/fleet_sim.py, in this process or spread over several (`--procs N`).

One Python process runs about a hundred simulated hosts before its own interpreter, not the
registry, sets the pace (300 hosts in one process: 1.67 x the ideal on 2 cores, renewal threads
starved). With `--procs N` each of N spawned processes runs its share of the hosts, every host
still its own `Registry` and connection path, and all report to one `Ledger` served by a
`multiprocessing` manager (its methods run under its lock in the manager's process, with
CLOCK_MONOTONIC times, which every process on a host shares).

    HostGroup: start -> totals() (statements, pings, sessions so far) -> stop() (lost leases, submits)
        LocalHosts     the hosts as threads of this process
        ProcessHosts   a child process running a LocalHosts, driven over a pipe
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from multiprocessing.connection import Connection
from multiprocessing.managers import BaseManager
from typing import Any, Protocol

from bench.fleet_sim_host import Ledger, SimHost
from daemon.fleet.settings import FleetSettings

SPAWN = mp.get_context("spawn")  # never fork a process that already runs threads


class HostGroup(Protocol):
    def totals(self) -> tuple[int, int, int]: ...

    def stop(self) -> dict[str, int]: ...


class LedgerManager(BaseManager):
    pass


LedgerManager.register("Ledger", Ledger)


def shared_ledger(**kwargs: Any) -> tuple[LedgerManager, Ledger]:
    """A ledger every process can report to (a proxy with Ledger's methods), and its manager."""
    manager = LedgerManager(ctx=SPAWN)
    manager.start()
    return manager, manager.Ledger(**kwargs)  # type: ignore[attr-defined]


class LocalHosts:
    def __init__(self, names: list[str], url: str, settings: FleetSettings, update_s: float, ledger: Ledger,
                 phases: list[float]) -> None:  # fmt: skip
        self.stop_all = threading.Event()
        self.hosts = [SimHost(n, url, FleetSettings(**{**settings.__dict__, "host": n}), update_s, ledger,
                              self.stop_all) for n in names]  # fmt: skip
        for h, phase in zip(self.hosts, phases, strict=True):
            h.start(phase)

    def totals(self) -> tuple[int, int, int]:
        c = [h.counts for h in self.hosts]
        return sum(x.statements for x in c), sum(x.pings for x in c), sum(x.checkouts for x in c)

    def stop(self) -> dict[str, int]:
        self.stop_all.set()
        for h in self.hosts:
            if h.thread is not None:
                h.thread.join(2)
        for h in self.hosts:
            h.close()
        return {"lost_leases": sum(1 for h in self.hosts if h.leases.lost),
                "unexpected_submits": sum(h.submits for h in self.hosts)}  # fmt: skip


def _serve(conn: Connection, args: tuple[Any, ...]) -> None:
    from daemon.common.logging import configure_logging

    configure_logging(level="warning")
    group = LocalHosts(*args)
    conn.send("started")
    while True:
        command = conn.recv()
        if command == "totals":
            conn.send(group.totals())
        elif command == "stop":
            conn.send(group.stop())
            return


class ProcessHosts:
    def __init__(self, names: list[str], url: str, settings: FleetSettings, update_s: float, ledger: Ledger,
                 phases: list[float]) -> None:  # fmt: skip
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=_serve, args=(child, (names, url, settings, update_s, ledger, phases)),
                                  name=f"fleet-sim-{names[0]}", daemon=True)  # fmt: skip
        self.proc.start()

    def wait_started(self, timeout_s: float = 120) -> None:
        if not self.conn.poll(timeout_s) or self.conn.recv() != "started":
            raise RuntimeError(f"{self.proc.name} did not start its hosts")

    def totals(self) -> tuple[int, int, int]:
        self.conn.send("totals")
        out: tuple[int, int, int] = self.conn.recv()
        return out

    def stop(self) -> dict[str, int]:
        try:
            self.conn.send("stop")
            out: dict[str, int] = self.conn.recv() if self.conn.poll(60) else {}
        except (EOFError, OSError):
            out = {}
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        return out


def start_hosts(names: list[str], url: str, settings: FleetSettings, update_s: float, ledger: Ledger,
                phases: list[float], procs: int) -> list[HostGroup]:  # fmt: skip
    """`names` as one group in this process (procs <= 1), or split over `procs` child processes."""
    if procs <= 1:
        return [LocalHosts(names, url, settings, update_s, ledger, phases)]
    groups = [ProcessHosts(names[i::procs], url, settings, update_s, ledger, phases[i::procs])
              for i in range(procs) if names[i::procs]]  # fmt: skip
    for g in groups:
        g.wait_started()
    return list(groups)


def totals(groups: list[HostGroup]) -> tuple[int, int, int]:
    t = [g.totals() for g in groups]
    return sum(x[0] for x in t), sum(x[1] for x in t), sum(x[2] for x in t)
