"""The test command must fail loudly when it runs nothing (a mistyped `-k` in CI is not green)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_a_filter_that_matches_no_test_fails() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_pytest_exit.py",
         "-k", "no_test_is_called_like_this"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 5, out.stdout + out.stderr  # pytest's "no tests collected"
    assert "deselected" in out.stdout
