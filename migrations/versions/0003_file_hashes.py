"""file hashes: checkpoint_files.hash_alg/hash, checks.status, checkpoints.digest wide enough for `blake3:<hex>`

- checkpoint_files.hash_alg ("blake3" | "sha256") and .hash (hex): the per-file strong hash the
  verify stage computed from the bytes; the reference transports check while they load.
- checks.status: pass | fail | deferred | skipped (a check that did not run is never "pass");
  existing rows are filled in from ok/deferred and a "skipped" key in detail.
- checkpoints.digest: VARCHAR(16) -> VARCHAR(80). Digests are now `<alg>:<64 hex>`; rows
  written before keep their 8-hex CRC32C-of-CRCs digest, which never equals a new one.
  PostgreSQL cannot change the type of a column a view reads, so on PostgreSQL the views are
  saved (pg_views), dropped, and created again unchanged; SQLite does not enforce lengths.

Revision ID: 0003_file_hashes
Revises: 0002_rollout_views
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_file_hashes"
down_revision = "0002_rollout_views"
branch_labels = None
depends_on = None

_SKIPPED = {
    "sqlite": "json_extract(detail, '$.skipped') IS NOT NULL",
    "postgresql": "(detail::jsonb) ? 'skipped'",
}


def upgrade() -> None:
    bind = op.get_bind()
    dialect = bind.dialect.name
    op.add_column("checkpoint_files", sa.Column("hash_alg", sa.String(16)))
    op.add_column("checkpoint_files", sa.Column("hash", sa.String(128)))
    op.add_column("checks", sa.Column("status", sa.String(16)))
    skipped = _SKIPPED.get(dialect, "1 = 0")
    op.execute(
        "UPDATE checks SET status = CASE "
        "WHEN deferred THEN 'deferred' "
        "WHEN NOT ok THEN 'fail' "
        f"WHEN {skipped} THEN 'skipped' "
        "ELSE 'pass' END"
    )
    if dialect == "postgresql":
        _alter_digest_type(sa.String(80))


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute("UPDATE checkpoints SET digest = NULL WHERE length(digest) > 16")
        _alter_digest_type(sa.String(16))
    # SQLite >= 3.35 drops columns in place (a batch copy would break the views on rename)
    op.drop_column("checks", "status")
    op.drop_column("checkpoint_files", "hash")
    op.drop_column("checkpoint_files", "hash_alg")


def _alter_digest_type(new_type: sa.types.TypeEngine[str]) -> None:
    """ALTER checkpoints.digest on PostgreSQL: every view dropped first, then re-created as it was."""
    bind = op.get_bind()
    views = bind.execute(
        sa.text("SELECT viewname, definition FROM pg_views WHERE schemaname = current_schema()")
    ).all()
    for name, _ in views:
        op.execute(f'DROP VIEW IF EXISTS "{name}" CASCADE')
    op.alter_column("checkpoints", "digest", type_=new_type, existing_nullable=True)
    pending: dict[str, str] = {str(n): str(d) for n, d in views}
    while pending:  # views may read other views: create each once what it reads exists
        progressed = False
        for name, definition in list(pending.items()):
            savepoint = bind.begin_nested()
            try:
                bind.exec_driver_sql(f'CREATE VIEW "{name}" AS {definition}')  # no bind-param parsing
            except sa.exc.ProgrammingError:
                savepoint.rollback()
                continue
            savepoint.commit()
            del pending[name]
            progressed = True
        if not progressed:
            raise RuntimeError(f"could not re-create views {sorted(pending)} after widening checkpoints.digest")
