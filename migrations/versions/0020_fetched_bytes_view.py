"""the view fetched_bytes_per_day: what sources brought in, per day, source and encoding

One row per (day, source, encoding) of the checkpoints discovered that day: how many versions,
the bytes fetched for them (a delta's own files, or a full checkpoint's), and, for deltas, the
full bytes they stood for, so "what did deltas save" is one query. The day is the UTC date of
`discovered_at` as stored. Per version, as recorded: each fleet host fetched its own copy (the
metric `hotswap_fetched_bytes_total` counts per host).

Expand only: a new view; the previous release ignores it.

Revision ID: 0020_fetched_bytes_view
Revises: 0019_gate_runs
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0020_fetched_bytes_view"
down_revision = "0019_gate_runs"
branch_labels = None
depends_on = None

VIEW = """
CREATE VIEW fetched_bytes_per_day AS
SELECT substr(CAST(discovered_at AS TEXT), 1, 10) AS day,
       source,
       COALESCE(encoding, 'full') AS encoding,
       COUNT(*) AS versions,
       SUM(fetched_bytes) AS fetched_bytes,
       SUM(CASE WHEN delta_ratio > 0 THEN CAST(fetched_bytes / delta_ratio AS BIGINT) ELSE fetched_bytes END)
           AS full_bytes
FROM checkpoints
WHERE fetched_bytes IS NOT NULL
GROUP BY substr(CAST(discovered_at AS TEXT), 1, 10), source, COALESCE(encoding, 'full')
"""


def upgrade() -> None:
    op.execute(VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS fetched_bytes_per_day")
