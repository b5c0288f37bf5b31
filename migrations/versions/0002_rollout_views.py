"""rollout views: worker_updates (per rollout and worker), version_history with rollout columns

version_history gains: rolled_back_at also from operator rollbacks (checkpoint
events `rolled_back`), last_rollout_id / last_rollout_outcome, and
worker_update_ms ("w0=412ms w1=398ms": how long each worker's update took in the
version's latest rollout, summed over its transitions).

Revision ID: 0002_rollout_views
Revises: 0001_initial
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0002_rollout_views"
down_revision = "0001_initial"
branch_labels = None
depends_on = None

WORKER_UPDATES = """
CREATE VIEW worker_updates AS
SELECT
  r.id AS rollout_id,
  c.version,
  r.trigger,
  r.outcome,
  e.worker,
  MIN(e.at) AS first_event_at,
  MAX(e.at) AS last_event_at,
  SUM(e.duration_ms) AS update_ms,
  COUNT(*) AS transitions,
  SUM(CASE WHEN e.to_state = 'UNHEALTHY' THEN 1 ELSE 0 END) AS unhealthy
FROM rollouts r
JOIN checkpoints c ON c.id = r.checkpoint_id
JOIN events e ON e.rollout_id = r.id AND e.worker IS NOT NULL
GROUP BY r.id, c.version, r.trigger, r.outcome, e.worker
"""

# The per-worker list needs string aggregation, which the two databases spell differently.
_WORKER_MS = {
    "sqlite": """(SELECT group_concat(s, ' ') FROM (
       SELECT wu.worker || '=' || CAST(ROUND(wu.update_ms) AS INTEGER) || 'ms' AS s
       FROM worker_updates wu
       WHERE wu.rollout_id = (SELECT MAX(r.id) FROM rollouts r WHERE r.checkpoint_id = c.id)
       ORDER BY wu.worker))""",
    "postgresql": """(SELECT string_agg(wu.worker || '=' || CAST(ROUND(CAST(wu.update_ms AS numeric)) AS bigint) || 'ms',
                      ' ' ORDER BY wu.worker)
       FROM worker_updates wu
       WHERE wu.rollout_id = (SELECT MAX(r.id) FROM rollouts r WHERE r.checkpoint_id = c.id))""",
}

VERSION_HISTORY = """
CREATE VIEW version_history AS
SELECT
  c.id AS checkpoint_id,
  c.version,
  c.status,
  c.status_message,
  c.step,
  c.parent,
  c.digest,
  c.total_bytes,
  c.tensor_count,
  c.source,
  c.commit_signal,
  c.local_path,
  c.discovered_at,
  c.verified_at,
  c.deployed_at,
  (SELECT SUM(k.duration_ms) FROM checks k WHERE k.checkpoint_id = c.id) AS verify_ms,
  (SELECT COUNT(*) FROM rollouts r WHERE r.checkpoint_id = c.id) AS rollout_count,
  COALESCE(
    (SELECT MAX(e.at) FROM events e
       WHERE e.checkpoint_id = c.id AND e.worker IS NULL AND e.to_state = 'rolled_back'),
    (SELECT MAX(r.finished_at) FROM rollouts r
       WHERE r.checkpoint_id = c.id AND r.outcome = 'rolled_back')) AS rolled_back_at,
  (SELECT MAX(e.at) FROM events e
     WHERE e.checkpoint_id = c.id AND e.worker IS NULL AND e.to_state = 'superseded') AS superseded_at,
  CASE WHEN EXISTS (SELECT 1 FROM aliases a WHERE a.checkpoint_id = c.id AND a.name = 'serving')
       THEN 1 ELSE 0 END AS serving,
  (SELECT MAX(r.id) FROM rollouts r WHERE r.checkpoint_id = c.id) AS last_rollout_id,
  (SELECT r.outcome FROM rollouts r WHERE r.id = (SELECT MAX(r2.id) FROM rollouts r2 WHERE r2.checkpoint_id = c.id))
    AS last_rollout_outcome,
  {worker_ms} AS worker_update_ms
FROM checkpoints c
ORDER BY c.id
"""

# 0001's definition, restored on downgrade.
VERSION_HISTORY_0001 = """
CREATE VIEW version_history AS
SELECT
  c.id AS checkpoint_id, c.version, c.status, c.status_message, c.step, c.parent, c.digest,
  c.total_bytes, c.tensor_count, c.source, c.commit_signal, c.local_path,
  c.discovered_at, c.verified_at, c.deployed_at,
  (SELECT SUM(k.duration_ms) FROM checks k WHERE k.checkpoint_id = c.id) AS verify_ms,
  (SELECT COUNT(*) FROM rollouts r WHERE r.checkpoint_id = c.id) AS rollout_count,
  (SELECT MAX(r.finished_at) FROM rollouts r
     WHERE r.checkpoint_id = c.id AND r.outcome = 'rolled_back') AS rolled_back_at,
  (SELECT MAX(e.at) FROM events e
     WHERE e.checkpoint_id = c.id AND e.worker IS NULL AND e.to_state = 'superseded') AS superseded_at,
  CASE WHEN EXISTS (SELECT 1 FROM aliases a WHERE a.checkpoint_id = c.id AND a.name = 'serving')
       THEN 1 ELSE 0 END AS serving
FROM checkpoints c
ORDER BY c.id
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute("DROP VIEW IF EXISTS version_history")
    op.execute(WORKER_UPDATES)
    op.execute(VERSION_HISTORY.format(worker_ms=_WORKER_MS.get(dialect, _WORKER_MS["postgresql"])))


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS version_history")
    op.execute("DROP VIEW IF EXISTS worker_updates")
    op.execute(VERSION_HISTORY_0001)
