"""What every gate is: one small interface (`Gate.measure`), the trial it runs in, and its measurements."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from daemon.gates.settings import CONDITION_RE, GateSpec

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne}  # fmt: skip


@dataclass(frozen=True)
class Condition:
    """`< 0.01`: a comparison of a measured value with a bound."""

    op: str
    bound: float

    @classmethod
    def parse(cls, text: str) -> Condition:
        m = CONDITION_RE.match(text)
        if m is None:
            raise ValueError(f"condition {text!r} must be an operator and a number, e.g. '< 0.01'")
        return cls(m.group(1), float(m.group(2)))

    def holds(self, value: float) -> bool:
        return _OPS[self.op](value, self.bound)

    def __str__(self) -> str:
        return f"{self.op} {self.bound:g}"


@dataclass(frozen=True)
class Trial:
    """A version on trial on this host: what a gate is run against."""

    checkpoint_id: int
    version: str
    version_dir: str  # its local folder
    host: str
    stage: int | None  # the fleet stage (0-based) that admitted this host; None: the host's own window
    workers: tuple[tuple[str, str], ...]  # (name, serving base URL) of each worker serving it
    # the score a gate recorded as passed on this host's last good version: (version, score)
    previous_score: Callable[[str], tuple[str, float] | None] = lambda _gate: None


@dataclass(frozen=True)
class Measurement:
    """One measurement: `verdict` is passed, failed, inconclusive (no data) or error (could not run)."""

    verdict: str
    value: float | None = None
    condition: str = ""
    reason: str = ""
    worker: str | None = None
    output: str | None = None  # eval: stdout and stderr tails


class Gate(Protocol):
    """A gate kind: built from its spec, measures a trial once (a query per worker: one each)."""

    spec: GateSpec

    def measure(self, trial: Trial) -> list[Measurement]: ...


def judge(value: float | None, cond: Condition, what: str, worker: str | None = None) -> Measurement:
    """A measured value held to a condition; none or NaN is inconclusive."""
    if value is None or math.isnan(value):
        return Measurement("inconclusive", None, str(cond), f"{what}: no data", worker)
    ok = cond.holds(value)
    return Measurement("passed" if ok else "failed", value, str(cond),
                       f"{what} = {value:g} {'meets' if ok else 'does not meet'} {cond}", worker)  # fmt: skip
