"""webhook outbox: `webhook_deliveries`, one row per event and configured webhook (daemon.webhooks)

Written in the transaction that records the event; the daemon's sender posts each in order and
marks it delivered, or undeliverable after its attempts. Additive: a daemon of the previous
release neither writes nor reads it.

Revision ID: 0021_webhook_outbox
Revises: 0020_fetched_bytes_view
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021_webhook_outbox"
down_revision = "0020_fetched_bytes_view"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("delivery_id", sa.String(36), nullable=False, unique=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("webhook", sa.String(255), nullable=False),
        sa.Column("event", sa.String(64), nullable=False),
        sa.Column("event_id", sa.BigInteger, nullable=False),
        sa.Column("version", sa.String(255)),
        sa.Column("payload", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("next_attempt_at", TS, nullable=False),
        sa.Column("delivered_at", TS),
        sa.Column("last_status", sa.Integer),
        sa.Column("last_error", sa.Text),
    )
    op.create_index("ix_webhook_deliveries_due", "webhook_deliveries", ["host", "webhook", "state", "id"])


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_due", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
