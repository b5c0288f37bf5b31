"""What the stager keeps staged (daemon.controller.served): serving, last_good and the versions
verified and waiting for their rollout, recomputed whenever serving or last_good moves.

On a GPU every staged version is a copy of the model (16 GB for 8B): the version a health window
retired from last_good held its copy until the next rollout, and on an 80 GB H100 with two 8B
workers the next version's staging was deferred for want of that memory, for good.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from daemon.controller.queue import RolloutState
from daemon.controller.served import ServedVersions
from daemon.registry import Registry, status
from daemon.registry.adapters import AdapterJournal
from daemon.registry.journal import CheckpointRef, Journal
from daemon.registry.models import Checkpoint
from daemon.registry.status import CheckpointStatus as C

pytestmark = pytest.mark.quick


def verified(reg: Registry, tmp_path: Path, version: str) -> CheckpointRef:
    local = tmp_path / version
    local.mkdir()
    with reg.session() as s:
        c = status.create(s, version=version, source="t", uri=f"file://{local}", local_path=str(local),
                          commit_signal="manifest")  # fmt: skip
        assert c is not None
        status.move(s, c, C.VERIFYING)
        status.move(s, c, C.VERIFIED)
        cid = c.id
    ref = Journal(reg).checkpoint(cid)
    assert ref is not None
    return ref


def test_a_version_that_leaves_last_good_is_freed_and_a_waiting_one_is_kept(registry: Registry, tmp_path: Path) -> None:
    reg = registry  # conftest's: SQLite, and PostgreSQL with HOTSWAP_TEST_POSTGRES_URL
    journal = Journal(reg)
    kept: list[set[str]] = []
    served = ServedVersions(journal, AdapterJournal(reg), RolloutState(), kept.append)
    v0, v1 = verified(reg, tmp_path, "v0"), verified(reg, tmp_path, "v1")
    served.mark_serving(v0, None, "first")
    served.mark_last_good(v0)
    served.mark_serving(v1, v0, "rollout 2")  # in its health window: v0 stays last_good
    v2 = verified(reg, tmp_path, "v2")  # verified meanwhile, waiting for its rollout (staged by verify)
    assert kept[-1] == {"v1", "v0"}
    served.mark_last_good(v1)  # the health window passed
    assert kept[-1] == {"v1", "v2"}  # v0's copy goes; v2's, already staged, stays for its rollout
    served.mark_serving(v2, v1, "rollout 3")
    assert kept[-1] == {"v2", "v1"}


def test_a_reader_never_finds_the_new_version_and_the_one_it_replaced_both_deployed(
    registry: Registry, tmp_path: Path
) -> None:
    """Deployed and retired commit together (CI reads the old row right after the new one's
    status: between two commits a busy host showed both `deployed`)."""
    journal = Journal(registry)
    served = ServedVersions(journal, AdapterJournal(registry), RolloutState(), lambda _k: None)
    v0, v1 = verified(registry, tmp_path, "v0"), verified(registry, tmp_path, "v1")
    served.mark_serving(v0, None, "first")
    seen: list[dict[str, str]] = []
    reader = Registry(registry.url)

    def look(_s: object) -> None:  # after each of the writer's commits
        with reader.session() as s:
            seen.append({c.version: c.status for c in s.scalars(select(Checkpoint))})

    registry.listen("after_commit", look)
    served.mark_serving(v1, v0, "rollout 2")
    reader.close()
    assert seen and seen[-1] == {"v0": "retired", "v1": "deployed"}, seen
    assert all(list(s.values()).count("deployed") == 1 for s in seen), seen


def test_a_reader_never_finds_serving_on_a_version_not_yet_deployed(registry: Registry, tmp_path: Path) -> None:
    """The serving alias moves with the statuses (before, the alias committed first: between the
    two commits `hotswap status` showed serving v1 while v1 was still `verified`)."""
    journal = Journal(registry)
    served = ServedVersions(journal, AdapterJournal(registry), RolloutState(), lambda _k: None)
    v0, v1 = verified(registry, tmp_path, "v0"), verified(registry, tmp_path, "v1")
    served.mark_serving(v0, None, "first")
    seen: list[tuple[str | None, dict[str, str]]] = []
    reader = Journal(Registry(registry.url))

    def look(_s: object) -> None:  # after each of the writer's commits
        with reader.registry.session() as s:
            statuses = {c.version: c.status for c in s.scalars(select(Checkpoint))}
        alias = reader.alias("serving")
        seen.append((alias.version if alias else None, statuses))

    registry.listen("after_commit", look)
    served.mark_serving(v1, v0, "rollout 2")
    reader.registry.close()
    assert seen and seen[-1] == ("v1", {"v0": "retired", "v1": "deployed"}), seen
    assert all(statuses[version] == "deployed" for version, statuses in seen if version), seen


def test_an_adapter_name_never_shows_serving_a_version_not_yet_deployed(registry: Registry, tmp_path: Path) -> None:
    """As for the base model: the name's serving alias commits with its status moves."""
    from daemon.registry.adapters import AdapterVersion

    journal, adapters = Journal(registry), AdapterJournal(registry)
    served = ServedVersions(journal, adapters, RolloutState(), lambda _k: None)
    a0, a1 = verified(registry, tmp_path, "a0"), verified(registry, tmp_path, "a1")
    served.mark_adapter_serving(AdapterVersion(a0, "sql", None), None, "first", lambda _n: None)
    seen: list[tuple[str | None, dict[str, str]]] = []
    reader = Registry(registry.url)

    def look(_s: object) -> None:  # after each of the writer's commits
        with reader.session() as s:
            statuses = {c.version: c.status for c in s.scalars(select(Checkpoint))}
        seen.append((AdapterJournal(reader).aliases().get("sql", {}).get("serving"), statuses))

    registry.listen("after_commit", look)
    served.mark_adapter_serving(AdapterVersion(a1, "sql", None), AdapterVersion(a0, "sql", None), "rollout 2",
                                lambda _n: None)  # fmt: skip
    reader.close()
    assert seen and seen[-1] == ("a1", {"a0": "retired", "a1": "deployed"}), seen
    assert all(statuses[version] == "deployed" for version, statuses in seen if version), seen
