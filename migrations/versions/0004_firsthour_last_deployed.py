"""last deployed: checkpoints.last_deployed_at; deployed_at is the first deploy again

A rollback (or pin) that puts a version back used to overwrite `deployed_at`, so the history
lost when the version first went out. Now `deployed_at` is written once, at the first deploy,
and `last_deployed_at` every time the version becomes the deployed one (what "the version
deployed before this one" is ordered by).

Existing rows: `last_deployed_at` takes `deployed_at` (the latest deploy, as it was written),
and `deployed_at` goes back to the first `-> deployed` event of the checkpoint where there is one.

Revision ID: 0004_firsthour_last_deployed
Revises: 0003_file_hashes
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_firsthour_last_deployed"
down_revision = "0003_file_hashes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("last_deployed_at", sa.DateTime(timezone=True)))
    op.execute("UPDATE checkpoints SET last_deployed_at = deployed_at")
    op.execute(
        "UPDATE checkpoints SET deployed_at = COALESCE("
        "(SELECT MIN(e.at) FROM events e WHERE e.checkpoint_id = checkpoints.id "
        "AND e.worker IS NULL AND e.to_state = 'deployed'), deployed_at) "
        "WHERE deployed_at IS NOT NULL"
    )


def downgrade() -> None:
    op.execute("UPDATE checkpoints SET deployed_at = last_deployed_at WHERE last_deployed_at IS NOT NULL")
    op.drop_column("checkpoints", "last_deployed_at")
