"""`gate_runs`: every measurement of every gate (daemon.gates), one row each, and what they add up to.

A row is one measurement of one gate against one version on one host (and worker, for a query
per worker): its value, the condition it was held to, the verdict (passed, failed, inconclusive,
error: the gate could not run), when it started and ended, and for an eval gate its stdout and
stderr tails. The built-in checks of the health window (error_rate, greedy_probe, finite_logits)
write rows of the same shape. The view `why_halted` lists the failed and errored ones with their
version: "why was V halted" is `SELECT * FROM why_halted WHERE version = 'V'`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Float, ForeignKey, Index, Integer, String, Text, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from daemon.registry.models import Alias, Base, Checkpoint, utcnow

VERDICTS = ("passed", "failed", "inconclusive", "error")


class GateRun(Base):
    __tablename__ = "gate_runs"
    __table_args__ = (Index("ix_gate_runs_checkpoint_gate", "checkpoint_id", "gate"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    gate: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16))  # prometheus, eval, builtin
    host: Mapped[str] = mapped_column(String(255))
    worker: Mapped[str | None] = mapped_column(String(128))  # a per-worker measurement
    stage: Mapped[int | None] = mapped_column(Integer)  # its fleet stage (0-based); NULL: the host's own
    measurement: Mapped[int] = mapped_column(Integer, default=1)  # 1..count
    value: Mapped[float | None] = mapped_column(Float)
    condition: Mapped[str] = mapped_column(String(255), default="")
    verdict: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)  # one line: why this verdict
    output: Mapped[str | None] = mapped_column(Text)  # eval: stdout and stderr tails
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime] = mapped_column(default=utcnow)


def add_run(s: Session, **row: Any) -> None:
    if row.get("verdict") not in VERDICTS:
        raise ValueError(f"gate run verdict {row.get('verdict')!r} is not one of {', '.join(VERDICTS)}")
    s.add(GateRun(**row))


def runs_of(s: Session, checkpoint_id: int) -> list[dict[str, Any]]:
    """Every gate run of a version, oldest first (for `hotswap show` and rollout status)."""
    rows = s.scalars(select(GateRun).where(GateRun.checkpoint_id == checkpoint_id).order_by(GateRun.id))
    return [{"gate": r.gate, "kind": r.kind, "host": r.host, "worker": r.worker, "stage": r.stage,
             "measurement": r.measurement, "value": r.value, "condition": r.condition, "verdict": r.verdict,
             "reason": r.reason, "output": r.output, "started_at": r.started_at.isoformat(),
             "ended_at": r.ended_at.isoformat()} for r in rows]  # fmt: skip


def last_good_score(s: Session, host: str, gate: str) -> tuple[str, float] | None:
    """The score the gate recorded as passed on this host's last good version: (version, score)."""
    alias = s.get(Alias, (host, "last_good"))
    if alias is None or alias.checkpoint_id is None:
        return None
    row = s.execute(select(Checkpoint.version, GateRun.value).join(Checkpoint, Checkpoint.id == GateRun.checkpoint_id)
                    .where(GateRun.checkpoint_id == alias.checkpoint_id, GateRun.gate == gate,
                           GateRun.verdict == "passed", GateRun.value.is_not(None))
                    .order_by(GateRun.id.desc()).limit(1)).first()  # fmt: skip
    return (row[0], float(row[1])) if row is not None and row[1] is not None else None


def summary(s: Session, checkpoint_id: int) -> list[dict[str, Any]]:
    """Each gate's measurements of a version per host (and worker), added up, with the last one."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in runs_of(s, checkpoint_id):
        d = out.setdefault((r["stage"], r["host"], r["gate"], r["worker"]), {
            "gate": r["gate"], "kind": r["kind"], "host": r["host"], "worker": r["worker"], "stage": r["stage"],
            "measurements": 0, **dict.fromkeys(VERDICTS, 0)})  # fmt: skip
        d["measurements"] += 1
        d[r["verdict"]] += 1
        d.update(last=r["verdict"], value=r["value"], condition=r["condition"], reason=r["reason"],
                 output=r["output"], ended_at=r["ended_at"])  # fmt: skip
    return list(out.values())


def summary_line(g: dict[str, Any]) -> str:
    """One gate's summary in words, as `hotswap show` and `hotswap fleet rollout status` print it."""
    where = g["host"] + (f"/{g['worker']}" if g["worker"] else "")
    counts = ", ".join(f"{g[v]} {v}" for v in VERDICTS if g[v])
    value = f"value {g['value']:g} " if g["value"] is not None else ""
    cond = f"(condition {g['condition']})" if g["condition"] else ""
    return f"{g['gate']} ({g['kind']}) on {where}: {g['last']}, {counts}; last {value}{cond}: {g['reason'] or ''}"
