"""Runs a trial's gates, each on its own thread, records every measurement and adds them up.

A gate takes `count` measurements `interval_s` apart (a prometheus gate asked per worker takes
one per worker each time: the worst counts). More failed measurements than `failure_limit`
fails it at once; more inconclusive ones than `inconclusive_limit` ends it as `on_inconclusive`
says; a measurement that could not be taken (Prometheus down, command missing) is not counted:
`on_error = "halt"` fails the gate, `"wait"` raises the problem `gate_cannot_run` naming the gate
and the reason and tries again every `interval_s` (at least 1 s) until it runs or the trial is
cut short. A gate passes only when all its counted measurements were taken.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from daemon.common import get_logger
from daemon.gates.base import Gate, Measurement, Trial
from daemon.gates.evalcmd import EvalGate
from daemon.gates.prometheus import PrometheusGate
from daemon.gates.settings import GateSettings, GateSpec
from daemon.registry import Registry, add_run, last_good_score, utcnow

log = get_logger(__name__)
RETRY_MIN_S = 1.0


@dataclass(frozen=True)
class GateVerdict:
    gate: str
    verdict: str  # passed, failed, aborted (the trial was cut short: no verdict)
    reason: str


def build(spec: GateSpec, settings: GateSettings) -> Gate:
    if spec.kind == "prometheus":
        return PrometheusGate(spec, settings.prometheus_url)
    return EvalGate(spec)


def record(registry: Registry, trial: Trial, gate: str, kind: str, m: Measurement, n: int,
           started: float, ended: float) -> None:  # fmt: skip
    """One gate run row (the built-in checks of the health window write theirs through it too)."""
    from datetime import UTC, datetime

    with registry.session() as s:
        add_run(s, checkpoint_id=trial.checkpoint_id, gate=gate, kind=kind, host=trial.host, worker=m.worker,
                stage=trial.stage, measurement=n, value=m.value, condition=m.condition, verdict=m.verdict,
                reason=m.reason[:2000], output=m.output, started_at=datetime.fromtimestamp(started, UTC),
                ended_at=datetime.fromtimestamp(ended, UTC) if ended else utcnow())  # fmt: skip


class GateRunner:
    """The gates of this host's trials; `problems()`: the gates that cannot run now, with why."""

    def __init__(self, registry: Registry, settings: GateSettings) -> None:
        self.registry = registry
        self.settings = settings
        self._problems: dict[str, str] = {}
        self._lock = threading.Lock()

    def problems(self) -> list[tuple[str, str]]:
        with self._lock:
            return sorted(self._problems.items())

    def previous_score(self, gate: str) -> tuple[str, float] | None:
        with self.registry.session() as s:
            return last_good_score(s, self.registry.host, gate)

    def run(self, specs: list[GateSpec], trial: Trial, should_abort: Callable[[], bool]) -> list[GateVerdict]:
        """Every gate to its verdict (or to an abort), in parallel; in the order given. The first
        gate to fail stops the others (aborted): the trial's verdict is known."""
        out: dict[str, GateVerdict] = {}
        failed = threading.Event()  # one gate failed: the verdict is known, the others stop

        def one(spec: GateSpec) -> None:
            try:
                v = self._run_one(spec, trial, lambda: failed.is_set() or should_abort())
            except Exception as exc:  # noqa: BLE001 - a gate's own fault is a failed gate, never a pass
                log.exception("gate_crashed", gate=spec.name, version=trial.version)
                v = GateVerdict(spec.name, "failed", f"gate {spec.name} crashed: {exc}")
            out[spec.name] = v
            if v.verdict == "failed":
                failed.set()

        threads = [
            threading.Thread(target=one, args=(sp,), name=f"gate-{sp.name}", daemon=True) for sp in specs
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [out[sp.name] for sp in specs]

    def _run_one(self, spec: GateSpec, trial: Trial, should_abort: Callable[[], bool]) -> GateVerdict:
        gate = build(spec, self.settings)
        failures = inconclusive = taken = 0
        pause = 0.0
        while taken < spec.count:
            if _wait(pause, should_abort):
                self._clear(spec.name)
                return GateVerdict(spec.name, "aborted", f"gate {spec.name}: the trial was cut short")
            started = time.time()
            ms = gate.measure(trial)
            ended = time.time()
            for m in ms:
                record(self.registry, trial, spec.name, spec.kind, m, taken + 1, started, ended)
            errors = [m for m in ms if m.verdict == "error"]
            if errors:
                why = f"gate {spec.name} could not run: {errors[0].reason}"
                log.warning("gate_cannot_run", gate=spec.name, version=trial.version, reason=errors[0].reason)
                if spec.on_error == "halt":
                    self._clear(spec.name)
                    return GateVerdict(spec.name, "failed", why + " (on_error = halt)")
                with self._lock:
                    self._problems[spec.name] = why + f" (on_error = wait: {trial.version} held on trial)"
                pause = max(spec.interval_s, RETRY_MIN_S)
                continue
            self._clear(spec.name)
            taken, pause = taken + 1, spec.interval_s
            failed = [m for m in ms if m.verdict == "failed"]
            if failed:
                failures += 1
                if failures > spec.failure_limit:
                    return GateVerdict(spec.name, "failed", f"gate {spec.name} failed: {failed[0].reason} "
                                       f"({failures} of {taken} measurements failed, failure_limit {spec.failure_limit})")  # fmt: skip
            elif any(m.verdict == "inconclusive" for m in ms):
                inconclusive += 1
                if inconclusive > spec.inconclusive_limit:
                    why = (f"gate {spec.name}: {inconclusive} of {taken} measurements inconclusive "
                           f"(inconclusive_limit {spec.inconclusive_limit})")  # fmt: skip
                    if spec.on_inconclusive == "fail":
                        return GateVerdict(spec.name, "failed", why)
                    return GateVerdict(spec.name, "passed", why + ": passed (on_inconclusive = pass)")
        return GateVerdict(
            spec.name, "passed", f"gate {spec.name} passed ({taken} measurements, {failures} failed)"
        )

    def _clear(self, name: str) -> None:
        with self._lock:
            self._problems.pop(name, None)


def _wait(seconds: float, should_abort: Callable[[], bool]) -> bool:
    """Sleep, looking at `should_abort` every 0.1 s; True when it said stop."""
    deadline = time.monotonic() + seconds
    while True:
        if should_abort():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(0.1, left))
