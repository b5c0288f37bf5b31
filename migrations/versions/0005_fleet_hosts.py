"""fleet hosts: workers, aliases, rollouts and events per host; checkpoint_locations; fleet leases

Many daemons (hosts) can share one PostgreSQL registry: a checkpoint stays one row, but
`workers`, `aliases` (serving, last_good, pinned), `rollouts` and `events` gain a `host`, and
where a checkpoint's bytes are on each host is `checkpoint_locations(checkpoint_id, host,
local_path)`. `fleet_leases` bounds the hosts updating at once, `fleet_target` is an operator's
explicit fleet version, and the view `fleet_versions` shows every host's serving version.

Existing rows get the migrating daemon's host (`[fleet] host`, else this machine's hostname);
`checkpoints.local_path` stays (where the registering host found it) and becomes that host's
location. `aliases` and `workers` change their keys ((host, name)); on SQLite that is a table
rebuild, done with every view dropped and re-created (a rename with views reading the table fails).

Revision ID: 0005_fleet_hosts
Revises: 0004_firsthour_last_deployed
Create Date: 2026-12-01
"""

from __future__ import annotations

import socket

import sqlalchemy as sa
from alembic import context, op

revision = "0005_fleet_hosts"
down_revision = "0004_firsthour_last_deployed"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)

WORKER_VERSIONS = """
CREATE VIEW worker_versions AS
SELECT
  w.host,
  w.name AS worker,
  w.kind,
  w.url,
  w.device,
  w.state,
  w.weight_version,
  c.status AS version_status,
  w.updated_at,
  w.last_error
FROM workers w
LEFT JOIN checkpoints c ON c.version = w.weight_version
ORDER BY w.host, w.name
"""

# One row per host: what it serves, its fallback and pin, its workers, and the version it is
# updating to while it holds a fleet lease. `lag`: versions rolled out successfully somewhere in
# the fleet that are newer (by arrival) than what this host serves.
FLEET_VERSIONS = """
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


def _host() -> str:
    """The migrating daemon's host: handed in by Registry.upgrade, or `alembic -x host=...`."""
    given = context.config.attributes.get("host") or context.get_x_argument(as_dictionary=True).get("host")
    return str(given or socket.gethostname())


def upgrade() -> None:
    bind = op.get_bind()
    sqlite = bind.dialect.name == "sqlite"
    host = _host()
    saved: list[tuple[str, str]] = []
    if sqlite:
        saved = [(str(n), str(q)) for n, q in bind.execute(
            sa.text("SELECT name, sql FROM sqlite_master WHERE type = 'view' ORDER BY rowid")).all()]  # fmt: skip
        for name, _ in saved:
            op.execute(f'DROP VIEW IF EXISTS "{name}"')
    else:
        op.execute("DROP VIEW IF EXISTS worker_versions")

    for table in ("rollouts", "events"):
        op.add_column(table, sa.Column("host", sa.String(255)))
        op.execute(sa.text(f"UPDATE {table} SET host = :host").bindparams(host=host))
        op.create_index(f"ix_{table}_host", table, ["host"])

    if sqlite:
        _rebuild_sqlite(host)
    else:
        _alter_postgres(host)

    op.create_table(
        "checkpoint_locations",
        sa.Column("checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("local_path", sa.Text, nullable=False),
        sa.Column("recorded_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("checkpoint_id", "host"),
    )
    op.create_index("ix_checkpoint_locations_host", "checkpoint_locations", ["host"])
    op.execute(sa.text(
        "INSERT INTO checkpoint_locations (checkpoint_id, host, local_path, recorded_at) "
        "SELECT id, :host, local_path, discovered_at FROM checkpoints WHERE local_path IS NOT NULL"
    ).bindparams(host=host))  # fmt: skip
    op.create_table(
        "fleet_leases",
        sa.Column("slot", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("host", sa.String(255)),
        sa.Column("version", sa.String(255)),
        sa.Column("acquired_at", TS),
        sa.Column("expires_at", TS),
    )
    op.create_table(
        "fleet_target",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id"), nullable=False),
        sa.Column("set_at", TS, nullable=False),
        sa.Column("set_by", sa.String(255)),
    )

    for name, sql in saved:
        if name != "worker_versions":
            op.execute(sql)
    op.execute(WORKER_VERSIONS)
    op.execute(FLEET_VERSIONS)


def _alter_postgres(host: str) -> None:
    op.add_column("workers", sa.Column("host", sa.String(255)))
    op.execute(sa.text("UPDATE workers SET host = :host").bindparams(host=host))
    op.alter_column("workers", "host", nullable=False)
    for uc in sa.inspect(op.get_bind()).get_unique_constraints("workers"):
        if uc["column_names"] == ["name"] and uc["name"]:
            op.drop_constraint(uc["name"], "workers", type_="unique")
    op.create_unique_constraint("uq_workers_host_name", "workers", ["host", "name"])
    op.create_index("ix_workers_host", "workers", ["host"])

    op.add_column("aliases", sa.Column("host", sa.String(255)))
    op.execute(sa.text("UPDATE aliases SET host = :host").bindparams(host=host))
    op.alter_column("aliases", "host", nullable=False)
    pk = sa.inspect(op.get_bind()).get_pk_constraint("aliases")
    op.drop_constraint(pk["name"] or "aliases_pkey", "aliases", type_="primary")
    op.create_primary_key("aliases_pkey", "aliases", ["host", "name"])


def _rebuild_sqlite(host: str) -> None:
    """SQLite cannot change a key in place: rename, create the new table, copy, drop."""
    op.execute("ALTER TABLE workers RENAME TO _workers_0004")
    op.create_table(
        "workers",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("device", sa.String(64)),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("weight_version", sa.String(255)),
        sa.Column("last_error", sa.Text),
        sa.Column("updated_at", TS, nullable=False),
        sa.UniqueConstraint("host", "name", name="uq_workers_host_name"),
    )
    op.create_index("ix_workers_host", "workers", ["host"])
    op.execute(sa.text(
        "INSERT INTO workers (id, host, name, kind, url, device, state, weight_version, last_error, updated_at) "
        "SELECT id, :host, name, kind, url, device, state, weight_version, last_error, updated_at FROM _workers_0004"
    ).bindparams(host=host))  # fmt: skip
    op.drop_table("_workers_0004")

    op.execute("ALTER TABLE aliases RENAME TO _aliases_0004")
    op.create_table(
        "aliases",
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id"), nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("host", "name"),
    )
    op.execute(sa.text(
        "INSERT INTO aliases (host, name, checkpoint_id, updated_at) "
        "SELECT :host, name, checkpoint_id, updated_at FROM _aliases_0004"
    ).bindparams(host=host))  # fmt: skip
    op.drop_table("_aliases_0004")


WORKER_VERSIONS_0001 = """
CREATE VIEW worker_versions AS
SELECT w.name AS worker, w.kind, w.url, w.device, w.state, w.weight_version,
  c.status AS version_status, w.updated_at, w.last_error
FROM workers w
LEFT JOIN checkpoints c ON c.version = w.weight_version
ORDER BY w.name
"""


def downgrade() -> None:
    """Back to one host: the downgrading daemon's rows are kept, other hosts' are dropped."""
    bind = op.get_bind()
    sqlite = bind.dialect.name == "sqlite"
    host = _host()
    saved: list[tuple[str, str]] = []
    if sqlite:
        saved = [(str(n), str(q)) for n, q in bind.execute(
            sa.text("SELECT name, sql FROM sqlite_master WHERE type = 'view' ORDER BY rowid")).all()]  # fmt: skip
        for name, _ in saved:
            op.execute(f'DROP VIEW IF EXISTS "{name}"')
    else:
        op.execute("DROP VIEW IF EXISTS fleet_versions")
        op.execute("DROP VIEW IF EXISTS worker_versions")
    op.drop_table("fleet_target")
    op.drop_table("fleet_leases")
    op.drop_table("checkpoint_locations")
    for table in ("workers", "aliases"):
        op.execute(sa.text(f"DELETE FROM {table} WHERE host <> :host").bindparams(host=host))
    if sqlite:
        _unbuild_sqlite()
    else:
        op.drop_index("ix_workers_host", "workers")
        op.drop_constraint("uq_workers_host_name", "workers", type_="unique")
        op.drop_column("workers", "host")
        op.create_unique_constraint("workers_name_key", "workers", ["name"])
        op.drop_constraint("aliases_pkey", "aliases", type_="primary")
        op.drop_column("aliases", "host")
        op.create_primary_key("aliases_pkey", "aliases", ["name"])
    for table in ("rollouts", "events"):
        op.drop_index(f"ix_{table}_host", table)
        op.drop_column(table, "host")
    for name, sql in saved:
        if name not in ("worker_versions", "fleet_versions"):
            op.execute(sql)
    op.execute(WORKER_VERSIONS_0001)


def _unbuild_sqlite() -> None:
    op.execute("ALTER TABLE workers RENAME TO _workers_0005")
    op.create_table(
        "workers",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(255), nullable=False, unique=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("device", sa.String(64)),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("weight_version", sa.String(255)),
        sa.Column("last_error", sa.Text),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.execute(
        "INSERT INTO workers (id, name, kind, url, device, state, weight_version, last_error, updated_at) "
        "SELECT id, name, kind, url, device, state, weight_version, last_error, updated_at FROM _workers_0005"
    )
    op.drop_table("_workers_0005")
    op.execute("ALTER TABLE aliases RENAME TO _aliases_0005")
    op.create_table(
        "aliases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("checkpoint_id", sa.Integer, sa.ForeignKey("checkpoints.id"), nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.execute("INSERT INTO aliases (name, checkpoint_id, updated_at) SELECT name, checkpoint_id, updated_at "
               "FROM _aliases_0005")  # fmt: skip
    op.drop_table("_aliases_0005")
