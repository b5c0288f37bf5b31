"""fleet decisions: a row lock instead of an advisory key, and who decided each admission and target

- `fleet_decider` (one row, id 1): staged-rollout passes lock it (`SELECT ... FOR UPDATE SKIP
  LOCKED`), which needs UPDATE on the table; before, any login could hold the advisory key
  0x686F7473 and stall every decision. Its `tick` counts the decisions taken.
- `fleet_rollout_hosts.decided_by`, `.tick`, `.signature` and `fleet_target.signature`: who
  decided an admission (the deciding host and its tick) or a target (`set_by`), signed with
  `[fleet] signing_key` when one is configured (daemon.fleet.trust). Hosts act only on verified
  rows.
- `fleet_rollouts.stalled`: why a decision that is due has not been taken (the lock held
  elsewhere for several polls).

Data: each existing admission gets the host of its `fleet_stage_admitted` event as `decided_by`,
and an existing explicit target gets the `fleet_target_set` event that unsigned verification
looks for, so a rollout or target in progress survives the upgrade.

Additive (expand-first): a new table and nullable columns; a daemon of the previous release
ignores them (and still takes the advisory key, so run one release at a time across the fleet).

Revision ID: 0016_fleet_decisions
Revises: 0015_fleet_lag_capped
Create Date: 2026-12-04
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0016_fleet_decisions"
down_revision = "0015_fleet_lag_capped"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "fleet_decider",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("tick", sa.BigInteger, nullable=False),
        sa.Column("host", sa.String(255)),
        sa.Column("decided_at", TS),
    )
    op.add_column("fleet_rollout_hosts", sa.Column("decided_by", sa.String(255)))
    op.add_column("fleet_rollout_hosts", sa.Column("tick", sa.BigInteger))
    op.add_column("fleet_rollout_hosts", sa.Column("signature", sa.Text))
    op.add_column("fleet_target", sa.Column("signature", sa.Text))
    op.add_column("fleet_rollouts", sa.Column("stalled", sa.Text))
    conn = op.get_bind()
    conn.execute(sa.text("INSERT INTO fleet_decider (id, tick) VALUES (1, 0)"))
    _adopt_admissions(conn)
    _adopt_target(conn)


def _adopt_admissions(conn: sa.Connection) -> None:
    rows = conn.execute(sa.text("SELECT h.rollout_id, h.host, r.checkpoint_id FROM fleet_rollout_hosts h "
                                "JOIN fleet_rollouts r ON r.id = h.rollout_id")).all()  # fmt: skip
    for rollout_id, host, checkpoint_id in rows:
        events = conn.execute(sa.text("SELECT host, detail FROM events WHERE to_state = 'fleet_stage_admitted' "
                                      "AND checkpoint_id = :c ORDER BY id"), {"c": checkpoint_id}).all()  # fmt: skip
        for by, detail in events:
            d = json.loads(detail) if isinstance(detail, str) else (detail or {})
            if d.get("rollout_id") == rollout_id and host in d.get("hosts", []):
                conn.execute(sa.text("UPDATE fleet_rollout_hosts SET decided_by = :by, tick = 0 "
                                     "WHERE rollout_id = :r AND host = :h"), {"by": by, "r": rollout_id, "h": host})  # fmt: skip
                break


def _adopt_target(conn: sa.Connection) -> None:
    row = conn.execute(sa.text("SELECT t.checkpoint_id, t.set_by, t.set_at, c.version FROM fleet_target t "
                               "JOIN checkpoints c ON c.id = t.checkpoint_id WHERE t.id = 1")).first()  # fmt: skip
    if row is None:
        return
    at = row.set_at if isinstance(row.set_at, datetime) else datetime.fromisoformat(str(row.set_at))
    at = at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)
    detail = {"version": row.version, "by": row.set_by, "set_at": at.isoformat(), "adopted": "0016"}
    events = sa.table("events", sa.column("at", TS), sa.column("host", sa.String), sa.column("checkpoint_id", sa.Integer),
                      sa.column("to_state", sa.String), sa.column("detail", sa.JSON))  # fmt: skip
    conn.execute(events.insert().values(at=datetime.now(UTC), host="migration-0016", checkpoint_id=row.checkpoint_id,
                                        to_state="fleet_target_set", detail=detail))  # fmt: skip


def downgrade() -> None:
    # plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35): a batch copy would break the views on these tables
    for table, column in (("fleet_rollouts", "stalled"), ("fleet_target", "signature"),
                          ("fleet_rollout_hosts", "signature"), ("fleet_rollout_hosts", "tick"),
                          ("fleet_rollout_hosts", "decided_by")):  # fmt: skip
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    op.drop_table("fleet_decider")
