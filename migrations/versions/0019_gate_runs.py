"""gate_runs: every measurement of every gate (daemon.gates), and the view why_halted

A gate is a named check with a threshold run against a version while it is on trial (a host's
health window, a fleet stage's bake): a PromQL query, an eval command, or one of the built-in
checks (error_rate, greedy_probe, finite_logits). Each measurement is a row: gate, kind, version,
host, worker, stage, value, condition, verdict, reason, output tail, started and ended. The view
`why_halted` lists the failed and errored ones with their version.

Additive (expand-first): a new table and a view; a daemon of the previous release never reads
them.

Revision ID: 0019_gate_runs
Revises: 0017_delta_checkpoints
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019_gate_runs"
down_revision = "0017_delta_checkpoints"
branch_labels = None
depends_on = None

WHY_HALTED_SQL = (
    "SELECT c.version, g.gate, g.kind, g.host, g.worker, g.stage, g.measurement, g.value, g.condition, "
    "g.verdict, g.reason, g.output, g.started_at, g.ended_at "
    "FROM gate_runs g JOIN checkpoints c ON c.id = g.checkpoint_id WHERE g.verdict IN ('failed', 'error')"
)


def upgrade() -> None:
    op.create_table(
        "gate_runs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False),
        sa.Column("gate", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("worker", sa.String(128)),
        sa.Column("stage", sa.Integer),
        sa.Column("measurement", sa.Integer, nullable=False),
        sa.Column("value", sa.Float),
        sa.Column("condition", sa.String(255), nullable=False),
        sa.Column("verdict", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("output", sa.Text),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_gate_runs_checkpoint_gate", "gate_runs", ["checkpoint_id", "gate"])
    op.execute(f"CREATE VIEW why_halted AS {WHY_HALTED_SQL}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS why_halted")
    op.drop_index("ix_gate_runs_checkpoint_gate", table_name="gate_runs")
    op.drop_table("gate_runs")
