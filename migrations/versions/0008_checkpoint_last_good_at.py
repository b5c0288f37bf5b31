"""checkpoints.last_good_at: when some host last made the version its `last_good`

The fleet target (without an operator's) was "the newest version some host has as last_good
now"; after `hotswap fleet target <older>` every host's last_good is the older version, so
clearing the target kept the fleet there. The target is now the newest verified, not rejected
version that was ever some host's last_good, which this column remembers (written with the
alias, by every host). Additive: a daemon of the previous release ignores it.

Existing rows: the versions that are some host's last_good now get that alias's time.

Revision ID: 0008_checkpoint_last_good_at
Revises: 0007_events_state_index
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_checkpoint_last_good_at"
down_revision = "0007_events_state_index"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("last_good_at", sa.DateTime(timezone=True)))
    op.execute(
        "UPDATE checkpoints SET last_good_at = (SELECT MAX(a.updated_at) FROM aliases a "
        "WHERE a.checkpoint_id = checkpoints.id AND a.name = 'last_good') "
        "WHERE id IN (SELECT checkpoint_id FROM aliases WHERE name = 'last_good')"
    )


def downgrade() -> None:
    op.drop_column("checkpoints", "last_good_at")
