"""The forward canary runs beside the finite scan (issue 41), and the outcome is still the ordered one.

Logic tests with the isolated checks replaced in this process (`daemon.checks.runner._run_one`):
finite waits for the forward to have started, so a run that did them one after another fails
here with finite's "never started" instead of hanging. The real check process runs in the
other checks tests (a NaN version rejected by finite, a bad forward by forward).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from support_checks import published

from daemon.checks import CHECK_NAMES, CheckFailed, CheckResult, CheckSettings, run_checks
from daemon.checks import runner as runner_module

pytestmark = pytest.mark.quick

WAIT_S = 30.0  # only reached when the forward never starts: the test then fails, it does not hang


class Checks:
    """The three overlapped checks, in this process; the others run for real."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, *, finite: str = "ok", headroom: str = "ok", wait_s: float = WAIT_S
    ) -> None:
        self.forward_started = threading.Event()
        self.forward_done = threading.Event()
        self.ran: list[str] = []
        self.finite, self.headroom = finite, headroom
        real = runner_module._run_one

        def run_one(name: str, adapter: bool, ctx: Any, settings: CheckSettings) -> dict[str, Any]:
            if name == "forward":
                self.forward_started.set()
                self.ran.append("forward")
                self.forward_done.set()
                return {"fake": True}
            if name == "finite":
                started = self.forward_started.wait(wait_s)
                self.ran.append("finite")
                if not started:
                    raise CheckFailed("the forward never started while finite ran")
                if self.finite == "nan":
                    raise CheckFailed("tensor 'w' holds 1 NaN")
                return {}
            if name == "headroom":
                self.ran.append("headroom")
                if self.headroom == "short":
                    raise CheckFailed("host RAM available is short", deferred=True)
                return {}
            return real(name, adapter, ctx, settings)

        monkeypatch.setattr(runner_module, "_run_one", run_one)


def _run(d: Path) -> tuple[Any, list[CheckResult]]:
    seen: list[CheckResult] = []
    return run_checks(d, CheckSettings(), on_result=seen.append), seen


def test_the_forward_runs_while_finite_scans_and_results_come_in_check_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = Checks(monkeypatch)
    report, seen = _run(published(tmp_path / "v"))
    assert report.ok, report.reason
    names = [r.name for r in seen]
    assert names[-3:] == ["finite", "headroom", "forward"], names
    assert [r.name for r in report.results] == names
    assert checks.ran.index("headroom") < checks.ran.index("forward")  # decided before the forward starts


def test_with_headroom_off_the_forward_still_runs_beside_finite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = Checks(monkeypatch)
    enabled = tuple(n for n in CHECK_NAMES if n != "headroom")
    seen: list[CheckResult] = []
    report = run_checks(published(tmp_path / "v"), CheckSettings(enabled=enabled), on_result=seen.append)
    assert report.ok, report.reason
    assert [r.name for r in seen][-2:] == ["finite", "forward"] and "headroom" not in checks.ran


def test_a_failing_finite_rejects_and_the_forward_it_overlapped_is_waited_for_not_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = Checks(monkeypatch, finite="nan")
    report, seen = _run(published(tmp_path / "v"))
    assert not report.ok and not report.deferred
    assert report.reason == "finite: tensor 'w' holds 1 NaN"
    assert [r.name for r in seen][-1] == "finite" and "forward" not in [r.name for r in seen]
    assert "headroom" not in [r.name for r in seen]  # not reached in order, so not reported
    assert checks.forward_done.is_set()  # finished before run_checks released what it read


def test_short_headroom_defers_and_no_forward_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = Checks(monkeypatch, headroom="short")
    checks.forward_started.set()  # finite must not wait for a forward that is rightly not started
    report, seen = _run(published(tmp_path / "v"))
    assert not report.ok and report.deferred
    assert [r.name for r in seen][-2:] == ["finite", "headroom"]
    assert "forward" not in checks.ran


def test_a_nan_version_after_a_short_headroom_is_still_rejected_not_deferred(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = Checks(monkeypatch, finite="nan", headroom="short")
    checks.forward_started.set()
    report, _ = _run(published(tmp_path / "v"))
    assert not report.ok and not report.deferred and report.reason.startswith("finite:")
    assert "forward" not in checks.ran


def test_without_the_check_process_the_checks_run_one_after_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = Checks(monkeypatch, wait_s=0.2)  # one after another, no forward can have started: no race
    seen: list[CheckResult] = []
    report = run_checks(published(tmp_path / "v"), CheckSettings(isolate_checks=False), on_result=seen.append)
    assert not report.ok and report.reason == "finite: the forward never started while finite ran"
    assert "forward" not in checks.ran
