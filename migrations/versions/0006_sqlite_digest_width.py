"""SQLite: checkpoints.digest declared VARCHAR(80), as the model and PostgreSQL have it since 0003

0003 widened the column on PostgreSQL only (SQLite does not enforce lengths), so `alembic check`
on a SQLite registry reported the model and the schema apart. On SQLite the column is swapped in
place: a VARCHAR(80) column is added and filled, the old one dropped (SQLite >= 3.35) and the new
one renamed, with every view and the digest index dropped first and created again as they were
(a table rebuild would cascade through the foreign keys that reference checkpoints). Values are
unchanged. PostgreSQL: nothing to do.

Revision ID: 0006_sqlite_digest_width
Revises: 0005_fleet_hosts
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_sqlite_digest_width"
down_revision = "0005_fleet_hosts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _swap_digest_column("VARCHAR(80)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _swap_digest_column("VARCHAR(16)")


def _swap_digest_column(declared: str) -> None:
    bind = op.get_bind()
    views = [(str(n), str(q)) for n, q in bind.execute(
        sa.text("SELECT name, sql FROM sqlite_master WHERE type = 'view' ORDER BY rowid")).all()]  # fmt: skip
    for name, _ in reversed(views):
        op.execute(f'DROP VIEW IF EXISTS "{name}"')
    op.execute("DROP INDEX IF EXISTS ix_checkpoints_digest")
    op.execute(f"ALTER TABLE checkpoints ADD COLUMN digest_swap {declared}")
    op.execute("UPDATE checkpoints SET digest_swap = digest")
    op.execute("ALTER TABLE checkpoints DROP COLUMN digest")
    op.execute("ALTER TABLE checkpoints RENAME COLUMN digest_swap TO digest")
    op.execute("CREATE INDEX ix_checkpoints_digest ON checkpoints (digest)")
    for _, sql in views:  # in creation order: a view is created after the views it reads
        op.execute(sql)
