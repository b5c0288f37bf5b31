"""`fleet_versions`' lag and `hotswap status --fleet`'s state agree: a host serving the fleet
target has lag 0 and is `in sync`, a host the agent would move has lag >= 1 and is not, and the
view's target is the daemon's (`fleet_target`), an operator's older one too."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, text
from support_fleet import seed_versions

from daemon.fleet.behind import is_behind
from daemon.fleet.target import fleet_rows, fleet_target, set_fleet_target
from daemon.registry import Registry
from daemon.registry.journal import Journal
from daemon.registry.models import Checkpoint
from daemon.registry.status import CheckpointStatus as S

pytestmark = pytest.mark.quick


def test_lag_counts_towards_the_target_and_agrees_with_the_state(db_url: str, tmp_path: Path) -> None:
    reg = Registry(db_url, "setup")
    reg.upgrade()
    ids = seed_versions(reg, tmp_path, {"v0": S.RETIRED, "v1": S.RETIRED, "v2": S.DEPLOYED, "v3": S.REJECTED,
                                        "v4": S.DEPLOYED, "x": S.RETIRED})  # fmt: skip
    with reg.session() as s:  # x came without a step (no manifest): older than any version with one
        s.get_one(Checkpoint, ids["x"]).step = None
    regs = {h: Registry(db_url, h) for h in ("a", "b", "c", "d", "e")}
    journals = {h: Journal(r) for h, r in regs.items()}

    def on(host: str, serving: str, last_good: str | None = None) -> None:
        journals[host].set_alias("serving", ids[serving])
        if last_good is not None:
            journals[host].set_alias("last_good", ids[last_good])

    on("a", "v3", "v3")  # v3 was good on host a, and rejected since
    on("a", "v2", "v2")
    on("b", "v1", "v1")
    on("c", "v0", "v0")
    on("d", "v4", "v2")  # in v4's health window: v4 is not good yet
    on("e", "x", "x")  # good, no step, arrived last
    with reg.engine.begin() as c:  # succeeded rollouts of every version (what the old lag counted)
        for v in ("v1", "v2", "v3", "v4"):
            c.execute(text("INSERT INTO rollouts (checkpoint_id, host, trigger, transport, mode, started_at, "
                           "outcome) VALUES (:c, 'a', 'new', 'disk', 'copy', CURRENT_TIMESTAMP, 'succeeded')"),
                      {"c": ids[v]})  # fmt: skip

    def fleet() -> dict[str, tuple[str, str, int]]:
        doc = fleet_rows(reg)
        target = fleet_target(Journal(reg))
        rows = doc["hosts"]
        assert target is not None and {r["target"] for r in rows} == {target.checkpoint.version}, (target, rows)
        for r in rows:  # the view's lag, the state and the agent's own rule agree on every host
            j = journals[r["host"]]
            moves = is_behind(fleet_target(j), j.alias("serving"))
            seen: dict[str, Any] = {k: r[k] for k in ("host", "serving", "target", "state", "lag")}
            assert (r["state"] == "in sync") == (r["serving"] == r["target"]) and (r["lag"] == 0) != moves, seen
        return {r["host"]: (r["serving"], r["state"], r["lag"]) for r in rows}

    assert fleet() == {"a": ("v2", "in sync", 0), "b": ("v1", "behind", 1), "c": ("v0", "behind", 2),
                       "d": ("v4", "ahead", 0), "e": ("x", "ahead", 0)}  # fmt: skip
    set_fleet_target(reg, "v1", by="operator")  # held on an older version
    assert fleet() == {"a": ("v2", "behind", 1), "b": ("v1", "in sync", 0), "c": ("v0", "behind", 1),
                       "d": ("v4", "behind", 2), "e": ("x", "behind", 2)}  # fmt: skip
    set_fleet_target(reg, "v4", by="operator")  # a verified version not yet good anywhere
    assert fleet() == {"a": ("v2", "behind", 1), "b": ("v1", "behind", 2), "c": ("v0", "behind", 3),
                       "d": ("v4", "in sync", 0), "e": ("x", "behind", 1)}  # fmt: skip
    for r in (reg, *regs.values()):
        r.close()


def test_status_fleet_cuts_long_names_never_state_or_lag(
    db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from daemon.cli.read import fleet_status

    reg = Registry(db_url, "gpu-node-17.example.internal")
    reg.upgrade()
    ids = seed_versions(reg, tmp_path, {"step-000119-final": S.RETIRED, "step-000120-final": S.DEPLOYED})
    other = Registry(db_url, "gpu-node-18.example.internal")
    for r, v in ((reg, "step-000120-final"), (other, "step-000119-final")):
        Journal(r).set_alias("serving", ids[v])
        Journal(r).set_alias("last_good", ids[v])
    monkeypatch.setenv("COLUMNS", "80")
    assert fleet_status(reg, False) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(ln) for ln in lines) <= 80, "\n".join(lines)
    rows = [ln for ln in lines if ln.startswith("│ gpu-node-")]
    assert len(rows) == 2 and "│ in sync │   0 │" in rows[0] and "│ behind  │   1 │" in rows[1], "\n".join(lines)
    other.close()
    reg.close()


def test_lag_is_counted_up_to_the_cap(db_url: str) -> None:
    """Migration 0015: a host far behind (here: serving nothing, 1,200 good versions up to the
    target) reads lag 1,000, not every good version of the history; one a few behind, the exact count."""
    reg = Registry(db_url, "near")
    reg.upgrade()
    now = datetime.now(UTC)
    rows = [{"version": f"v{i}", "source": "local:/x", "uri": f"file:///x/v{i}", "step": i, "status": "retired",
             "verified_at": now, "last_good_at": now} for i in range(1200)]  # fmt: skip
    with reg.session() as s:
        s.execute(insert(Checkpoint), rows)
    j = Journal(reg)
    ids = {r.version: r.id for r in (j.checkpoint_by_version(v) for v in ("v1196", "v1199")) if r}
    j.set_alias("serving", ids["v1196"])
    empty = Registry(db_url, "empty")
    Journal(empty).register_workers([("w0", "builtin", "http://x", "cpu")])
    empty.close()
    with reg.engine.connect() as c:
        lag = dict(c.execute(text("SELECT host, lag FROM fleet_versions")).all())  # type: ignore[arg-type]
    assert lag == {"near": 3, "empty": 1000}, lag
    reg.close()
