"""Commit detection and the local watched folder (no daemon, no database)."""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import publish_tiny, wait_until

from daemon.formats.checkpoint import INDEX_NAME, MANIFEST_NAME
from daemon.sources.commit import CommitDetector, natural
from daemon.sources.local import LocalSource
from daemon.sources.local import LocalSourceConfig as SourceConfig
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.quick

ALL = ["manifest", "index", "marker"]


class FakeClock:
    """The detector's clock seam: quiet periods pass when the test says so, not by sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_manifest_commits_at_once_with_its_version(tmp_path):
    publish_tiny(tmp_path / "dir-name", seed=1, version="step-7")
    d = CommitDetector(ALL, quiet_period_s=60).check(tmp_path / "dir-name")
    assert (d.committed, d.signal, d.version) == (True, "manifest", "step-7")


def test_manifest_landing_before_its_files_waits_for_them(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    publish_tiny(src, seed=1)
    dst.mkdir()
    shutil.copy(src / MANIFEST_NAME, dst / MANIFEST_NAME)  # e.g. `cp -r` listing order
    det = CommitDetector(ALL, quiet_period_s=0.3)
    first = det.check(dst)
    assert not first.committed and "not there yet" in first.reason
    # half a file: still pending
    data = (src / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert not det.check(dst).committed
    (dst / "model.safetensors").write_bytes(data)
    shutil.copy(src / "config.json", dst / "config.json")
    assert det.check(dst).committed


def test_manifest_whose_file_never_arrives_waits_for_the_commit_timeout_then_is_handed_on(tmp_path):
    """Finding 8: a writer that stalls longer than the quiet period is waited for (a missing or
    short file is "not yet", not "final"); only after the commit timeout of no change at all is
    it handed on, so the checks reject it with the missing file named."""
    publish_tiny(tmp_path / "c", seed=1)
    (tmp_path / "c" / "config.json").unlink()
    clock = FakeClock()
    det = CommitDetector(ALL, quiet_period_s=0.2, commit_timeout_s=30.0, clock=clock)
    first = det.check(tmp_path / "c")
    assert not first.committed and "config.json not there yet" in first.reason
    clock.advance(20.0)  # far past the quiet period: still waiting
    waiting = det.check(tmp_path / "c")
    assert not waiting.committed and "waiting up to 10 s more" in waiting.reason
    assert waiting.recheck_after_s is not None and waiting.recheck_after_s <= 10.0
    clock.advance(10.5)
    assert det.check(tmp_path / "c").committed


def test_short_file_waits_and_a_change_restarts_the_commit_timeout(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    publish_tiny(src, seed=1)
    shutil.copytree(src, dst)
    data = (src / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[:100])
    clock = FakeClock()
    det = CommitDetector(ALL, quiet_period_s=0.2, commit_timeout_s=30.0, clock=clock)
    assert "has 100 of" in det.check(dst).reason
    clock.advance(25.0)
    (dst / "model.safetensors").write_bytes(data[:200])  # progress: the timeout starts over
    assert not det.check(dst).committed
    clock.advance(25.0)
    assert not det.check(dst).committed
    (dst / "model.safetensors").write_bytes(data)
    assert det.check(dst).committed


def test_index_needs_all_shards_and_a_quiet_period(tmp_path):
    ckpt = tmp_path / "sharded"
    make_tiny_checkpoint(ckpt, seed=2, shards=2)
    shards = sorted(json.loads((ckpt / INDEX_NAME).read_text())["weight_map"].values())
    moved = ckpt / shards[-1]
    hidden = tmp_path / "hidden"
    moved.rename(hidden)
    clock = FakeClock()
    det = CommitDetector(["index"], quiet_period_s=0.3, clock=clock)
    d = det.check(ckpt)
    assert not d.committed and "missing" in d.reason
    hidden.rename(moved)
    d = det.check(ckpt)
    assert not d.committed and d.recheck_after_s is not None
    clock.advance(0.15)
    with open(moved, "ab") as f:  # still growing: the quiet period starts over
        f.write(b"\0")
    assert not det.check(ckpt).committed
    clock.advance(0.2)
    assert not det.check(ckpt).committed
    clock.advance(0.15)
    d = det.check(ckpt)
    assert (d.committed, d.signal, d.version) == (True, "index", "sharded")


def test_marker_and_signal_order(tmp_path):
    ckpt = tmp_path / "m"
    make_tiny_checkpoint(ckpt, seed=3)
    assert not CommitDetector(ALL, 0.1, ["_SUCCESS"]).check(ckpt).committed
    (ckpt / "_SUCCESS").write_text("")
    assert CommitDetector(ALL, 0.1, ["_SUCCESS"]).check(ckpt).signal == "marker"
    assert not CommitDetector(["manifest"], 0.1, ["_SUCCESS"]).check(ckpt).committed  # marker not enabled


class Collector:
    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()

    def __call__(self, item) -> None:
        self.items.put(item)

    def all(self) -> list:
        out = []
        while not self.items.empty():
            out.append(self.items.get())
        return out


@pytest.fixture
def source(tmp_path):
    made = []

    def make(**kw) -> tuple[LocalSource, Collector]:
        got = Collector()
        cfg = SourceConfig(path=str(tmp_path / "watch"), **{"rescan_interval_s": 60.0, **kw})
        src = LocalSource(cfg, got)
        src.start()
        made.append(src)
        return src, got

    yield make
    for s in made:
        s.stop()


def next_look(src: LocalSource, name: str, action: Callable[[], object] | None = None) -> None:
    """Run `action` (default: a rescan), then wait until the source has checked `name` once more:
    after that, whatever the check would emit has been emitted (no fixed sleep)."""
    before = src.looks(name)
    (action or src.rescan)()
    wait_until(lambda: src.looks(name) > before, 10, what=f"the source to check {name!r} again")


def test_watched_folder_emits_once_on_publish(source, tmp_path):
    src, got = source()
    make_tiny_checkpoint(src.root / "step-1", seed=1)
    next_look(src, "step-1")
    assert got.all() == []  # no signal yet
    from daemon.manifest import publish

    publish(src.root / "step-1", version="v-1")
    item = got.items.get(timeout=5)
    assert (item.version, item.signal, item.directory) == ("v-1", "manifest", src.root / "step-1")
    next_look(src, "step-1")
    assert got.all() == []  # checked again after the commit, nothing changed: no re-emit
    (src.root / "step-1" / "extra.txt").write_text("later")  # its files changed: handed on again
    again = got.items.get(timeout=5)  # (the coordinator decides what a change means)
    assert (again.version, again.directory) == ("v-1", src.root / "step-1")


def test_hidden_build_dir_renamed_into_place(source, tmp_path):
    src, got = source()
    publish_tiny(src.root / ".tmp-step-2", seed=2, version="step-2")
    publish_tiny(src.root / "beside", seed=3, version="beside")  # later events: emitted after the hidden one's
    assert got.items.get(timeout=5).version == "beside"
    assert got.all() == [] and src.looks(".tmp-step-2") == 0  # hidden: never even looked at
    os.rename(src.root / ".tmp-step-2", src.root / "step-2")
    assert got.items.get(timeout=5).version == "step-2"


def test_a_directory_that_changes_while_it_is_checked_is_emitted_once(source, tmp_path):
    """CI: a manifest renamed into place between the source's snapshot of the folder and its
    commit check emitted the checkpoint, then again at the next look (the files differed from
    the snapshot). Now the look that saw a change waits for the folder to hold still."""
    src, got = source()
    real_check = src.detector.check
    changed: list[Path] = []

    def check_while_a_file_lands(directory: Path):  # type: ignore[no-untyped-def]
        decision = real_check(directory)
        if decision.committed and not changed:  # the first check that commits: a file lands during it
            (directory / "notes.txt").write_text("written during the check")
            changed.append(directory)
        return decision

    src.detector.check = check_while_a_file_lands  # type: ignore[method-assign]
    publish_tiny(src.root / "step-3", seed=3, version="step-3")
    assert got.items.get(timeout=10).version == "step-3"
    assert changed, "the check never ran"
    next_look(src, "step-3")
    assert got.all() == []  # looked at again, nothing new: not emitted a second time


def test_rescan_finds_what_events_missed(source, tmp_path):
    watch = tmp_path / "watch"
    publish_tiny(watch / "before-start", seed=4)  # exists before the observer does
    src, got = source(rescan_interval_s=0.5)
    assert got.items.get(timeout=5).version == "before-start"
    # Simulate a lost event: write without the observer seeing it, the periodic rescan finds it.
    src._observer.stop()
    src._observer.join()
    publish_tiny(watch / "missed", seed=5)
    assert got.items.get(timeout=5).version == "missed"


def test_a_scan_emits_checkpoints_in_the_order_they_were_committed(source, tmp_path):
    """CI: ten checkpoints renamed into place within a second, and a rescan that ran before
    their events arrived emitted them in the folder listing's order (a hash on ext4). A version
    without a step is ordered by arrival, so s3 was deployed as the newest instead of s10. A
    scan now emits the oldest change first (ctime, then the name with numbers as numbers)."""
    watch = tmp_path / "watch"
    committed = [f"s{i}" for i in range(1, 13)]
    random.Random(7).shuffle(committed)  # neither name order nor numeric order
    last = 0
    for name in committed:
        publish_tiny(watch / f".build-{name}", seed=len(name), version=name)
        os.rename(watch / f".build-{name}", watch / name)
        while (ctime := (watch / name).stat().st_ctime_ns) <= last:  # a later kernel tick than the one before
            os.utime(watch / name)
        last = ctime
    src, got = source()  # its first scan finds all twelve at once
    assert [got.items.get(timeout=10).version for _ in committed] == committed
    assert sorted(["s10", "s2", "s1", "a"], key=natural) == ["a", "s1", "s2", "s10"]


def test_watch_folder_created_later(tmp_path):
    got = Collector()
    watch = tmp_path / "later"
    src = LocalSource(SourceConfig(path=str(watch), create=False, rescan_interval_s=0.3), got)
    src.start()
    try:
        publish_tiny(watch / "a", seed=6)
        assert got.items.get(timeout=5).version == "a"
        publish_tiny(watch / "b", seed=7)  # the observer is running by now
        assert got.items.get(timeout=5).version == "b"
    finally:
        src.stop()


def test_removed_and_recreated_directory_is_seen_again(source, tmp_path):
    src, got = source()
    publish_tiny(src.root / "again", seed=8, version="again-1")
    assert got.items.get(timeout=5).version == "again-1"
    shutil.rmtree(src.root / "again")
    wait_until(lambda: src.root / "again" not in src._emitted, 5, what="forgetting the removed dir")
    publish_tiny(src.root / "again", seed=9, version="again-2")
    assert got.items.get(timeout=5).version == "again-2"


def test_failed_emit_is_retried(source, tmp_path):
    calls: list[str] = []
    src, got = source()

    def flaky(item) -> None:
        calls.append(item.version)
        if len(calls) == 1:
            raise RuntimeError("database blinked")
        got(item)

    src.emit = flaky
    publish_tiny(src.root / "flaky", seed=10)
    # no event and no rescan (60 s) needed: the source retries by itself
    wait_until(lambda: len(calls) >= 2, 5, what="a retry")
    assert got.items.get(timeout=5).version == "flaky"


def test_detection_is_not_fooled_by_a_plain_file(source, tmp_path):
    src, got = source()
    (src.root / "notes.txt").write_text("not a checkpoint")
    publish_tiny(src.root / "real", seed=9)  # a checkpoint beside it: once emitted, the scan is done
    src.rescan()
    assert got.items.get(timeout=5).version == "real"
    next_look(src, "notes.txt", lambda: src.mark_dirty("notes.txt"))  # looked at: still nothing
    assert got.all() == []
    assert Path(src.root / "notes.txt").exists()


def test_a_checkpoint_whose_label_cannot_be_used_is_refused_and_the_source_goes_on(source, tmp_path):
    """A manifest's version with a newline (a forged log line) and a folder named with a terminal
    escape (committed by its marker, so the name is the label) are refused with the reason, never
    emitted; a good checkpoint beside them is; a fixed manifest is emitted once it changes."""
    src, got = source()
    publish_tiny(tmp_path / "nl", seed=1)
    manifest = tmp_path / "nl" / MANIFEST_NAME
    good_doc = manifest.read_text()
    manifest.write_text(good_doc.replace('"version": "nl"', '"version": "nl\\nlevel=error event=forged"'))
    os.replace(tmp_path / "nl", src.root / "nl")
    escape = "v\x1b[2J"
    make_tiny_checkpoint(tmp_path / "esc", seed=2)
    (tmp_path / "esc" / "_SUCCESS").write_text("")
    os.replace(tmp_path / "esc", src.root / escape)
    publish_tiny(tmp_path / "ok", seed=3)
    os.replace(tmp_path / "ok", src.root / "ok")
    assert got.items.get(timeout=10).version == "ok"
    wait_until(lambda: len(src._refused) == 2, 10, what=f"both refused (refused so far: {src._refused})")
    refused = src.describe()["refused"]
    assert "contains a newline" in refused["nl"] and "'nl\\nlevel=error event=forged'" in refused["nl"], refused
    assert "contains a control character" in refused[escape], refused
    assert got.all() == []
    manifest = src.root / "nl" / MANIFEST_NAME
    manifest.write_text(good_doc)  # fixed: its files changed, looked at again
    assert got.items.get(timeout=10).version == "nl"
    wait_until(lambda: set(src.describe().get("refused", {})) == {escape}, 10, what="only the escape still refused")


def test_labels_a_shell_or_a_command_would_read_are_refused(source, tmp_path):
    """Issue 37, item 6: a label is `[A-Za-z0-9._@+-]`, not starting with '-'; a folder named
    `$(id)` or `-rf` (committed by its marker, so the name is the label) is refused, naming why."""
    src, got = source()
    for name, seed in (("v$(id)", 1), ("-rf", 2), ("a b;c", 3)):
        make_tiny_checkpoint(tmp_path / f"x{seed}", seed=seed)
        (tmp_path / f"x{seed}" / "_SUCCESS").write_text("")
        os.replace(tmp_path / f"x{seed}", src.root / name)
    publish_tiny(tmp_path / "run-1@v2+3", seed=4)
    os.replace(tmp_path / "run-1@v2+3", src.root / "run-1@v2+3")
    assert got.items.get(timeout=10).version == "run-1@v2+3"
    wait_until(lambda: len(src._refused) == 3, 10, what=f"all three refused (so far: {src._refused})")
    refused = src.describe()["refused"]
    assert "starts with '-'" in refused["-rf"], refused
    assert "a label is letters" in refused["v$(id)"] and "a label is letters" in refused["a b;c"], refused
    assert got.all() == []
