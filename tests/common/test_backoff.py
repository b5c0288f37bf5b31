"""The relaunch backoff schedule (daemon/common/backoff.py), the log tail a launch failure carries, and
the supervision keys of `[rollout]`: fast unit tests, no processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.common.backoff import Backoff, backoff_delay
from daemon.config import ConfigError, RolloutSettings, load_config
from daemon.controller.supervise import log_tail

pytestmark = pytest.mark.quick


def test_delays_double_from_the_base_up_to_the_cap() -> None:
    assert [backoff_delay(n, 1.0, 60.0) for n in range(9)] == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert backoff_delay(10_000, 0.5, 30.0) == 30.0  # no overflow however long it keeps failing


def test_consecutive_failures_grow_and_a_healthy_spell_resets_them() -> None:
    b = Backoff(base_s=1.0, max_s=8.0, reset_s=60.0)
    assert [b.failed() for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    b.healthy_for(59.0)  # not long enough: the next failure keeps growing from where it was
    assert b.failed() == 8.0
    b.healthy_for(60.0)
    assert b.failed() == 1.0


def test_a_reloaded_config_changes_the_schedule_but_keeps_the_count() -> None:
    b = Backoff(base_s=1.0, max_s=60.0)
    b.failed(), b.failed()
    b.configure(base_s=2.0, max_s=5.0, reset_s=10.0)
    assert b.failed() == 5.0  # third failure: 2 * 4 = 8, capped at 5


def test_log_tail_is_the_last_lines_of_this_launch_only(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_text("old launch\nold error\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.writelines(f"line {i}\n" for i in range(30))
    tail = log_tail(log, offset, lines=20)
    assert tail.splitlines() == [f"line {i}" for i in range(10, 30)]
    assert "old" not in log_tail(log, offset, lines=100)
    assert log_tail(tmp_path / "absent.log") == ""


def test_supervision_keys_have_sane_defaults_and_are_checked(tmp_path: Path) -> None:
    def load_config_text(text: str) -> object:
        (tmp_path / "c.toml").write_text(text)
        return load_config(tmp_path / "c.toml")

    s = RolloutSettings()
    assert (s.relaunch_backoff_s, s.relaunch_backoff_max_s, s.relaunch_reset_s) == (1.0, 60.0, 60.0)
    with pytest.raises(ConfigError, match=r"relaunch_backoff_max_s: must be >= relaunch_backoff_s"):
        load_config_text("[rollout]\nrelaunch_backoff_s = 10.0\nrelaunch_backoff_max_s = 5.0\n")
    with pytest.raises(ConfigError, match=r"relaunch_backoff_s: must be > 0"):
        load_config_text("[rollout]\nrelaunch_backoff_s = 0\n")
