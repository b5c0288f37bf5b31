"""A version's trial on this host: the health window's built-in checks and its gates, side by side.

The gates (daemon.gates) of a trial are `[gates] health` plus, for a host a staged fleet rollout
admitted, its stage's `gates` (daemon.fleet.stages.stage_gates). They run on their own threads
while daemon.rollout.health watches the workers; the window ends when both are done. Its verdict
fails when the built-in checks fail (the gates are then cut short) or when any gate fails; a
trial cut short by an operator command or shutdown decides nothing. A gate waiting for what it needs to run (`on_error = "wait"`) stops too when the version is
rejected meanwhile (its staged rollout aborted). The built-in checks' results
are written as gate runs of the same shape (error_rate per worker, greedy_probe, finite_logits),
so `hotswap show` and the view `why_halted` read every verdict one way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

from daemon.config import RolloutSettings
from daemon.fleet import stage_gates
from daemon.gates import GateRunner, GateSettings, GateSpec, GateVerdict, Measurement, Trial, record
from daemon.registry import CheckpointRef, CheckpointStatus, Journal
from daemon.rollout import WindowVerdict, WorkerSet, health


def trial_of(journal: Journal, fleet: WorkerSet, ckpt: CheckpointRef, gates: GateSettings,
             runner: GateRunner | None) -> tuple[Trial, list[GateSpec]]:  # fmt: skip
    """The trial of `ckpt` on this host and the gates it runs."""
    names = list(gates.health)
    stage = stage_gates(journal.registry, ckpt.id, journal.registry.host)
    if stage is not None:
        names += [n for n in stage[1] if n not in names]
    trial = Trial(ckpt.id, ckpt.version, ckpt.local_path or "", journal.registry.host, stage[0] if stage else None,
                  tuple((h.name, h.url) for h in fleet),
                  runner.previous_score if runner is not None else (lambda _g: None))  # fmt: skip
    return trial, gates.named(names)


class TrialWatch:
    """A trial as a condition its owner steps (daemon.rollout.health.Stepped): the built-in checks
    sampled when due, the gates on their own thread; the verdict once both are done."""

    GATES_POLL_S = 0.05  # how often a finished health window looks whether its gates are done

    def __init__(self, journal: Journal, fleet: WorkerSet, settings: RolloutSettings, gates: GateSettings,
                 runner: GateRunner | None, interrupted: Callable[[], bool], ckpt: CheckpointRef) -> None:  # fmt: skip
        self.journal, self.settings = journal, settings
        self.trial, specs = trial_of(journal, fleet, ckpt, gates, runner)
        self.verdicts: list[GateVerdict] = []
        self.cut = threading.Event()
        self.thread: threading.Thread | None = None
        if specs and runner is not None:
            rejected = _rejected_meanwhile(journal, ckpt.id)

            def run() -> None:
                self.verdicts.extend(runner.run(specs, self.trial, lambda: self.cut.is_set() or interrupted() or rejected()))

            self.thread = threading.Thread(target=run, name="trial-gates", daemon=True)
            self.thread.start()
        self.started = time.time()
        self.health = health.HealthWatch(fleet, settings, interrupted, ckpt.version)
        self.window: WindowVerdict | None = None  # the built-in checks' verdict, once given

    @property
    def due(self) -> float:
        return self.health.due if self.window is None else time.monotonic() + self.GATES_POLL_S

    def step(self) -> WindowVerdict | None:
        if self.window is None:
            verdict = self.health.step()
            if verdict is None:
                return None
            if not verdict.aborted:
                _record_builtin(self.journal, self.trial, self.settings, verdict, self.started)
            if not verdict.ok:
                self.cut.set()  # the window failed already: its gates need not finish
            self.window = verdict
        if self.thread is not None and self.thread.is_alive():
            return None
        verdict = self.window
        if verdict.aborted or not verdict.ok:
            return verdict
        failed = [v for v in self.verdicts if v.verdict == "failed"]
        if failed:  # before an abort: a failing gate stops the others
            return replace(verdict, ok=False, reason="; ".join(v.reason for v in failed), check=failed[0].gate)
        if any(v.verdict == "aborted" for v in self.verdicts):
            return replace(verdict, ok=False, aborted=True)
        return verdict


def _rejected_meanwhile(journal: Journal, checkpoint_id: int, every_s: float = 2.0) -> Callable[[], bool]:
    """Was the version rejected while its gates ran (its staged rollout aborted by an operator, a
    stage host's verdict)? Then a gate waiting to run need not wait on: looked up every `every_s`."""
    last = [0.0, False]

    def check() -> bool:
        if not last[1] and time.monotonic() - last[0] >= every_s:
            ref = journal.checkpoint(checkpoint_id)
            last[:] = [time.monotonic(), ref is None or ref.status == CheckpointStatus.REJECTED]
        return bool(last[1])

    return check


def _record_builtin(
    journal: Journal, trial: Trial, settings: RolloutSettings, v: WindowVerdict, started: float
) -> None:
    ended = time.time()
    rows: list[tuple[str, Measurement]] = []
    bound = f"<= {settings.max_error_rate:g}"
    for name, w in sorted(v.workers.items()):
        requests = int(w.get("requests", 0)) + int(w.get("probes", 0))
        rate = float(w.get("rate", 0.0))
        if v.check == "error_rate" and name in (v.reason or ""):
            m = Measurement("failed", rate, bound, v.reason or "", name)
        elif requests < settings.min_window_requests:
            m = Measurement("inconclusive", rate, bound, f"{requests} requests (min_window_requests "
                            f"{settings.min_window_requests})", name)  # fmt: skip
        else:
            m = Measurement("passed", rate, bound, f"error rate {rate:.2%} over {requests} requests", name)
        rows.append(("error_rate", m))
    probes = sum(int(w.get("probes", 0)) for w in v.workers.values())
    failed = sum(int(w.get("probes_failed", 0)) for w in v.workers.values())
    for check in ("greedy_probe", "finite_logits"):
        if v.check == check:
            rows.append((check, Measurement("failed", float(failed), "== 0", v.reason or "")))
        elif probes:
            rows.append((check, Measurement("passed", 0.0, "== 0", f"{probes} probes, none decisive "
                                            f"({failed} errors: counted in error_rate)")))  # fmt: skip
    for gate, m in rows:
        record(journal.registry, trial, gate, "builtin", m, 1, started, ended)
