"""Bad checkpoints in the same gpu_e2e run: each must be rejected before any worker pauses.

For each kind (bench/e2e_versions.py: corrupt, nan, incompatible) a version is derived from the
serving one and committed while the load runs; then, from the registry: its status, the check
that failed and why, whether any rollout or worker event exists for it (there must be none),
and from the workers: both still serving the previous version; from the load: failed requests.
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.e2e_versions import derive

# what each kind should be caught by (the report says what did catch it)
EXPECTED = {"corrupt": "crc32c", "nan": "finite", "incompatible": "forward"}


def reject_one(run: Any, load: Any, kind: str, serving: str, seed: int, timeout: float,
               source: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Commit a bad version derived from full version `source` (default: `serving`) while `serving` serves."""
    version = f"{run.transport}-bad-{kind}"
    stage = Path(run.watch) / f".stage-{version}"
    t = time.perf_counter()
    what = derive(Path(run.watch) / (source or serving), stage, seed=seed, kind=kind, version=version)
    prep_s = time.perf_counter() - t
    before = load.snapshot()
    committed = datetime.now(UTC)
    t0 = time.perf_counter()
    os.rename(stage, Path(run.watch) / version)
    status = None
    while time.perf_counter() - t0 < timeout:
        with run.db() as c:
            row = c.execute("SELECT status FROM checkpoints WHERE version = ?", (version,)).fetchone()
        status = row[0] if row else None
        if status not in (None, "discovered", "fetching", "verifying"):
            break
        time.sleep(0.02)
    decided_s = time.perf_counter() - t0
    with run.db() as c:
        cid, status, message = c.execute(
            "SELECT id, status, status_message FROM checkpoints WHERE version = ?", (version,)).fetchone()  # fmt: skip
        failed = c.execute("SELECT name, detail FROM checks WHERE checkpoint_id = ? AND status = 'fail'", (cid,)).fetchone()
        ran = [n for (n,) in c.execute("SELECT name FROM checks WHERE checkpoint_id = ? ORDER BY id", (cid,))]
        rollouts = c.execute("SELECT COUNT(*) FROM rollouts WHERE checkpoint_id = ?", (cid,)).fetchone()[0]
        worker_events = c.execute(
            "SELECT COUNT(*) FROM events e JOIN rollouts r ON r.id = e.rollout_id "
            "WHERE r.checkpoint_id = ? AND e.worker IS NOT NULL", (cid,)).fetchone()[0]  # fmt: skip
    serving_now = run.versions()
    after = load.snapshot()
    caught_by = failed[0] if failed else None
    reason = json.loads(failed[1]).get("reason") if failed and failed[1] else message
    return {
        "kind": kind, "version": version, "made": what, "prep_s": round(prep_s, 2),
        "status": status, "caught_by": caught_by, "expected": EXPECTED.get(kind), "reason": reason,
        "checks_run": ran, "commit_to_decision_s": round(decided_s, 3),
        "rollouts": rollouts, "worker_events": worker_events, "workers_serving": serving_now,
        "rejected_before_any_pause": status == "rejected" and rollouts == 0 and worker_events == 0
        and all(v == serving for v in serving_now),
        "requests_failed": after["failed"] - before["failed"], "requests_ok": after["ok"] - before["ok"],
        "committed_at": committed.isoformat(),
    }  # fmt: skip


def print_rejections(rows: list[dict[str, Any]]) -> None:
    from bench.common import print_table

    print_table(
        "bad checkpoints, committed under load: rejected before any worker paused?",
        ["transport/version", "made", "status", "caught by", "expected", "commit->decision s", "no pause",
         "failed/ok", "reason"],
        [[r["version"], r["made"].get("kind"), r["status"], r["caught_by"], r["expected"], r["commit_to_decision_s"],
          r["rejected_before_any_pause"], f'{r["requests_failed"]}/{r["requests_ok"]}', (r["reason"] or "")[:90]]
         for r in rows],
    )  # fmt: skip
