"""Where commit -> every worker serving goes, phase by phase, from the daemon's registry (bench/gpu_e2e.py).

From the commit (the rename, clock of this host) to the moment the bench saw every worker
RUNNING on the version, in order; the phases add up to commit -> fleet:

  detect      commit -> `discovered` event
  fetch       discovered -> `verifying` (fetching / queueing; ~0 for a local folder)
  <check>     each check's own duration (crc32c = the one read: hash + stage)
  overlap     minus the time checks ran at once (the forward canary beside finite), so the
              phases still add up
  verify_rest verifying -> verified minus the checks (recording, scheduling)
  stage       verified -> `staged` (ipc: the loader stages it; disk: none)
  start       staged (or verified) -> the first worker's pause call begins
  wN_pause / wN_update / wN_post   each worker's pause call, update call, post-check + resume
  wN_gap      the previous worker RUNNING -> this worker's pause call (max_unavailable = 1; with
              workers updated at once, negative: the phases then overlap)
  observed    the last worker RUNNING -> the bench's poll saw every worker on it (can be a few ms
              negative: the worker serves as soon as it resumes, the event is written after)
"""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from typing import Any

CHECK_ORDER = ["manifest", "headers", "crc32c", "compat", "finite", "headroom", "forward"]


def _at(s: str) -> datetime:
    return datetime.fromisoformat(s).replace(tzinfo=UTC)


def _ms(a: datetime, b: datetime) -> float:
    return (b - a).total_seconds() * 1000.0


def _covered(spans: list[tuple[datetime, float]]) -> float:
    """Milliseconds of wall time the checks' spans (start, duration) cover, overlaps counted once."""
    total, end = 0.0, None
    for start, d in sorted(spans):
        stop = start + timedelta(milliseconds=d)
        if end is None or start >= end:
            total, end = total + d, stop
        elif stop > end:
            total, end = total + _ms(end, stop), stop
    return total


def phases(db: sqlite3.Connection, version: str, committed: datetime, fleet_s: float) -> dict[str, float]:
    """Milliseconds per phase (see the module docstring) for `version`, committed at `committed`."""
    (cid,) = db.execute("SELECT id FROM checkpoints WHERE version = ?", (version,)).fetchone()
    own = {s: _at(at) for s, at in db.execute(
        "SELECT to_state, MIN(at) FROM events WHERE checkpoint_id = ? AND worker IS NULL GROUP BY to_state", (cid,))}  # fmt: skip
    rows_c = db.execute("SELECT name, duration_ms, started_at FROM checks WHERE checkpoint_id = ?", (cid,)).fetchall()
    checks = {n: d for n, d, _s in rows_c}
    out: dict[str, float] = {}
    t = committed
    for state, name in (("discovered", "detect"), ("verifying", "fetch")):
        if state in own:
            out[name], t = _ms(t, own[state]), own[state]
    for n in sorted(checks, key=lambda n: CHECK_ORDER.index(n) if n in CHECK_ORDER else 99):
        out[n] = checks[n]
    covered = _covered([(_at(s), d) for _n, d, s in rows_c])
    if sum(checks.values()) - covered > 0.05:  # the forward ran beside finite: its time counted once
        out["overlap"] = covered - sum(checks.values())
    if "verified" in own:
        out["verify_rest"] = _ms(t, own["verified"]) - covered
        t = own["verified"]
    if "staged" in own and own["staged"] >= t:
        out["stage"], t = _ms(t, own["staged"]), own["staged"]
    rids = [r for (r,) in db.execute(
        "SELECT id FROM rollouts WHERE checkpoint_id = ? AND \"trigger\" = 'new'", (cid,))]  # fmt: skip
    rows = db.execute(
        f"SELECT worker, to_state, at, duration_ms FROM events WHERE worker IS NOT NULL AND rollout_id IN "
        f"({','.join('?' * len(rids))}) ORDER BY id", rids).fetchall() if rids else []  # fmt: skip
    order: list[str] = []
    for worker, _to, _at_s, _d in rows:
        if worker not in order:
            order.append(worker)
    for i, w in enumerate(order):
        mine = [(to, _at(at), d or 0.0) for worker, to, at, d in rows if worker == w]
        paused = next(((at, d) for to, at, d in mine if to == "PAUSED"), None)
        if paused is None:
            continue
        begin = paused[0] - timedelta(milliseconds=paused[1])
        out["start" if i == 0 else f"w{i}_gap"] = _ms(t, begin)
        out[f"w{i}_pause"] = paused[1]
        for to, at, d in mine:
            if to == "UPDATED":
                out[f"w{i}_update"] = d
            elif to == "RUNNING" and at >= paused[0]:
                out[f"w{i}_post"] = d
                t = at
    out["observed"] = fleet_s * 1000.0 - _ms(committed, t)
    return out


def phase_columns(samples: list[dict[str, Any]]) -> list[str]:
    seen: list[str] = []
    for s in samples:
        for k in s.get("phases_ms", {}):
            if k not in seen:
                seen.append(k)
    return seen


def median_phases(samples: list[dict[str, Any]]) -> dict[str, float]:
    import statistics

    cols = phase_columns(samples)
    return {c: statistics.median([s["phases_ms"][c] for s in samples if c in s.get("phases_ms", {})]) for c in cols}
