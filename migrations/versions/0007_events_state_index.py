"""events: an index on (to_state, at), for the newest event of a kind (the last rejection)

`hotswap_last_failure_timestamp_seconds` counts rejected checkpoints too, read at scrape time
from the registry so it survives a restart; without this index that is a scan of every event.
Additive: daemons of the previous release run unchanged against it.

Revision ID: 0007_events_state_index
Revises: 0006_sqlite_digest_width
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0007_events_state_index"
down_revision = "0006_sqlite_digest_width"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_events_to_state_at", "events", ["to_state", "at"])


def downgrade() -> None:
    op.drop_index("ix_events_to_state_at", table_name="events")
