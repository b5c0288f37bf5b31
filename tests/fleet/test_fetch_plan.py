"""Which way a fleet host without a delta's base takes (daemon.fleet.fetch.plan, issue 38): the anchor
plus the compacted delta, or the chain down to a link it holds, whichever moves fewer bytes by the
registry's figures. A real registry (SQLite, and PostgreSQL when configured), rows as the
registering host records them."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.fleet.fetch import plan
from daemon.registry import Registry, hosts, status
from daemon.registry import queries as q

FULL = 1_000  # the anchor's bytes
LINK = 100  # each delta's own bytes


def chain(db_url: str, compacted: dict[str, int]) -> Registry:
    """v1 full; v2..v4 deltas of the one before, each LINK bytes; `compacted`: version -> its bytes from v1."""
    reg = Registry(db_url, "host-late")
    reg.upgrade()
    with reg.session() as s:
        for i in range(1, 5):
            v = f"v{i}"
            ckpt = status.create(s, version=v, source="bucket", uri=f"s3://b/run/{v}/", local_path=None,
                                 commit_signal="manifest")  # fmt: skip
            assert ckpt is not None
            ckpt.total_bytes = FULL
            if i == 1:
                ckpt.encoding, ckpt.fetched_bytes = "full", FULL
            else:
                ckpt.encoding, ckpt.delta_base, ckpt.fetched_bytes = "delta", f"v{i - 1}", LINK
            if v in compacted:
                ckpt.compacted_from, ckpt.compacted_bytes = "v1", compacted[v]
    return reg


def held(reg: Registry, tmp_path: Path, *versions: str) -> None:
    with reg.session() as s:
        for v in versions:
            (tmp_path / v).mkdir()
            ckpt = q.get_checkpoint(s, v)
            assert ckpt is not None
            hosts.set_location(s, ckpt.id, str(tmp_path / v))


def planned(reg: Registry, version: str) -> tuple[bool, int, int]:
    with reg.session() as s:
        ckpt = q.get_checkpoint(s, version)
        assert ckpt is not None
        return plan(s, ckpt)


@pytest.mark.parametrize(("compacted", "here", "version", "expected"), [
    ({"v4": 160}, (), "v4", (True, 160 + FULL, 3 * LINK + FULL)),  # nothing here: both need the anchor
    ({"v4": 160}, ("v1",), "v4", (True, 160, 3 * LINK)),  # only the anchor here
    ({"v4": 160}, ("v2",), "v4", (False, 160 + FULL, 2 * LINK)),  # a link here: the chain is shorter
    ({"v4": 350}, ("v1",), "v4", (False, 350, 3 * LINK)),  # a compacted delta bigger than the chain
    ({}, (), "v4", (False, 0, 0)),  # none shipped: the chain
    ({"v3": 150}, (), "v3", (True, 150 + FULL, 2 * LINK + FULL)),
])  # fmt: skip
def test_the_fewer_bytes_way_is_taken(db_url: str, tmp_path: Path, compacted: dict[str, int],
                                      here: tuple[str, ...], version: str, expected: tuple[bool, int, int]) -> None:  # fmt: skip
    reg = chain(db_url, compacted)
    held(reg, tmp_path, *here)
    assert planned(reg, version) == expected


def test_a_gap_in_the_chain_takes_the_compacted_delta_which_skips_it(db_url: str, tmp_path: Path) -> None:
    reg = chain(db_url, {"v4": 160})
    with reg.session() as s:
        v3 = q.get_checkpoint(s, "v3")
        assert v3 is not None
        v3.delta_base = "v9"  # not registered
    assert planned(reg, "v4")[0] is True
