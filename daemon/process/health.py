"""The daemon's one model of health: every probe's problems, in one book, shown in one place each.

    HealthMonitor.check()   the problems now: `/health` (503 while a critical one holds),
                            `/status` and `hotswap status` (a problems block), `/metrics`
                            (`hotswap_problem{kind,subject,severity}`)
    HealthMonitor.tick()    every `interval_s` (5 s, as the workers' health poll): the registry-backed probes (last rollout, the
                            serving version's files, the fleet), then `check()`, so each start
                            and end is an `events` row and a log line even when nobody asks

Probes, cheap first (in-memory ones run on every `/health`; those that read the registry or
stat files run on the tick and their last answer is used):

    database_unreachable    critical  `SELECT 1` fails
    database_unwritable,    critical  daemon.process.storage: writes the registry refused (kept in
    state_disk_full                   memory until it takes them), the state directory's disk full
    source_failing          critical  a source's `health_problem()` (folder gone, listing failing)
    (controller)                      daemon.controller.problems: no worker serving, a worker out
                                      of rotation, stuck or failing to launch, last rollout failed
    serving_files_changed   warning   the serving version's files are gone, resized, or differ
                                      from what its verdict was made on
    serving_without_tokenizer warning the serving version's folder has no tokenizer while the
                                      version served before it had one: a worker launched on it
                                      refuses text prompts (400 no_tokenizer)
    host_behind             warning   (fleet) this host does not serve the fleet target, and why
    fleet_stalled           warning   (fleet) a staged-rollout decision due for several polls while
                                      another session holds the decision lock (daemon.fleet.trust)
    fleet_decision_refused  warning   (fleet) a forged admission or fleet target, refused
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from daemon.checks import has_tokenizer
from daemon.common import WARNING, Changes, Problem, ProblemBook, get_logger
from daemon.controller import Controlled, WorkerProbe, alias_problems, last_rollout_problem
from daemon.pipeline import changed_since_verdict
from daemon.process.storage import storage_problems
from daemon.registry import Journal, Registry, unreachable, utcnow
from daemon.registry import queries as q
from daemon.sources import Source

log = get_logger(__name__)
SlowProbe = Callable[[], list[Problem]]


class HealthMonitor:
    def __init__(self, registry: Registry, sources: Callable[[], Sequence[Source]],
                 controller: Controlled | None = None, extra: Sequence[SlowProbe] = (),
                 interval_s: float = 5.0, state_dir: Path | None = None) -> None:  # fmt: skip
        self.registry = registry
        self.state_dir = state_dir
        self.journal = Journal(registry)
        self.sources = sources
        self.workers = WorkerProbe(controller) if controller is not None else None
        self.slow_probes: list[SlowProbe] = [self._serving_files]
        if controller is not None:
            self.slow_probes.append(self._last_rollout)
        self.slow_probes += extra
        self.interval_s = interval_s
        self.book = ProblemBook()
        self._slow: list[Problem] = []
        self._lock = threading.Lock()  # one pass records its changes before the next compares

    # -- what is wrong now -------------------------------------------------------------------
    def check(self) -> list[Problem]:
        seen = self._database() + storage_problems(self.registry, self.state_dir) + self._sources()
        if self.workers is not None:
            seen += self.workers.problems()
        seen += self._slow
        with self._lock:
            current, changes = self.book.observe(seen)
            self._record(changes)
        return current

    def tick(self) -> None:
        if self.registry.outbox.pending():
            self.registry.outbox.flush()  # what was kept through an outage, recorded once it can be
        slow: list[Problem] = []
        for probe in self.slow_probes:
            try:
                slow += probe()
            except Exception as exc:  # noqa: BLE001 - the database probe says so if it is the database
                log.debug("health probe failed", probe=getattr(probe, "__name__", repr(probe)), error=str(exc))
        self._slow = slow
        self.check()

    # -- probes ------------------------------------------------------------------------------
    def _database(self) -> list[Problem]:
        return database_problems(self.registry)

    def _sources(self) -> list[Problem]:
        out = []
        for source in self.sources():
            check = getattr(source, "health_problem", None)
            why = check() if callable(check) else None
            if why:
                out.append(Problem("source_failing", source.label, why))
        return out

    def _serving_files(self) -> list[Problem]:
        why = alias_problems(self.registry, ("serving",)).get("serving")
        ref = self.journal.alias("serving")
        if ref is None:
            return []
        if why is None and ref.local_path:
            with self.registry.session() as s:
                if changed_since_verdict(s, ref.id, Path(ref.local_path)):
                    why = f"its files in {ref.local_path} changed after it was verified (names, sizes or times)"
        out = [Problem("serving_files_changed", ref.version, why, WARNING)] if why else []
        before = self.journal.previous_deployed(ref.id)
        if (ref.local_path and before is not None and before.local_path and has_tokenizer(Path(before.local_path))
                and Path(ref.local_path).is_dir() and not has_tokenizer(Path(ref.local_path))):  # fmt: skip
            out.append(Problem("serving_without_tokenizer", ref.version,
                               f"{ref.local_path} has no tokenizer while {before.version}, served before it, had "
                               "one: a worker launched on it refuses text prompts (400 no_tokenizer)", WARNING))  # fmt: skip
        return out

    def _last_rollout(self) -> list[Problem]:
        p = last_rollout_problem(self.journal)
        return [p] if p is not None else []

    # -- recording ---------------------------------------------------------------------------
    def _record(self, changes: Changes) -> None:
        if not changes.started and not changes.ended:
            return
        for p in changes.started:
            log.warning("problem started", kind=p.kind, subject=p.subject, reason=p.reason, severity=p.severity)
        for p in changes.ended:
            log.info("problem ended", kind=p.kind, subject=p.subject, after_s=round(time.time() - p.since, 1))
        at = utcnow()

        def write() -> None:
            with self.registry.session() as s:
                for p in changes.started:
                    q.record_event(s, to_state="problem_started", detail={"problem": p.doc()}, at=at)
                for p in changes.ended:
                    q.record_event(s, to_state="problem_ended", at=at,
                                   detail={"problem": p.doc(), "lasted_s": round(time.time() - p.since, 3)})  # fmt: skip

        try:
            if self.registry.outbox.pending():
                raise OperationalError("problem events", None, Exception(self.registry.outbox.last_error))
            write()
        except Exception as exc:  # noqa: BLE001 - the database may be the problem: kept, written when it can be
            if not unreachable(exc):
                log.warning("recording problem events failed", error=str(exc))
                return
            self.registry.outbox.keep("problem events", write, exc)


class ProblemCollector(Collector):
    """`hotswap_problem{kind,subject,severity}` (1 per open problem) and source error counters."""

    def __init__(self, monitor: HealthMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Any]:
        g = GaugeMetricFamily("hotswap_problem", "1 for each problem that holds now (see /health)",
                              labels=["kind", "subject", "severity"])  # fmt: skip
        for p in self.monitor.book.open():
            g.add_metric([p.kind, p.subject, p.severity], 1)
        errors = CounterMetricFamily("hotswap_source_errors", "Failed polls of each source since start",
                                     labels=["source"])  # fmt: skip
        for source in self.monitor.sources():
            errors.add_metric([source.label], float(getattr(source, "errors_total", 0)))
        yield from (g, errors)


def database_problems(registry: Registry) -> list[Problem]:
    try:
        with registry.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001
        return [Problem("database_unreachable", "registry", " ".join(str(exc).split())[:300])]
    return []


def health_document(problems: list[Problem]) -> tuple[dict[str, Any], int]:
    """`GET /health`: 200 unless a critical problem holds; every problem is listed either way."""
    critical = [p for p in problems if p.critical]
    doc: dict[str, Any] = {"ok": not critical}
    if critical:
        doc["error"] = "; ".join(p.line() for p in critical)
    if problems:
        doc["problems"] = [p.doc() for p in problems]
    return doc, 503 if critical else 200
