"""checkpoint_status_counts: how many versions are in each status, kept by the database itself

`hotswap status`, `/status` and every /metrics scrape showed the versions by status with a
`GROUP BY status` over every checkpoint: a second and more at 1,000,000 versions on PostgreSQL
(issue 28). Now one row per status, counted by triggers on `checkpoints` (insert, delete, and an
update that changes the status), so the counts cost what the statuses cost, and stay right
whoever writes: this release, a daemon of the previous release during a rolling upgrade, or a
person with `psql`. Filled here from the table as it is.

On PostgreSQL the trigger locks the two rows it changes in name order (no deadlock between two
opposite transitions at once); every known status has its row from the start. A later SQLite
migration that rebuilds `checkpoints` (rename, copy, drop) must create the triggers again.

Expand only: a table and triggers. Downgrade drops them.

Revision ID: 0012_checkpoint_status_counts
Revises: 0011_views_follow_rows
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_checkpoint_status_counts"
down_revision = "0011_views_follow_rows"
branch_labels = None
depends_on = None

STATUSES = ("discovered", "fetching", "verifying", "verified", "rejected", "deferred", "staged", "deployed", "retired",
            "superseded", "duplicate")  # fmt: skip
_ADD = ("INSERT INTO checkpoint_status_counts (status, n) VALUES (NEW.status, 1) "
        "ON CONFLICT (status) DO UPDATE SET n = checkpoint_status_counts.n + 1")  # fmt: skip
_SUB = "UPDATE checkpoint_status_counts SET n = n - 1 WHERE status = OLD.status"

SQLITE_TRIGGERS = (
    f"CREATE TRIGGER checkpoint_status_counts_insert AFTER INSERT ON checkpoints BEGIN {_ADD}; END",
    f"CREATE TRIGGER checkpoint_status_counts_delete AFTER DELETE ON checkpoints BEGIN {_SUB}; END",
    "CREATE TRIGGER checkpoint_status_counts_update AFTER UPDATE OF status ON checkpoints "
    f"WHEN OLD.status IS NOT NEW.status BEGIN {_SUB}; {_ADD}; END",
)
POSTGRES_FUNCTION = f"""
CREATE FUNCTION hotswap_checkpoint_status_counts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'UPDATE' THEN
    IF OLD.status IS NOT DISTINCT FROM NEW.status THEN
      RETURN NULL;
    END IF;
    PERFORM 1 FROM checkpoint_status_counts WHERE status IN (OLD.status, NEW.status) ORDER BY status FOR UPDATE;
  END IF;
  IF TG_OP IN ('UPDATE', 'DELETE') THEN
    {_SUB};
  END IF;
  IF TG_OP IN ('UPDATE', 'INSERT') THEN
    {_ADD};
  END IF;
  RETURN NULL;
END $$
"""
POSTGRES_TRIGGER = ("CREATE TRIGGER checkpoint_status_counts AFTER INSERT OR DELETE OR UPDATE OF status ON checkpoints "
                    "FOR EACH ROW EXECUTE FUNCTION hotswap_checkpoint_status_counts()")  # fmt: skip


def upgrade() -> None:
    op.create_table(
        "checkpoint_status_counts",
        sa.Column("status", sa.String(32), primary_key=True),
        sa.Column("n", sa.BigInteger, nullable=False),
    )
    if op.get_bind().dialect.name == "sqlite":
        for sql in SQLITE_TRIGGERS:
            op.execute(sql)
    else:
        op.execute("LOCK TABLE checkpoints IN SHARE MODE")  # no status changes between the count and the trigger
        op.execute(POSTGRES_FUNCTION)
        op.execute(POSTGRES_TRIGGER)
    op.execute("INSERT INTO checkpoint_status_counts (status, n) SELECT status, COUNT(*) FROM checkpoints GROUP BY status")
    for status in STATUSES:  # every known status has its row (the trigger's lock finds it)
        op.execute(f"INSERT INTO checkpoint_status_counts (status, n) SELECT '{status}', 0 WHERE NOT EXISTS "
                   f"(SELECT 1 FROM checkpoint_status_counts WHERE status = '{status}')")  # fmt: skip


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for name in ("insert", "delete", "update"):
            op.execute(f"DROP TRIGGER IF EXISTS checkpoint_status_counts_{name}")
    else:
        op.execute("DROP TRIGGER IF EXISTS checkpoint_status_counts ON checkpoints")
        op.execute("DROP FUNCTION IF EXISTS hotswap_checkpoint_status_counts()")
    op.drop_table("checkpoint_status_counts")
