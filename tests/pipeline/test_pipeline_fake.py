"""The pipeline's plug-in points in-process: a source type added by one module and one registry
line, the coordinator's fetch step (success, a passing failure retried, a lasting one rejected)
and the retention hook (a source prunes only what it created and nothing protected)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import publish_tiny, wait_until
from fake_source import FakeSource, FakeSourceConfig

from daemon import sources
from daemon.checks import CheckSettings
from daemon.config import ConfigError, parse_config
from daemon.pipeline.coordinator import Coordinator
from daemon.registry import Registry, status
from daemon.registry import queries as q
from daemon.registry.journal import Journal
from daemon.registry.models import Event
from daemon.registry.status import CheckpointStatus as C
from daemon.service import build_daemon

pytestmark = pytest.mark.quick

CHEAP = CheckSettings(enabled=("manifest", "headers", "crc32c"))


@pytest.fixture
def fake_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sources.SOURCE_TYPES, "fake", "fake_source:FakeSource")  # the one registry line


@pytest.fixture
def reg(tmp_path: Path) -> Iterator[Registry]:
    r = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    r.upgrade()
    yield r
    r.close()


def store(tmp_path: Path, *versions: str) -> Path:
    root = tmp_path / "store"
    for i, v in enumerate(versions):
        publish_tiny(root / v, seed=i + 1, version=v)
    return root


def status_of(reg: Registry, version: str) -> str | None:
    ref = Journal(reg).checkpoint_by_version(version)
    return ref.status if ref else None


def statuses(reg: Registry, version: str) -> list[str]:
    with reg.session() as s:
        ckpt = q.get_checkpoint(s, version)
        assert ckpt is not None
        return [e.to_state for e in s.query(Event).filter(Event.checkpoint_id == ckpt.id).order_by(Event.id)]


def test_a_new_source_type_is_one_module_and_one_registry_line(tmp_path: Path, fake_type: None) -> None:
    cfg = parse_config({"sources": [{"type": "fake", "store": str(tmp_path / "s")}, {"path": str(tmp_path / "w")}]},
                       "t.toml")  # fmt: skip
    assert isinstance(cfg.sources[0], FakeSourceConfig) and cfg.sources[0].label == f"fake:{tmp_path / 's'}"
    assert cfg.sources[1].type == "local"
    with pytest.raises(ConfigError, match=r"t.toml: sources\[0\].store: must not be empty"):
        parse_config({"sources": [{"type": "fake", "store": ""}]}, "t.toml")
    with pytest.raises(ConfigError, match=r"sources\[0\].bucket: unknown key"):
        parse_config({"sources": [{"type": "fake", "store": "x", "bucket": "b"}]}, "t.toml")
    d = build_daemon(parse_config({"sources": [{"type": "fake", "store": str(tmp_path / "s")}],
                                   "database": {"url": f"sqlite:///{tmp_path / 'd.db'}"}}, "t.toml"))  # fmt: skip
    assert [type(s) for s in d.sources] == [FakeSource]
    assert d.coordinator.sources == {d.sources[0].label: d.sources[0]}


def test_the_fetch_step_makes_a_discovered_checkpoint_local_then_it_is_verified(
    tmp_path: Path, reg: Registry
) -> None:
    src = FakeSource(FakeSourceConfig(store=str(store(tmp_path, "f1"))), emit=lambda item: None)
    coord = Coordinator(reg, CHEAP, sources={src.label: src})
    done: list[int] = []
    coord.on_verified = done.append
    src.emit = coord.intake
    src.offer("f1")
    coord.process(coord._queue.get_nowait())
    row = Journal(reg).checkpoint_by_version("f1")
    assert row is not None and row.status == C.VERIFIED and done == [row.id]
    assert row.local_path == str(src.cache / "f1") and src.fetched == ["f1"]
    assert statuses(reg, "f1") == ["discovered", "fetching", "verifying", "verified"]


def test_a_passing_fetch_failure_is_retried_and_a_lasting_one_rejects(tmp_path: Path, reg: Registry) -> None:
    src = FakeSource(FakeSourceConfig(store=str(store(tmp_path, "f1", "f2"))), emit=lambda item: None)
    coord = Coordinator(reg, CHEAP, sources={src.label: src})
    src.emit = coord.intake
    coord.start()
    try:
        src.fail_next("the store answered 503", retry_after_s=0.05)
        src.offer("f1")
        wait_until(lambda: status_of(reg, "f1") == C.VERIFIED, 30, what="f1 verified")
        assert statuses(reg, "f1") == ["discovered", "fetching", "discovered", "fetching", "verifying", "verified"]
        src.fail_next("object model.safetensors is gone from the store")
        src.offer("f2")
        wait_until(lambda: status_of(reg, "f2") == C.REJECTED, 30, what="f2 rejected")
        with reg.session() as s:
            f2 = q.get_checkpoint(s, "f2")
            assert f2 is not None and f2.status_message == "fetch failed: object model.safetensors is gone from the store"
            assert f2.local_path is None
    finally:
        coord.stop()


def test_a_checkpoint_whose_source_is_gone_is_rejected_with_the_reason(tmp_path: Path, reg: Registry) -> None:
    src = FakeSource(FakeSourceConfig(store=str(store(tmp_path, "f1"))), emit=lambda item: None)
    coord = Coordinator(reg, CHEAP)  # the source was removed from the config
    src.emit = coord.intake
    src.offer("f1")
    coord.process(coord._queue.get_nowait())
    with reg.session() as s:
        row = q.get_checkpoint(s, "f1")
        assert row is not None and row.status == "rejected"
        assert row.status_message == f"fetch failed: its source {src.label!r} is not configured"


def test_retention_prunes_only_what_a_source_created_and_never_serving_last_good_or_pinned(
    tmp_path: Path, fake_type: None
) -> None:
    versions = ("old", "serving", "good", "pinned", "waiting")
    root = store(tmp_path, *versions)
    cfg = parse_config({"sources": [{"type": "fake", "store": str(root)}, {"path": str(tmp_path / "watch")}],
                        "database": {"url": f"sqlite:///{tmp_path / 'd.db'}"}}, "t.toml")  # fmt: skip
    d = build_daemon(cfg)
    d.registry.upgrade()
    src = d.sources[0]
    assert isinstance(src, FakeSource)
    src.emit = d.coordinator.intake
    for v in versions:
        src.offer(v)
        d.coordinator.process(d.coordinator._queue.get_nowait())
    journal = Journal(d.registry)
    for alias, v in (("serving", "serving"), ("last_good", "good"), ("pinned", "pinned")):
        ref = journal.checkpoint_by_version(v)
        assert ref is not None
        journal.set_alias(alias, ref.id)
    old = journal.checkpoint_by_version("old")
    assert old is not None
    with d.registry.session() as s:  # "old" was deployed once, then replaced
        row = q.get_checkpoint(s, "old")
        assert row is not None
        status.move(s, row, C.DEPLOYED)
        status.move(s, row, C.RETIRED)
    removed = d.prune()
    assert removed == [src.cache / "old"]
    assert sorted(p.name for p in src.cache.iterdir()) == ["good", "pinned", "serving", "waiting"]
    assert (root / "old").is_dir()  # the store itself is never touched
    assert {src.cache / v for v in ("serving", "good", "pinned", "waiting")} <= src.pruned_with[-1]
    d.registry.close()


def test_the_watchdog_heartbeat_goes_on_while_the_warm_up_imports(reg: Registry) -> None:
    # The forward check's import (torch, transformers) is the coordinator's warm-up: ~3 s of CPU,
    # half a minute on a busy host. systemd's watchdog must not see a daemon that only imports as
    # stuck; once the warm-up is over, the beats come from the loop itself.
    release = threading.Event()
    beats: list[tuple[float, bool]] = []
    coord = Coordinator(reg, CHEAP)
    coord.warmup = lambda: release.wait(30)
    coord.set_heartbeat(lambda: beats.append((time.monotonic(), release.is_set())), 0.05)
    coord.start()
    try:
        wait_until(lambda: len(beats) >= 5, 10, what="heartbeats during the warm-up")
        assert not release.is_set() and all(not after for _, after in beats)
        release.set()
        wait_until(lambda: sum(after for _, after in beats) >= 3, 10, what="heartbeats from the loop after it")
        threads = {t.name for t in threading.enumerate()}
        assert "coordinator-warmup-beat" not in threads
    finally:
        release.set()
        coord.stop()
