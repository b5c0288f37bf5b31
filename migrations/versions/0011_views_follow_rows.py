"""views and start-up whose cost follows the rows asked for: version_history and fleet_versions rewritten, indexes

At 100,000 versions `hotswap history -n 20` took seconds and `SELECT count(*) FROM
version_history WHERE status = 'rejected'` did not finish in 10 minutes (issue 28):

- `version_history` had an ORDER BY, so a query with its own ORDER BY ... LIMIT, or a count,
  could not be merged into it (SQLite computes every column of every row first; PostgreSQL sorts
  every row to take the newest), and `worker_update_ms` went through the `worker_updates` view,
  which aggregates every event of every rollout, once per row. Now the view has no ORDER BY
  (say `ORDER BY checkpoint_id`), so filters, limits and counts reach `checkpoints` and its
  indexes first and each column is computed only for the rows returned; `worker_update_ms` sums
  the events of the version's last rollout through `ix_events_rollout_id`. Every column stays,
  with the same meaning.
- `fleet_versions` computed the set of good versions (a scan of `checkpoints`) and counted it
  once per host; its host list read every rollout. Now the target is the first entry of
  `ix_checkpoints_good` (the good versions: their checks passed, not rejected since, and some
  host's last_good once, `last_good_at`), lag counts only the good versions between what a host
  serves and the target (a range of that index; a host serving nothing counts once for all such
  hosts), and the hosts of `rollouts` come from `ix_rollouts_host` one host at a time. The same
  numbers as 0010 (a version that is good only through a `last_good` alias, as an older daemon
  leaves it, counts too).
- `ix_aliases_checkpoint_id`: `serving` per row without reading every host's aliases.
- Start-up read the whole history twice: the versions to fall back to, most recently deployed
  first (a sort of every row by `coalesce(last_deployed_at, deployed_at)`), and the rollouts in
  flight (`outcome IS NULL`, no index). Now `ix_checkpoints_last_deployed` (every deploy sets
  `last_deployed_at`; the rows where an older release set only `deployed_at` get it here) and the
  partial `ix_rollouts_in_flight`.

Expand only: four indexes, two views with the same columns and `last_deployed_at` filled in. A daemon of the previous release
runs unchanged against it; downgrade restores 0002's and 0010's views.

Revision ID: 0011_views_follow_rows
Revises: 0010_fleet_versions_lag
Create Date: 2026-12-03
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0011_views_follow_rows"
down_revision = "0010_fleet_versions_lag"
branch_labels = None
depends_on = None

# daemon.registry.models.GOOD_WHERE: the same text, so SQLite sees the index's own terms in the views
GOOD_WHERE = ("last_good_at IS NOT NULL AND verified_at IS NOT NULL "
              "AND status IN ('verified', 'staged', 'deployed', 'retired', 'superseded')")  # fmt: skip
STEP_MIN, STEP_MAX = "-9223372036854775807", "9223372036854775807"  # bigint in PostgreSQL (one less: numeric)

_WORKER_MS = {
    "sqlite": """(SELECT group_concat(s, ' ') FROM (
       SELECT e.worker || '=' || CAST(ROUND(SUM(e.duration_ms)) AS INTEGER) || 'ms' AS s
       FROM events e
       WHERE e.rollout_id = (SELECT MAX(r.id) FROM rollouts r WHERE r.checkpoint_id = c.id) AND e.worker IS NOT NULL
       GROUP BY e.worker ORDER BY e.worker))""",
    "postgresql": """(SELECT string_agg(wu.worker || '=' || CAST(ROUND(CAST(wu.update_ms AS numeric)) AS bigint) || 'ms',
                      ' ' ORDER BY wu.worker)
       FROM (SELECT e.worker, SUM(e.duration_ms) AS update_ms FROM events e
             WHERE e.rollout_id = (SELECT MAX(r.id) FROM rollouts r WHERE r.checkpoint_id = c.id)
               AND e.worker IS NOT NULL
             GROUP BY e.worker) wu)""",
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
"""


def _good(g: str) -> str:
    """`g` is a good version through the index (`last_good_at`)."""
    return " AND ".join(f"{g}.{term}" for term in GOOD_WHERE.split(" AND "))


def _good_by_alias(g: str) -> str:
    """`g` is good only through some host's `last_good` alias (an older daemon set no last_good_at)."""
    return (f"{g}.last_good_at IS NULL AND {g}.verified_at IS NOT NULL AND {g}.status IN "
            f"('verified', 'staged', 'deployed', 'retired', 'superseded') AND "
            f"{g}.id IN (SELECT a.checkpoint_id FROM aliases a WHERE a.name = 'last_good')")  # fmt: skip


def _newer(a: str, b: str) -> str:
    """daemon.rollout.planner.newer(a, b) (as 0010): by step when both have one, else by arrival."""
    return (f"(({a}.step IS NOT NULL AND {b}.step IS NOT NULL AND {a}.step > {b}.step) OR "
            f"(({a}.step IS NULL OR {b}.step IS NULL OR {a}.step = {b}.step) AND {a}.id > {b}.id))")  # fmt: skip


def _count(where: str, lo: str | None, hi: str | None) -> str:
    """Good versions matching `where`, read only between `lo` and `hi` (aliases of rows with step
    and id; None: no bound): stepped ones by step, the others by id, a range of the index each."""
    step_lo = f"COALESCE({lo}.step, {STEP_MIN})" if lo else STEP_MIN
    step_hi = f"COALESCE({hi}.step, {STEP_MAX})" if hi else STEP_MAX
    id_lo = f"{lo}.id" if lo else STEP_MIN
    id_hi = f"{hi}.id" if hi else STEP_MAX
    return (f"(SELECT COUNT(*) FROM checkpoints g WHERE {_good('g')} AND g.step BETWEEN {step_lo} AND {step_hi} "
            f"AND {where}) + "
            f"(SELECT COUNT(*) FROM checkpoints g WHERE {_good('g')} AND g.step IS NULL "
            f"AND g.id BETWEEN {id_lo} AND {id_hi} AND {where}) + "
            f"(SELECT COUNT(*) FROM checkpoints g WHERE {_good_by_alias('g')} AND {where})")  # fmt: skip


def _newest_good() -> str:
    """The newest good version's id: by step (a version without one is older than any with one), then arrival."""
    return f"""(SELECT x.id FROM (
        SELECT * FROM (SELECT g.id, g.step FROM checkpoints g WHERE g.step IS NOT NULL AND {_good("g")}
                       ORDER BY g.step DESC, g.id DESC LIMIT 1) stepped
        UNION ALL
        SELECT * FROM (SELECT g.id, g.step FROM checkpoints g WHERE g.step IS NULL AND {_good("g")}
                       ORDER BY g.id DESC LIMIT 1) unstepped
        UNION ALL
        SELECT g.id, g.step FROM checkpoints g WHERE {_good_by_alias("g")}) x
      ORDER BY CASE WHEN x.step IS NULL THEN 0 ELSE 1 END DESC, x.step DESC, x.id DESC LIMIT 1)"""


# lag, case by case as 0010 has it; "the target counted" is its own term when it is not good itself
FLEET_VERSIONS = f"""
CREATE VIEW fleet_versions AS
WITH RECURSIVE
rollout_hosts(host) AS (
  SELECT MIN(host) FROM rollouts
  UNION ALL
  SELECT (SELECT MIN(r.host) FROM rollouts r WHERE r.host > rh.host) FROM rollout_hosts rh WHERE rh.host IS NOT NULL
),
hosts AS (SELECT host FROM workers UNION SELECT host FROM aliases
          UNION SELECT host FROM rollout_hosts WHERE host IS NOT NULL),
target AS (
  SELECT c.id, c.version, c.step, 1 AS explicit,
         CASE WHEN ({_good("c")}) OR ({_good_by_alias("c")}) THEN 1 ELSE 0 END AS good
    FROM fleet_target ft JOIN checkpoints c ON c.id = ft.checkpoint_id WHERE ft.id = 1
  UNION ALL
  SELECT c.id, c.version, c.step, 0 AS explicit, 1 AS good FROM checkpoints c
  WHERE NOT EXISTS (SELECT 1 FROM fleet_target ft WHERE ft.id = 1) AND c.id = {_newest_good()}
),
from_nothing AS (
  SELECT {_count(f"NOT {_newer('g', 't')}", None, "t")} + CASE WHEN t.good = 1 THEN 0 ELSE 1 END AS n FROM target t
),
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
    WHEN t.id IS NULL THEN 0
    WHEN s.id IS NOT NULL AND s.id = t.id THEN 0
    WHEN s.id IS NULL THEN (SELECT n FROM from_nothing)
    WHEN {_newer("t", "s")}
      THEN {_count(f"{_newer('g', 's')} AND NOT {_newer('g', 't')}", "s", "t")}
           + CASE WHEN t.good = 1 THEN 0 ELSE 1 END
    WHEN t.explicit = 1
      THEN {_count(f"{_newer('s', 'g')} AND NOT {_newer('t', 'g')}", "t", "s")}
           + CASE WHEN t.good = 0 AND {_newer("s", "t")} THEN 1 ELSE 0 END
    ELSE 0
  END AS lag,
  t.version AS target,
  r.target AS behind_target,
  r.cause AS behind_cause,
  r.reason AS behind_reason,
  r.since AS behind_since
FROM served s
LEFT JOIN target t ON 1 = 1
LEFT JOIN fleet_host_reasons r ON r.host = s.host
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute("DROP VIEW IF EXISTS version_history")
    op.execute("DROP VIEW IF EXISTS fleet_versions")
    op.create_index("ix_aliases_checkpoint_id", "aliases", ["checkpoint_id"])
    op.execute(f"CREATE INDEX ix_checkpoints_good ON checkpoints (step, id) WHERE {GOOD_WHERE}")
    op.execute("UPDATE checkpoints SET last_deployed_at = deployed_at "
               "WHERE last_deployed_at IS NULL AND deployed_at IS NOT NULL")  # fmt: skip
    op.create_index("ix_checkpoints_last_deployed", "checkpoints", ["last_deployed_at", "id"])
    op.execute("CREATE INDEX ix_rollouts_in_flight ON rollouts (id) WHERE outcome IS NULL")
    op.execute(VERSION_HISTORY.format(worker_ms=_WORKER_MS.get(dialect, _WORKER_MS["postgresql"])))
    op.execute(FLEET_VERSIONS)


def _sibling(name: str) -> ModuleType:
    """An earlier migration of this folder, for the view it created (downgrade restores it)."""
    spec = importlib.util.spec_from_file_location(f"_hotswap_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute("DROP VIEW IF EXISTS version_history")
    op.execute("DROP VIEW IF EXISTS fleet_versions")
    op.drop_index("ix_rollouts_in_flight", table_name="rollouts")
    op.drop_index("ix_checkpoints_last_deployed", table_name="checkpoints")
    op.drop_index("ix_checkpoints_good", table_name="checkpoints")
    op.drop_index("ix_aliases_checkpoint_id", table_name="aliases")
    views = _sibling("0002_rollout_views")
    op.execute(views.VERSION_HISTORY.format(worker_ms=views._WORKER_MS.get(dialect, views._WORKER_MS["postgresql"])))
    op.execute(_sibling("0010_fleet_versions_lag").FLEET_VERSIONS)
