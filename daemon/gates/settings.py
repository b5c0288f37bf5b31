"""`[gates]`: named checks run against a version while it is on trial (daemon.gates).

    [gates]
    prometheus_url = "http://127.0.0.1:9090"   # the Prometheus every prometheus gate asks
    health = ["error-budget"]                   # gates of every health window of this host

    [[gates.gate]]
    name = "error-budget"
    kind = "prometheus"
    query = 'sum(rate(hotswap_worker_errors_total{host="{host}"}[1m]))'
    condition = "< 0.01"
    count = 5                                   # measurements, `interval_s` apart
    interval_s = 10
    failure_limit = 0                           # more failed measurements than this: the gate fails
    inconclusive_limit = 1                      # more without data than this: `on_inconclusive`

    [[gates.gate]]
    name = "eval"
    kind = "eval"
    command = ["python3", "/opt/eval/score.py"]  # argv, never a shell string
    max_drop = 0.0                               # score >= the last good version's score - max_drop

A fleet stage names the gates its hosts run too (`[[fleet.stages]] gates = [...]`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$")
CONDITION_RE = re.compile(r"^\s*(<=|>=|==|!=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
BUILTIN = ("error_rate", "greedy_probe", "finite_logits")  # recorded by the health window itself


@dataclass
class GateSpec:
    """`[[gates.gate]]`: one named check with a threshold."""

    name: str  # how [gates] health and [[fleet.stages]] gates name it; its rows in gate_runs
    kind: Literal["prometheus", "eval"]  # a PromQL query held to a condition, or a command's score
    count: int = 1  # measurements taken (Argo's count)
    interval_s: float = 10.0  # between measurements
    failure_limit: int = 0  # failed measurements tolerated (Argo's failureLimit)
    inconclusive_limit: int = 0  # measurements without data tolerated (Argo's inconclusiveLimit)
    on_inconclusive: Literal["fail", "pass"] = "fail"  # the gate's verdict past inconclusive_limit
    # a gate that cannot run (Prometheus down, command missing): "wait" retries it every interval_s
    # with a problem raised, the version held on trial; "halt" fails it. Never a pass.
    on_error: Literal["wait", "halt"] = "wait"
    # prometheus: PromQL with {version} {host} {worker} filled in ({worker}: one query per worker)
    query: str = ""
    condition: str = ""  # "< 0.01": every series the query returns must meet it
    timeout_s: float = 10.0  # one query (prometheus) or the whole command (eval: killed at it)
    # eval: argv run with HOTSWAP_WORKER_URL, HOTSWAP_VERSION, HOTSWAP_VERSION_DIR in its environment
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to the command's environment
    output_cap: int = 65536  # bytes of stdout and of stderr kept (the tails); a score is read from stdout's
    min_score: float | None = None  # absolute bound: score >= min_score
    max_drop: float | None = None  # relative: score >= the last good version's recorded score - max_drop

    def validate(self, key: str) -> None:
        if not _NAME_RE.match(self.name) or self.name in BUILTIN:
            raise ValueError(f"{key}.name: {self.name!r} must be 1-128 letters, digits or _.@- and not one of "
                             f"the built-in gates ({', '.join(BUILTIN)})")  # fmt: skip
        if self.count < 1 or self.failure_limit < 0 or self.inconclusive_limit < 0:
            raise ValueError(f"{key}: count must be >= 1, failure_limit and inconclusive_limit >= 0")
        if self.interval_s < 0 or self.timeout_s <= 0:
            raise ValueError(f"{key}: interval_s must be >= 0 and timeout_s > 0")
        if self.kind == "prometheus":
            if not self.query.strip():
                raise ValueError(f"{key}.query: a prometheus gate needs a PromQL query")
            if not CONDITION_RE.match(self.condition):
                raise ValueError(
                    f"{key}.condition: {self.condition!r} must be an operator and a number, e.g. '< 0.01'"
                )
        else:
            if not self.command or not all(isinstance(a, str) and a for a in self.command):
                raise ValueError(
                    f'{key}.command: an eval gate needs an argv list, e.g. ["python3", "score.py"]'
                )
            if self.min_score is None and self.max_drop is None:
                raise ValueError(f"{key}: an eval gate needs min_score, max_drop or both")
            if self.max_drop is not None and self.max_drop < 0:
                raise ValueError(f"{key}.max_drop: must be >= 0")
            if self.output_cap < 256:
                raise ValueError(f"{key}.output_cap: must be >= 256 bytes")


@dataclass
class GateSettings:
    prometheus_url: str = ""  # base URL of the Prometheus HTTP API prometheus gates query
    health: list[str] = field(default_factory=list)  # gates every health window of this host runs
    gate: list[GateSpec] = field(default_factory=list)  # the gates, one [[gates.gate]] table each

    def validate(self, key: str) -> None:
        names = [g.name for g in self.gate]
        for i, g in enumerate(self.gate):
            g.validate(f"{key}.gate[{i}]")
            if names.count(g.name) > 1:
                raise ValueError(f"{key}.gate[{i}].name: {g.name!r} is defined twice")
        if any(g.kind == "prometheus" for g in self.gate) and not self.prometheus_url.startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                f"{key}.prometheus_url: prometheus gates need the Prometheus URL (http:// or https://)"
            )
        for n in self.health:
            if n not in names:
                raise ValueError(f"{key}.health: no gate named {n!r} (defined: {', '.join(names) or 'none'})")

    def named(self, names: list[str]) -> list[GateSpec]:
        by = {g.name: g for g in self.gate}
        return [by[n] for n in names if n in by]


def stage_gates_problem(gates: GateSettings, stage_gates: list[list[str]]) -> str | None:
    """A `[[fleet.stages]] gates` entry naming no defined gate (one line), else None."""
    names = {g.name for g in gates.gate}
    for i, wanted in enumerate(stage_gates):
        for n in wanted:
            if n not in names:
                return f"fleet.stages[{i}].gates: no gate named {n!r} (define it in [[gates.gate]])"
    return None
