"""initial registry: checkpoints, files, checks, workers, rollouts, events, aliases + views

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)

# Plain SQL that SQLite and PostgreSQL both accept: correlated subqueries, CASE, no
# dialect functions. Views are recreated by later migrations when columns change.
VERSION_HISTORY = """
CREATE VIEW version_history AS
SELECT
  c.id AS checkpoint_id,
  c.version,
  c.status,
  c.status_message,
  c.step,
  c.parent,
  c.digest,
  c.total_bytes,
  c.tensor_count,
  c.source,
  c.commit_signal,
  c.local_path,
  c.discovered_at,
  c.verified_at,
  c.deployed_at,
  (SELECT SUM(k.duration_ms) FROM checks k WHERE k.checkpoint_id = c.id) AS verify_ms,
  (SELECT COUNT(*) FROM rollouts r WHERE r.checkpoint_id = c.id) AS rollout_count,
  (SELECT MAX(r.finished_at) FROM rollouts r
     WHERE r.checkpoint_id = c.id AND r.outcome = 'rolled_back') AS rolled_back_at,
  (SELECT MAX(e.at) FROM events e
     WHERE e.checkpoint_id = c.id AND e.worker IS NULL AND e.to_state = 'superseded') AS superseded_at,
  CASE WHEN EXISTS (SELECT 1 FROM aliases a WHERE a.checkpoint_id = c.id AND a.name = 'serving')
       THEN 1 ELSE 0 END AS serving
FROM checkpoints c
ORDER BY c.id
"""

WORKER_VERSIONS = """
CREATE VIEW worker_versions AS
SELECT
  w.name AS worker,
  w.kind,
  w.url,
  w.device,
  w.state,
  w.weight_version,
  c.status AS version_status,
  w.updated_at,
  w.last_error
FROM workers w
LEFT JOIN checkpoints c ON c.version = w.weight_version
ORDER BY w.name
"""


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("version", sa.String(255), nullable=False, unique=True),
        sa.Column("source", sa.String(255), nullable=False),
        sa.Column("uri", sa.Text, nullable=False),
        sa.Column("local_path", sa.Text),
        sa.Column("commit_signal", sa.String(32)),
        sa.Column("step", sa.BigInteger),
        sa.Column("parent", sa.String(255)),
        sa.Column("digest", sa.String(16)),
        sa.Column("total_bytes", sa.BigInteger),
        sa.Column("tensor_count", sa.Integer),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("status_message", sa.Text),
        sa.Column("discovered_at", TS, nullable=False),
        sa.Column("verified_at", TS),
        sa.Column("deployed_at", TS),
    )
    op.create_index("ix_checkpoints_digest", "checkpoints", ["digest"])
    op.create_index("ix_checkpoints_status", "checkpoints", ["status"])

    op.create_table(
        "checkpoint_files",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column(
            "checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("crc32c", sa.String(8)),
        sa.UniqueConstraint("checkpoint_id", "path"),
    )
    op.create_index("ix_checkpoint_files_checkpoint_id", "checkpoint_files", ["checkpoint_id"])

    op.create_table(
        "checks",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column(
            "checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("ok", sa.Boolean, nullable=False),
        sa.Column("deferred", sa.Boolean, nullable=False),
        sa.Column("detail", sa.JSON, nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("duration_ms", sa.Float, nullable=False),
    )
    op.create_index("ix_checks_checkpoint_id", "checks", ["checkpoint_id"])

    op.create_table(
        "workers",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(255), nullable=False, unique=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("device", sa.String(64)),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("weight_version", sa.String(255)),
        sa.Column("last_error", sa.Text),
        sa.Column("updated_at", TS, nullable=False),
    )

    op.create_table(
        "rollouts",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id"), nullable=False),
        sa.Column("trigger", sa.String(32), nullable=False),
        sa.Column("transport", sa.String(32), nullable=False),
        sa.Column("mode", sa.String(32), nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS),
        sa.Column("outcome", sa.String(32)),
        sa.Column("detail", sa.JSON),
    )
    op.create_index("ix_rollouts_checkpoint_id", "rollouts", ["checkpoint_id"])

    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("at", TS, nullable=False),
        sa.Column("rollout_id", sa.Integer, sa.ForeignKey("rollouts.id")),
        sa.Column("checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id")),
        sa.Column("worker", sa.String(255)),
        sa.Column("from_state", sa.String(32)),
        sa.Column("to_state", sa.String(32), nullable=False),
        sa.Column("duration_ms", sa.Float),
        sa.Column("detail", sa.JSON),
    )
    op.create_index("ix_events_at", "events", ["at"])
    op.create_index("ix_events_rollout_id", "events", ["rollout_id"])
    op.create_index("ix_events_checkpoint_id", "events", ["checkpoint_id"])

    op.create_table(
        "aliases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id"), nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )

    op.execute(VERSION_HISTORY)
    op.execute(WORKER_VERSIONS)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS worker_versions")
    op.execute("DROP VIEW IF EXISTS version_history")
    for table in ("aliases", "events", "rollouts", "workers", "checks", "checkpoint_files", "checkpoints"):
        op.drop_table(table)
