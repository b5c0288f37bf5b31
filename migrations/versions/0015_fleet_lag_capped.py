"""fleet_versions: lag counted up to 1,000, so the view's cost follows its hosts, not the history

At 1,000,000 versions `SELECT ... FROM fleet_versions` took 189 ms (SQLite) / 253 ms
(PostgreSQL) when one host served nothing: its lag was every good version up to the target
(850,000 there), counted on every query (bench/RESULTS.md, "Registry at scale"). A lag that large
says only "far behind" (a host converges straight to the target, not through each version), so
each count now stops at LAG_CAP rows of `ix_checkpoints_good`: lag is exact up to 1,000, and a host
further behind reads 1,000 (1,001 when the target itself is not good). Every other column, and lag
below the cap, is 0011's.

Expand only: the view is replaced with the same columns; downgrade restores 0011's.

Revision ID: 0015_fleet_lag_capped
Revises: 0014_fleet_stages
Create Date: 2026-12-03
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0015_fleet_lag_capped"
down_revision = "0014_fleet_stages"
branch_labels = None
depends_on = None

LAG_CAP = 1000


def _sibling(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_hotswap_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fleet_versions() -> str:
    """0011's view with each count of good versions stopped after LAG_CAP rows."""
    v11 = _sibling("0011_views_follow_rows")

    def capped(where: str, lo: str | None, hi: str | None) -> str:
        step_lo = f"COALESCE({lo}.step, {v11.STEP_MIN})" if lo else v11.STEP_MIN
        step_hi = f"COALESCE({hi}.step, {v11.STEP_MAX})" if hi else v11.STEP_MAX
        id_lo = f"{lo}.id" if lo else v11.STEP_MIN
        id_hi = f"{hi}.id" if hi else v11.STEP_MAX
        return (f"(SELECT COUNT(*) FROM (SELECT u.id FROM ("
                f"SELECT g.id FROM checkpoints g WHERE {v11._good('g')} AND g.step BETWEEN {step_lo} AND {step_hi} "
                f"AND {where} "
                f"UNION ALL SELECT g.id FROM checkpoints g WHERE {v11._good('g')} AND g.step IS NULL "
                f"AND g.id BETWEEN {id_lo} AND {id_hi} AND {where} "
                f"UNION ALL SELECT g.id FROM checkpoints g WHERE {v11._good_by_alias('g')} AND {where}"
                f") u LIMIT {LAG_CAP}) capped)")  # fmt: skip

    view = v11.FLEET_VERSIONS
    newer = v11._newer
    for args in (
        (f"NOT {newer('g', 't')}", None, "t"),  # a host serving nothing
        (f"{newer('g', 's')} AND NOT {newer('g', 't')}", "s", "t"),  # behind the target
        (f"{newer('s', 'g')} AND NOT {newer('t', 'g')}", "t", "s"),
    ):  # past an operator's older target
        exact = v11._count(*args)
        assert exact in view, "0011's view changed: render the capped one from its text again"
        view = view.replace(exact, capped(*args))
    return str(view)


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS fleet_versions")
    op.execute(fleet_versions())


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS fleet_versions")
    op.execute(_sibling("0011_views_follow_rows").FLEET_VERSIONS)
