"""LoRA adapter checkpoints: checkpoints.kind / adapter_name / base_model, per-adapter aliases,
which adapter version each worker serves, and the view `worker_adapter_versions`

An adapter (PEFT layout) is a checkpoint of kind "adapter" with a name of its own (what clients
send as `model`) and the base it was trained for. Each name has its own serving / last_good /
pinned on each host (`adapter_aliases`); `worker_adapters` is what each worker serves, written
when the daemon loads or sees it. Additive (expand-first): the new columns default to a full
checkpoint, and a daemon of the previous release never reads the new tables.

Revision ID: 0013_adapters
Revises: 0012_checkpoint_status_counts
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_adapters"
down_revision = "0012_checkpoint_status_counts"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)

# One row per (host, worker, adapter): the version the worker serves under that name, whether
# it is the name's serving version on that host, and the version's status and base.
WORKER_ADAPTER_VERSIONS = """
CREATE VIEW worker_adapter_versions AS
SELECT
  wa.host,
  wa.worker,
  w.kind,
  w.state,
  wa.adapter,
  c.version,
  c.status AS version_status,
  c.base_model,
  (SELECT sc.version FROM adapter_aliases aa JOIN checkpoints sc ON sc.id = aa.checkpoint_id
     WHERE aa.host = wa.host AND aa.adapter = wa.adapter AND aa.name = 'serving') AS serving,
  wa.loaded_at
FROM worker_adapters wa
JOIN checkpoints c ON c.id = wa.checkpoint_id
LEFT JOIN workers w ON w.host = wa.host AND w.name = wa.worker
"""


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("kind", sa.String(16), nullable=False, server_default="full"))
    op.add_column("checkpoints", sa.Column("adapter_name", sa.String(255)))
    op.add_column("checkpoints", sa.Column("base_model", sa.Text))
    op.create_index("ix_checkpoints_adapter_name", "checkpoints", ["adapter_name"])
    op.create_table(
        "adapter_aliases",
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("adapter", sa.String(255), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id"), nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("host", "adapter", "name"),
    )
    op.create_table(
        "worker_adapters",
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("worker", sa.String(255), nullable=False),
        sa.Column("adapter", sa.String(255), nullable=False),
        sa.Column("checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id"), nullable=False),
        sa.Column("loaded_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("host", "worker", "adapter"),
    )
    op.create_index("ix_worker_adapters_checkpoint_id", "worker_adapters", ["checkpoint_id"])
    op.execute(WORKER_ADAPTER_VERSIONS)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS worker_adapter_versions")
    op.drop_table("worker_adapters")
    op.drop_table("adapter_aliases")
    op.drop_index("ix_checkpoints_adapter_name", "checkpoints")
    for column in ("base_model", "adapter_name", "kind"):  # in place (SQLite >= 3.35, PostgreSQL): no table rebuild
        op.execute(f"ALTER TABLE checkpoints DROP COLUMN {column}")
