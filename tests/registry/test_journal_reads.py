"""`Journal.alias` and `Journal.checkpoint` read the checkpoint and this host's copy of it in one
statement (issue 28: a fleet agent reads them on every host every poll_s), and still give this
host's path only: another host's copy is never this host's."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import event
from support_fleet import seed_versions

from daemon.registry import Registry, hosts, queries
from daemon.registry.journal import Journal
from daemon.registry.status import CheckpointStatus


def test_one_statement_each_and_this_hosts_copy_only(db_url: str, tmp_path: Path) -> None:
    ra, rb = Registry(db_url, "host-a"), Registry(db_url, "host-b")
    ra.upgrade()
    ids = seed_versions(
        ra, tmp_path / "a", {"v0": CheckpointStatus.DEPLOYED, "v1": CheckpointStatus.VERIFIED}
    )
    ja, jb = Journal(ra), Journal(rb)
    ja.set_alias("serving", ids["v0"])
    jb.set_alias("serving", ids["v1"])
    with rb.session() as s:
        hosts.set_location(s, ids["v1"], str(tmp_path / "b" / "v1"))
    sent: list[str] = []
    event.listen(rb.engine, "before_cursor_execute", lambda _c, _cur, sql, *_a: sent.append(sql))
    serving, v0, missing = jb.alias("serving"), jb.checkpoint(ids["v0"]), jb.checkpoint(10_000)
    assert len(sent) == 3, sent
    assert (
        serving is not None and serving.version == "v1" and serving.local_path == str(tmp_path / "b" / "v1")
    )
    assert v0 is not None and v0.version == "v0" and v0.local_path is None  # host a's copy is not b's
    assert missing is None and jb.alias("pinned") is None
    a_serving = ja.alias("serving")
    assert (
        a_serving is not None
        and a_serving.version == "v0"
        and a_serving.local_path == str(tmp_path / "a" / "v0")
    )
    assert a_serving.status is CheckpointStatus.DEPLOYED and a_serving.verified and a_serving.step == 0
    ra.close()
    rb.close()


def test_history_pairs_a_status_with_the_serving_of_the_same_moment(db_url: str, tmp_path: Path) -> None:
    """A version begins to serve (alias, then status) between two of a reader's statements: the
    row says what held at one moment, never "deployed" beside "not serving" (CI saw that once)."""
    reader, writer = Registry(db_url, "host-a"), Registry(db_url, "host-a")
    reader.upgrade()
    ids = seed_versions(reader, tmp_path, {"v0": CheckpointStatus.DEPLOYED, "v1": CheckpointStatus.VERIFIED})
    j = Journal(writer)
    j.set_alias("serving", ids["v0"])
    moved: list[bool] = []

    def between(*_a: object) -> None:  # after the reader's first statement, once
        if not moved:
            moved.append(True)
            j.set_alias("serving", ids["v1"])
            j.move_status(ids["v1"], CheckpointStatus.DEPLOYED)

    event.listen(reader.engine, "after_cursor_execute", between)
    with reader.session() as s:
        rows = {r["version"]: r for r in queries.history(s)}
    assert moved
    seen = {v: (r["status"], r["serving"]) for v, r in rows.items()}
    assert seen["v1"] in (("verified", 0), ("deployed", 1)), seen
    reader.close()
    writer.close()


def test_the_status_document_reads_one_moment_while_a_version_begins_to_serve(db_url: str, tmp_path: Path) -> None:
    """`/status` and `hotswap status` read counts, rows, aliases and workers in several
    statements; a version that begins to serve between two of them must not show as serving in
    one part of the document and as waiting in another."""
    from daemon.api.app import ApiState, status_document
    from daemon.common.metrics import DaemonMetrics
    from daemon.controller.queue import RolloutState
    from daemon.controller.served import ServedVersions
    from daemon.registry.adapters import AdapterJournal

    reader, writer = Registry(db_url, "host-a"), Registry(db_url, "host-a")
    reader.upgrade()
    ids = seed_versions(reader, tmp_path, {"v0": CheckpointStatus.DEPLOYED, "v1": CheckpointStatus.VERIFIED})
    j = Journal(writer)
    j.set_alias("serving", ids["v0"])
    v0, v1 = j.checkpoint(ids["v0"]), j.checkpoint(ids["v1"])
    served = ServedVersions(j, AdapterJournal(writer), RolloutState(), lambda _k: None)
    moved: list[bool] = []

    def between(_c: object, _cur: object, sql: str, *_a: object) -> None:  # after the first SELECT, once
        if not moved and sql.lstrip().upper().startswith("SELECT"):
            moved.append(True)
            assert v1 is not None
            served.mark_serving(v1, v0, "rollout 2")

    event.listen(reader.engine, "after_cursor_execute", between)
    doc = status_document(ApiState(registry=reader, metrics=DaemonMetrics()))
    assert moved
    statuses = {r["version"]: r["status"] for r in doc["latest"]}
    before = (doc["checkpoints"].get("deployed"), doc["checkpoints"].get("verified"), doc["aliases"].get("serving"), statuses)
    assert before in ((1, 1, "v0", {"v0": "deployed", "v1": "verified"}),
                      (1, None, "v1", {"v0": "retired", "v1": "deployed"})), before  # fmt: skip
    reader.close()
    writer.close()
