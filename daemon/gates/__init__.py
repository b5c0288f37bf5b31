"""Gates: named checks with thresholds run against a version while it is on trial.

A trial is a host's health window after a new version reached its workers (single host, or a
host a fleet stage admitted: the stage's gates run there too). A gate that fails rolls the host
back and rejects the version, which halts its staged fleet rollout (daemon.fleet.stages); a
gate that cannot run is a problem, and the trial waits or fails as configured: it never passes.

    settings    `[gates]`: the Prometheus URL, the gates of every health window, each gate
    base        the interface (`Gate.measure(trial) -> [Measurement]`), conditions, the trial
    prometheus  a PromQL query held to a condition
    evalcmd     a user command's exit status and score held to a bound (absolute, or relative
                to the last good version's recorded score)
    runner      a trial's gates, in parallel: count, interval, limits, records every measurement

The built-in checks of the health window (error_rate, greedy_probe, finite_logits) are recorded
as gate runs of the same shape by daemon.controller.health_window. Rows: daemon.registry.gate_runs.
"""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.gates.base import Measurement, Trial
    from daemon.gates.runner import GateRunner, GateVerdict, record
    from daemon.gates.settings import GateSettings, GateSpec, stage_gates_problem

__all__ = [
    "GateRunner", "GateSettings", "GateSpec", "GateVerdict", "Measurement", "Trial", "record",
    "stage_gates_problem"
]

__getattr__ = public_face(__name__)
