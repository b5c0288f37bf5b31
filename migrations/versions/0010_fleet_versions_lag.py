"""fleet_versions: lag counts towards the fleet target, so `in sync` always has lag 0; the target
and each host's reason for being behind are columns

`lag` was "versions with a succeeded rollout anywhere that arrived after what this host serves",
so a host held on an operator's older target showed `in sync` with lag 1 (and a version rolled
back from, or rejected since, counted too). Now, beside the new `target` column (the operator's
`fleet_target`, else the newest good version: verified, not rejected, some host's last_good now
or before, by step then arrival, as daemon.fleet.target has it):

    lag = 0                                  serving the target, or no target
        = good versions newer than serving   the target is newer (or the host serves nothing);
          and not newer than the target,     the target itself counted
        = versions from the operator's       the operator's target is older
          target up to serving, exclusive
        = 0                                  ahead of the newest good version (its own health
                                             window): nothing moves it back

"Newer" is the daemon's: by step when both have one, else by arrival. So a host serving the
target has lag 0, and any other host it would move has lag >= 1. `behind_target`,
`behind_cause`, `behind_reason` and `behind_since` are the host's row of `fleet_host_reasons`.
The view is dropped and created again (both dialects); no table changes.

Revision ID: 0010_fleet_versions_lag
Revises: 0009_fleet_host_reasons
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0010_fleet_versions_lag"
down_revision = "0009_fleet_host_reasons"
branch_labels = None
depends_on = None


def _newer(a: str, b: str) -> str:
    """SQL for daemon.rollout.planner.newer(a, b), false (never NULL) when a step is missing."""
    return (f"(({a}.step IS NOT NULL AND {b}.step IS NOT NULL AND {a}.step > {b}.step) OR "
            f"(({a}.step IS NULL OR {b}.step IS NULL OR {a}.step = {b}.step) AND {a}.id > {b}.id))")  # fmt: skip


FLEET_VERSIONS = f"""
CREATE VIEW fleet_versions AS
WITH good AS (
  SELECT c.id, c.step FROM checkpoints c
  WHERE c.verified_at IS NOT NULL
    AND c.status IN ('verified', 'staged', 'deployed', 'retired', 'superseded')
    AND (c.last_good_at IS NOT NULL
         OR c.id IN (SELECT a.checkpoint_id FROM aliases a WHERE a.name = 'last_good'))
),
target AS (
  SELECT c.id, c.version, c.step, 1 AS explicit
    FROM fleet_target ft JOIN checkpoints c ON c.id = ft.checkpoint_id WHERE ft.id = 1
  UNION ALL
  SELECT newest.id, newest.version, newest.step, 0 AS explicit FROM (
    SELECT g.id, c.version, g.step FROM good g JOIN checkpoints c ON c.id = g.id
    WHERE NOT EXISTS (SELECT 1 FROM fleet_target ft WHERE ft.id = 1)
    ORDER BY CASE WHEN g.step IS NULL THEN 0 ELSE 1 END DESC, g.step DESC, g.id DESC
    LIMIT 1) newest
),
candidates AS (SELECT id, step FROM good UNION SELECT id, step FROM target),
hosts AS (SELECT host FROM workers UNION SELECT host FROM aliases UNION SELECT host FROM rollouts
          WHERE host IS NOT NULL),
served AS (
  SELECT h.host, c.id, c.version, c.step FROM hosts h
  LEFT JOIN aliases sa ON sa.host = h.host AND sa.name = 'serving'
  LEFT JOIN checkpoints c ON c.id = sa.checkpoint_id
)
SELECT
  s.host,
  s.version AS serving,
  s.step AS serving_step,
  (SELECT c.version FROM aliases a JOIN checkpoints c ON c.id = a.checkpoint_id
     WHERE a.host = s.host AND a.name = 'last_good') AS last_good,
  (SELECT c.version FROM aliases a JOIN checkpoints c ON c.id = a.checkpoint_id
     WHERE a.host = s.host AND a.name = 'pinned') AS pinned,
  (SELECT COUNT(*) FROM workers w WHERE w.host = s.host) AS workers,
  (SELECT COUNT(*) FROM workers w WHERE w.host = s.host AND w.state = 'RUNNING') AS workers_running,
  (SELECT MAX(w.updated_at) FROM workers w WHERE w.host = s.host) AS last_seen,
  (SELECT MAX(l.version) FROM fleet_leases l
     WHERE l.host = s.host AND l.expires_at > CURRENT_TIMESTAMP) AS updating_to,
  CASE
    WHEN NOT EXISTS (SELECT 1 FROM target) THEN 0
    WHEN s.id IS NOT NULL AND s.id = (SELECT t.id FROM target t) THEN 0
    WHEN s.id IS NULL OR EXISTS (SELECT 1 FROM target t WHERE {_newer("t", "s")})
      THEN (SELECT COUNT(*) FROM candidates g, target t
            WHERE (s.id IS NULL OR {_newer("g", "s")}) AND NOT {_newer("g", "t")})
    WHEN (SELECT t.explicit FROM target t) = 1
      THEN (SELECT COUNT(*) FROM candidates g, target t WHERE {_newer("s", "g")} AND NOT {_newer("t", "g")})
    ELSE 0
  END AS lag,
  (SELECT t.version FROM target t) AS target,
  r.target AS behind_target,
  r.cause AS behind_cause,
  r.reason AS behind_reason,
  r.since AS behind_since
FROM served s
LEFT JOIN fleet_host_reasons r ON r.host = s.host
"""

# as 0005_fleet_hosts created it
FLEET_VERSIONS_0005 = """
CREATE VIEW fleet_versions AS
SELECT
  h.host,
  (SELECT c.version FROM aliases a JOIN checkpoints c ON c.id = a.checkpoint_id
     WHERE a.host = h.host AND a.name = 'serving') AS serving,
  (SELECT c.step FROM aliases a JOIN checkpoints c ON c.id = a.checkpoint_id
     WHERE a.host = h.host AND a.name = 'serving') AS serving_step,
  (SELECT c.version FROM aliases a JOIN checkpoints c ON c.id = a.checkpoint_id
     WHERE a.host = h.host AND a.name = 'last_good') AS last_good,
  (SELECT c.version FROM aliases a JOIN checkpoints c ON c.id = a.checkpoint_id
     WHERE a.host = h.host AND a.name = 'pinned') AS pinned,
  (SELECT COUNT(*) FROM workers w WHERE w.host = h.host) AS workers,
  (SELECT COUNT(*) FROM workers w WHERE w.host = h.host AND w.state = 'RUNNING') AS workers_running,
  (SELECT MAX(w.updated_at) FROM workers w WHERE w.host = h.host) AS last_seen,
  (SELECT MAX(l.version) FROM fleet_leases l
     WHERE l.host = h.host AND l.expires_at > CURRENT_TIMESTAMP) AS updating_to,
  (SELECT COUNT(DISTINCT r.checkpoint_id) FROM rollouts r
     WHERE r.outcome = 'succeeded'
       AND r.checkpoint_id > COALESCE((SELECT a.checkpoint_id FROM aliases a
                                        WHERE a.host = h.host AND a.name = 'serving'), 0)) AS lag
FROM (SELECT host FROM workers UNION SELECT host FROM aliases UNION SELECT host FROM rollouts
      WHERE host IS NOT NULL) h
"""


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS fleet_versions")
    op.execute(FLEET_VERSIONS)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS fleet_versions")
    op.execute(FLEET_VERSIONS_0005)
