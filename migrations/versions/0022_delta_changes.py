"""checkpoints: what a delta changed, and the compacted delta a host without the base can take

`tensors_changed` and `elements_changed` (of the delta against its base, from its signed manifest),
`compacted_from` (the anchor a compacted delta of this version starts at) and `compacted_bytes`
(its bytes). daemon.delta; `hotswap history`, `show` and `status` display them, and a fleet host
without the base compares `compacted_bytes` with the chain's bytes (daemon.fleet.fetch).

Expand only: four nullable columns; the previous release ignores them.

Revision ID: 0022_delta_changes
Revises: 0021_webhook_outbox
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022_delta_changes"
down_revision = "0021_webhook_outbox"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("tensors_changed", sa.Integer))
    op.add_column("checkpoints", sa.Column("elements_changed", sa.BigInteger))
    op.add_column("checkpoints", sa.Column("compacted_from", sa.String(255)))
    op.add_column("checkpoints", sa.Column("compacted_bytes", sa.BigInteger))


def downgrade() -> None:
    # in place, as 0017 does
    for name in ("compacted_bytes", "compacted_from", "elements_changed", "tensors_changed"):
        op.execute(f"ALTER TABLE checkpoints DROP COLUMN {name}")
