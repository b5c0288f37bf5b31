"""staged fleet rollouts: fleet_rollouts, fleet_rollout_hosts and the view fleet_stage_hosts

A new version reaches the hosts of one stage at a time (daemon.fleet.stages). `fleet_rollouts`
holds each staged rollout (its plan, its stage, running / paused / halted / aborted / done /
superseded, and why); `fleet_rollout_hosts` which stage admitted each host. The view
`fleet_stage_hosts` shows every admitted host with what it serves and where it stands:

    passed   serves the version and passed its health window there (its last_good)
    serving  serves it, its health window still open
    failed   its rollout of the version failed or was rolled back
    back     was admitted, and serves the previous version again (after a halt or an abort)
    waiting  admitted, not on it yet

Additive (expand-first): two new tables and a view; a daemon of the previous release never
reads them and deploys as before.

Revision ID: 0014_fleet_stages
Revises: 0013_adapters
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_fleet_stages"
down_revision = "0013_adapters"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)

FLEET_STAGE_HOSTS = """
CREATE VIEW fleet_stage_hosts AS
SELECT
  fr.id AS rollout_id,
  c.version,
  fr.state AS rollout_state,
  fr.stage AS rollout_stage,
  h.stage,
  h.host,
  h.admitted_at,
  sv.version AS serving,
  CASE
    WHEN EXISTS (SELECT 1 FROM rollouts r WHERE r.checkpoint_id = fr.checkpoint_id AND r.host = h.host
                 AND r.outcome IN ('failed', 'rolled_back')) THEN 'failed'
    WHEN sv.checkpoint_id = fr.checkpoint_id AND lg.checkpoint_id = fr.checkpoint_id THEN 'passed'
    WHEN sv.checkpoint_id = fr.checkpoint_id THEN 'serving'
    WHEN fr.state IN ('halted', 'aborted') AND sv.checkpoint_id = fr.previous_checkpoint_id THEN 'back'
    ELSE 'waiting'
  END AS host_state
FROM fleet_rollout_hosts h
JOIN fleet_rollouts fr ON fr.id = h.rollout_id
JOIN checkpoints c ON c.id = fr.checkpoint_id
LEFT JOIN aliases lg ON lg.host = h.host AND lg.name = 'last_good'
LEFT JOIN (SELECT a.host, a.checkpoint_id, sc.version FROM aliases a JOIN checkpoints sc ON sc.id = a.checkpoint_id
           WHERE a.name = 'serving') sv ON sv.host = h.host
"""


def upgrade() -> None:
    op.create_table(
        "fleet_rollouts",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column(
            "checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("previous_checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id", ondelete="SET NULL")),
        sa.Column("plan", sa.JSON, nullable=False),
        sa.Column("stage", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("created_by", sa.String(255)),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("stage_started_at", TS, nullable=False),
        sa.Column("stage_ready_at", TS),
        sa.UniqueConstraint("checkpoint_id"),
    )
    op.create_index("ix_fleet_rollouts_state", "fleet_rollouts", ["state"])
    op.create_table(
        "fleet_rollout_hosts",
        sa.Column(
            "rollout_id", sa.Integer, sa.ForeignKey("fleet_rollouts.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("stage", sa.Integer, nullable=False),
        sa.Column("admitted_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("rollout_id", "host"),
    )
    op.execute(FLEET_STAGE_HOSTS)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS fleet_stage_hosts")
    op.drop_table("fleet_rollout_hosts")
    op.drop_table("fleet_rollouts")
