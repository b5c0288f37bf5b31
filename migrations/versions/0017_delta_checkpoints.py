"""checkpoints: how a version arrived (full, or a delta on a base) and what fetching it cost

`encoding` ("full" | "delta"), `delta_base` (the version a delta was rebuilt from), `fetched_bytes`
(bytes this host read from the source for it: the delta files, for a delta) and `delta_ratio`
(delta bytes / the full result's bytes). daemon.delta; `hotswap history` and `show` display them.

Expand only: four nullable columns; the previous release ignores them.

Revision ID: 0017_delta_checkpoints
Revises: 0016_fleet_decisions
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017_delta_checkpoints"
down_revision = "0016_fleet_decisions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("encoding", sa.String(16)))
    op.add_column("checkpoints", sa.Column("delta_base", sa.String(255)))
    op.add_column("checkpoints", sa.Column("fetched_bytes", sa.BigInteger))
    op.add_column("checkpoints", sa.Column("delta_ratio", sa.Float))


def downgrade() -> None:
    for name in ("delta_ratio", "fetched_bytes", "delta_base", "encoding"):  # in place (SQLite >= 3.35,
        op.execute(f"ALTER TABLE checkpoints DROP COLUMN {name}")  # PostgreSQL): no table rebuild, which SQLite's
        # foreign keys to checkpoints refuse (DROP TABLE checkpoints: FOREIGN KEY constraint failed)
