"""Problems: every condition an operator must act on, named, with a subject, a since-time and a reason.

A probe (a part of the daemon that can see one kind of trouble) returns `Problem`s from what
it observes now; it keeps no memory of having reported them. `ProblemBook.observe` takes the
whole list of one pass (level-triggered, as a Kubernetes controller compares desired and
observed state every pass): a problem keeps the `since` of the pass that first saw it, and the
book says which problems started and which ended since the last pass, so each start and end
is recorded once. Identity is (kind, subject): a reason that changes does not restart the clock.

Critical problems turn the daemon's `/health` to 503; warnings are listed but keep it 200.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

CRITICAL = "critical"
WARNING = "warning"
# what a kind's subject is, for one-line messages ("worker w0: ...", "source s3:b/p: ...")
NOUNS = {"no_worker_serving": "group", "worker_launch_failed": "worker", "worker_crashed": "worker",
         "worker_out_of_rotation": "worker",
         "worker_stuck": "worker", "source_failing": "source", "serving_files_changed": "serving version",
         "serving_without_tokenizer": "serving version",
         "database_unreachable": "database", "database_unwritable": "database", "state_disk_full": "state directory",
         "rollout_failed": "host", "host_behind": "host", "adapter_not_on_base": "adapter",
         "fleet_stalled": "host", "fleet_decision_refused": "host", "gate_cannot_run": "gate"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Problem:
    kind: str  # what is wrong, one word (no_worker_serving, source_failing, ...)
    subject: str  # what it is wrong with: a group, a worker, a source, a version, a host
    reason: str  # one line, for a person
    severity: str = CRITICAL
    since: float = 0.0  # Unix time the book first saw it (set by ProblemBook)

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.subject

    @property
    def critical(self) -> bool:
        return self.severity == CRITICAL

    def line(self) -> str:
        return f"{NOUNS.get(self.kind, self.kind)} {self.subject}: {self.reason}"

    def doc(self) -> dict[str, Any]:
        return {"kind": self.kind, "subject": self.subject, "reason": self.reason,
                "severity": self.severity, "since": self.since}  # fmt: skip


@dataclass
class Changes:
    started: list[Problem] = field(default_factory=list)
    ended: list[Problem] = field(default_factory=list)


class ProblemBook:
    """The problems of the last pass, with since-times; thread-safe (API threads and a timer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], Problem] = {}

    def observe(self, seen: Iterable[Problem], now: float | None = None) -> tuple[list[Problem], Changes]:
        now = time.time() if now is None else now
        changes = Changes()
        with self._lock:
            current: dict[tuple[str, str], Problem] = {}
            for p in seen:
                if p.key in current:
                    continue  # two probes saw the same thing: the first reason stands
                was = self._open.get(p.key)
                current[p.key] = replace(p, since=was.since if was is not None else now)
                if was is None:
                    changes.started.append(current[p.key])
            changes.ended = [p for k, p in self._open.items() if k not in current]
            self._open = current
            return sorted(current.values(), key=lambda p: (not p.critical, p.since, p.key)), changes

    def open(self) -> list[Problem]:
        with self._lock:
            return sorted(self._open.values(), key=lambda p: (not p.critical, p.since, p.key))
