"""The check process (daemon.checks.isolation, issue 37): headers, compat and forward run in a child
under `checks.check_time_limit_s`; one past it is killed, fails naming the limit, and the next
check runs in a fresh child; a child that dies fails its check with the exit code; the waiting
thread pings the watchdog meanwhile. The daemon-level test is tests/e2e/test_check_time_limit_daemon.py.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import threading
from pathlib import Path

import pytest
from support_wait import wait_until

from daemon.checks import CheckSettings, run_checks
from daemon.checks.isolation import CheckProcess
from daemon.manifest import publish
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.quick
FEW = ("manifest", "headers", "crc32c", "compat")


def slow_header(directory: Path, tensors: int = 300_000) -> Path:
    """A checkpoint whose one shard has a header of `tensors` one-float tensors: seconds to parse."""
    make_tiny_checkpoint(directory, seed=4)
    header = {f"pad.{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(tensors)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4 * tensors))
    publish(directory, version=directory.name)
    return directory


def test_a_check_past_its_limit_is_killed_and_the_next_runs_in_a_fresh_child(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    proc = CheckProcess()
    monkeypatch.setattr("daemon.checks.runner.CHECK_PROCESS", proc)
    beats: list[float] = []
    proc.beat, proc.beat_s = (lambda: beats.append(1.0)), 0.05
    try:
        report = run_checks(slow_header(tmp_path / "slow"), CheckSettings(enabled=FEW, check_time_limit_s=0.5))
        assert not report.ok
        assert report.reason == ("headers: headers check ran past its time limit of 0.5 s "
                                 "(checks.check_time_limit_s); its process was killed")  # fmt: skip
        assert report.results[-1].detail["timed_out"] is True
        assert beats, "the waiting thread did not ping the watchdog"
        assert proc.starts == 1
        good = make_tiny_checkpoint(tmp_path / "good", seed=1)
        publish(good, version="good")
        assert run_checks(good, CheckSettings(enabled=FEW)).ok
        assert proc.starts == 2  # the killed child was replaced
    finally:
        proc.stop()


def test_a_child_that_dies_fails_its_check_with_the_exit_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = CheckProcess()
    monkeypatch.setattr("daemon.checks.runner.CHECK_PROCESS", proc)
    d = slow_header(tmp_path / "slow", tensors=600_000)
    result: dict[str, object] = {}
    t = threading.Thread(target=lambda: result.setdefault("r", run_checks(d, CheckSettings(enabled=FEW))))
    try:
        t.start()
        child = wait_until(lambda: proc._proc, 60, 0.02, "the check process")  # noqa: SLF001
        wait_until(lambda: proc.running == "headers", 60, 0.02, "the headers check in the child")
        os.kill(child.pid, signal.SIGKILL)
        t.join(60)
        report = result["r"]
        assert not report.ok  # type: ignore[attr-defined]
        assert report.reason == "headers: headers check's process died (exit code -9)", report.reason  # type: ignore[attr-defined]
    finally:
        proc.stop()


def test_headroom_alone_parses_the_headers_in_the_child_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deferred retry runs headroom alone, which reads the header table: that parse is bounded too."""
    proc = CheckProcess()
    monkeypatch.setattr("daemon.checks.runner.CHECK_PROCESS", proc)
    try:
        report = run_checks(slow_header(tmp_path / "slow"), CheckSettings(enabled=("headroom",), check_time_limit_s=0.5))
        assert not report.ok and report.results[-1].name == "headroom"
        assert "headers check ran past its time limit of 0.5 s (checks.check_time_limit_s)" in (report.reason or "")
        good = make_tiny_checkpoint(tmp_path / "good", seed=1)
        assert run_checks(good, CheckSettings(enabled=("headroom",))).ok
    finally:
        proc.stop()


def test_a_premap_is_opened_by_a_running_child_and_let_go_without_upsetting_its_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`premap` hands the child a loader buffer to open before the forward check (issue 41): the
    child opens it (unpickles it) unasked-for, answers nothing, lets it go on `premap(None)`; a
    premap that cannot be opened costs nothing; the next check's answer is its own."""
    from support_premap import Marker

    tests = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")])))
    proc = CheckProcess()
    monkeypatch.setattr("daemon.checks.runner.CHECK_PROCESS", proc)
    good = make_tiny_checkpoint(tmp_path / "good", seed=1)
    publish(good, version="good")
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    try:
        proc.premap(Marker(str(first)))  # no child yet: nothing is started for it
        assert proc._proc is None and not (first / "opened").exists()
        proc.start()
        proc.premap(Marker(str(first)))
        wait_until(lambda: (first / "opened").exists(), timeout=30, what="the child to open the premap")
        assert run_checks(good, CheckSettings(enabled=FEW)).ok  # its answer, not one for the premap
        proc.premap(Marker(str(second)))  # a newer one: the first is let go
        wait_until(lambda: (first / "discarded").exists(), timeout=30, what="the child to let the first go")
        assert (second / "opened").exists() and not (second / "discarded").exists()
        proc.premap(None)
        wait_until(lambda: (second / "discarded").exists(), timeout=30, what="the child to let the second go")
        proc.premap(Marker(str(tmp_path / "missing")))  # its open fails in the child
        report = run_checks(good, CheckSettings(enabled=FEW))
        assert report.ok and proc.starts == 1, report.reason
    finally:
        proc.stop()
