"""The coordinator's rebuild step recycles a stale rebuilt directory (daemon.pipeline.deltas
pick_recycle): only one retention would delete (rejected, or finished and older than last good, no
alias, nothing protecting it), and only when its files have the result's paths and sizes. The
result is the trainer's bytes, verified, in the stale files' own inodes; the stale directory is
gone and its row has a `files_recycled` event. In-process, on SQLite and PostgreSQL."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import publish_tiny
from fake_source import FakeSource, FakeSourceConfig
from sqlalchemy import select
from support_delta import step

from daemon.checks import CheckSettings
from daemon.client import publish_delta
from daemon.config import parse_config
from daemon.delta.anchors import AnchorRule
from daemon.pipeline.coordinator import Coordinator
from daemon.registry import Event, Registry, status
from daemon.registry import queries as q
from daemon.registry.journal import Journal
from daemon.registry.status import CheckpointStatus as C
from daemon.service import build_daemon

CHEAP = CheckSettings(enabled=("manifest", "headers", "crc32c"))


class World:
    """v1 (full) and its delta v2 rebuilt into deltas/v2; v3, a delta of `v3_base`, still to come."""

    def __init__(self, registry: Registry, tmp_path: Path, v3_base: str = "v1", newer_full: bool = False) -> None:
        self.registry, self.tmp = registry, tmp_path
        store, trainer = tmp_path / "store", tmp_path / "trainer"
        publish_tiny(store / "v1", seed=1, version="v1", shards=2)
        step(store / "v1", trainer / "v2", 1e-4, 2, share=0.3)
        publish_delta(trainer / "v2", store / "v1", store / "v2", version="v2", rule=AnchorRule(share=100.0))
        if newer_full:  # a version newer than v2, to be last good: v2 is then older than last good
            publish_tiny(store / "vx", seed=5, version="vx", shards=2)
        self.src = FakeSource(FakeSourceConfig(store=str(store)), emit=lambda item: None)
        self.coord = Coordinator(registry, CHEAP, sources={self.src.label: self.src})
        self.coord.delta_dir = tmp_path / "deltas"
        self.src.emit = self.coord.intake
        self.journal = Journal(registry)
        for version in ("v1", "v2", "vx") if newer_full else ("v1", "v2"):
            self.offer(version)
        self.stale = self.coord.delta_dir / "v2"
        step(trainer / v3_base if v3_base != "v1" else store / "v1", trainer / "v3", 1e-4, 3, share=0.3)
        base = self.stale if v3_base == "v2" else store / "v1"  # a full v2 with its manifest: the rebuilt one
        publish_delta(trainer / "v3", base, store / "v3", version="v3", rule=AnchorRule(share=100.0))
        assert self.journal.checkpoint_by_version("v2").local_path == str(self.stale)  # type: ignore[union-attr]
        self.shards = sorted(p.name for p in self.stale.glob("*.safetensors"))
        assert len(self.shards) == 2

    def offer(self, version: str) -> None:
        self.src.offer(version)
        self.coord.process(self.coord._queue.get_nowait())

    def move(self, version: str, *to: C) -> None:
        with self.registry.session() as s:
            row = q.get_checkpoint(s, version)
            assert row is not None
            for t in to:
                status.move(s, row, t, "as the test needs")

    def alias(self, name: str, version: str) -> None:
        ref = self.journal.checkpoint_by_version(version)
        assert ref is not None
        self.journal.set_alias(name, ref.id)

    def inodes(self) -> dict[str, int]:
        return {n: (self.stale / n).stat().st_ino for n in self.shards}

    def rebuild_v3(self) -> Path:
        """v3 rebuilt and verified, the trainer's bytes exactly; its directory."""
        self.offer("v3")
        row = self.journal.checkpoint_by_version("v3")
        assert row is not None and row.status == C.VERIFIED, row
        out = self.coord.delta_dir / "v3"
        assert row.local_path == str(out)
        trainer = self.tmp / "trainer" / "v3"
        files = sorted(p.name for p in trainer.iterdir())
        assert all((out / n).read_bytes() == (trainer / n).read_bytes() for n in files)
        assert sorted(p.name for p in self.coord.delta_dir.iterdir() if p.name.startswith(".")) == []
        return out

    def recycled_events(self) -> list[dict[str, object]]:
        with self.registry.session() as s:
            rows = s.scalars(select(Event).where(Event.to_state == "files_recycled")).all()
            return [{"checkpoint": q.get_checkpoint_by_id(s, e.checkpoint_id).version, **(e.detail or {})}  # type: ignore[union-attr,arg-type]
                    for e in rows]  # fmt: skip


def test_a_rejected_versions_rebuilt_files_are_overwritten_in_place(registry: Registry, tmp_path: Path) -> None:
    w = World(registry, tmp_path)
    w.move("v2", C.REJECTED)
    before = w.inodes()
    out = w.rebuild_v3()
    assert not w.stale.exists()
    assert {n: (out / n).stat().st_ino for n in w.shards} == before  # the very files: reused
    assert [(e["checkpoint"], e["into"]) for e in w.recycled_events()] == [("v2", "v3")]
    assert w.journal.checkpoint_by_version("v2").local_path == str(w.stale)  # type: ignore[union-attr]  # as retention leaves it


def _kept(w: World) -> None:
    """v3 rebuilt into fresh files; deltas/v2 untouched."""
    before = {n: (w.inodes()[n], (w.stale / n).read_bytes()) for n in w.shards}
    out = w.rebuild_v3()
    assert {n: ((w.stale / n).stat().st_ino, (w.stale / n).read_bytes()) for n in w.shards} == before
    assert not {(out / n).stat().st_ino for n in w.shards} & {ino for ino, _b in before.values()}
    assert w.recycled_events() == []


@pytest.mark.parametrize("alias", ["serving", "last_good", "pinned"])
def test_a_version_an_alias_names_is_never_recycled(registry: Registry, tmp_path: Path, alias: str) -> None:
    w = World(registry, tmp_path)
    w.move("v2", C.REJECTED)
    w.alias(alias, "v2")
    _kept(w)


def test_a_verified_version_waiting_to_be_deployed_is_never_recycled(registry: Registry, tmp_path: Path) -> None:
    """Older than last good, no alias: only the protected set (waiting) keeps it."""
    w = World(registry, tmp_path, newer_full=True)
    w.alias("last_good", "vx")
    _kept(w)


def test_the_base_of_the_delta_being_rebuilt_is_never_recycled(registry: Registry, tmp_path: Path) -> None:
    """v2 served once and retired, older than last good, no alias: only the protected set (the base a
    fetched delta is to be rebuilt from, here the very rebuild's base) keeps it."""
    w = World(registry, tmp_path, v3_base="v2", newer_full=True)
    w.move("v2", C.DEPLOYED, C.RETIRED)
    w.alias("last_good", "vx")
    _kept(w)


def test_a_version_in_flight_is_never_recycled(registry: Registry, tmp_path: Path) -> None:
    w = World(registry, tmp_path)
    w.move("v2", C.DISCOVERED)  # sent back to be verified again (hotswap reverify)
    _kept(w)


def test_files_of_other_sizes_are_never_recycled(registry: Registry, tmp_path: Path) -> None:
    w = World(registry, tmp_path)
    w.move("v2", C.REJECTED)
    for n in w.shards:
        with open(w.stale / n, "ab") as f:
            f.write(b"\0")
    _kept(w)


def test_recycling_turned_off_never_recycles(registry: Registry, tmp_path: Path) -> None:
    w = World(registry, tmp_path)
    w.move("v2", C.REJECTED)
    w.coord.recycle_rebuilt = False
    _kept(w)


def test_the_config_switch_reaches_the_coordinator(tmp_path: Path) -> None:
    for value in (True, False):
        cfg = parse_config({"daemon": {"state_dir": str(tmp_path), "listen": "", "recycle_rebuilt": value},
                            "sources": []}, "t.toml")  # fmt: skip
        d = build_daemon(cfg)
        try:
            assert d.coordinator.recycle_rebuilt is value
        finally:
            d.registry.close()


def test_a_fleet_hosts_own_copy_recycles_too(registry: Registry, tmp_path: Path) -> None:
    """rebuild_copy (a fleet host rebuilding its copy of a registered version) picks the same way."""
    from daemon.pipeline import deltas

    w = World(registry, tmp_path)
    w.move("v2", C.REJECTED)
    w.coord.recycle_rebuilt = False
    w.rebuild_v3()  # v3 registered and verified, from fresh files; then this host's copy is gone
    shutil.rmtree(w.coord.delta_dir / "v3")
    before = w.inodes()
    row = w.journal.checkpoint_by_version("v3")
    assert row is not None
    out = deltas.rebuild_copy(registry, row.id, w.src.cache / "v3", w.coord.delta_dir)
    assert out == w.coord.delta_dir / "v3" and not w.stale.exists()
    assert {n: (out / n).stat().st_ino for n in w.shards} == before
    trainer = tmp_path / "trainer" / "v3"
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in trainer.iterdir())
    assert [(e["checkpoint"], e["into"]) for e in w.recycled_events()] == [("v2", "v3")]
