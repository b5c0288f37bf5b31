"""fleet_host_reasons: why each host does not serve the fleet target, written by its own agent

A host shown `behind` said why only in its own log. Each fleet daemon's agent now writes one
row (host, target, cause, reason, since) when its reason changes and deletes it once the host
serves the target, so `hotswap status --fleet` (and SQL) can show every host's reason.
Additive: a daemon of the previous release never reads or writes it.

Revision ID: 0009_fleet_host_reasons
Revises: 0008_checkpoint_last_good_at
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_fleet_host_reasons"
down_revision = "0008_checkpoint_last_good_at"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "fleet_host_reasons",
        sa.Column("host", sa.String(255), primary_key=True),
        sa.Column("target", sa.String(255), nullable=False),
        sa.Column("cause", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("since", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("fleet_host_reasons")
