"""The path each worker's last update took (issue 39): `hotswap status` reads it from the newest
UPDATED events, and a rollout whose workers took another path than the configured transport
records the paths they took (`rollouts.transport`, e.g. "disk+ipc")."""

from __future__ import annotations

from daemon.registry import Registry, Rollout, status
from daemon.registry import queries as q
from daemon.registry.journal import Journal
from daemon.registry.status import RolloutOutcome, RolloutTrigger


def test_last_update_transport_per_worker_and_the_rollouts_own(db_url: str) -> None:
    reg = Registry(db_url, "a")
    reg.upgrade()
    journal = Journal(reg)
    with reg.session() as s:
        c = status.create(s, version="v1", source="t", uri="file:///v1", local_path="/v1", commit_signal="manifest")
        assert c is not None
        cid = c.id
    rids = []
    for used in ({"w0": "disk", "w1": "disk"}, {"w0": "ipc", "w1": "disk"}):
        rid = journal.start_rollout(cid, trigger=RolloutTrigger.NEW, transport="ipc", mode="drain", detail={})
        for worker, how in used.items():
            journal.transition(rollout_id=rid, worker=worker, from_state="DRAINING", to_state="UPDATED",
                               duration_ms=1.0, detail={"version": "v1", "transport": how})  # fmt: skip
            journal.transition(rollout_id=rid, worker=worker, from_state="UPDATED", to_state="RUNNING",
                               duration_ms=1.0, detail={})  # fmt: skip
        journal.finish_rollout(rid, RolloutOutcome.SUCCEEDED, transport="+".join(sorted(set(used.values()))))
        rids.append(rid)
    journal.transition(rollout_id=None, worker="w2", from_state="RUNNING", to_state="UNREACHABLE", duration_ms=None)
    with reg.session() as s:
        assert q.update_transports(s) == {"w0": "ipc", "w1": "disk"}
        assert [s.get(Rollout, r).transport for r in rids] == ["disk", "disk+ipc"]
    Journal(reg).finish_rollout(rids[1], RolloutOutcome.SUCCEEDED)  # no paths given: the column stays
    with reg.session() as s:
        assert s.get(Rollout, rids[1]).transport == "disk+ipc"
    with Registry(db_url, "b").session() as s:  # another host's status: its own workers only
        assert q.update_transports(s) == {}
