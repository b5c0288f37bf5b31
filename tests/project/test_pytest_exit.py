"""The test command must fail loudly when it runs nothing (a mistyped `-k` in CI is not green).
It is the README's own command, `./scripts/test.sh`, that is run (the whole-suite form `.ci/run`
uses: pytest-xdist over every module), not pytest called some other way."""

from __future__ import annotations

import subprocess

from conftest import REPO


def test_a_filter_that_matches_no_test_fails() -> None:
    out = subprocess.run(
        [str(REPO / "scripts" / "test.sh"), "-q", "-p", "no:cacheprovider", "-k", "no_test_is_called_like_this"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 5, out.stdout[-3000:] + out.stderr[-3000:]  # pytest's "no tests collected"
    assert "no tests ran" in out.stdout, out.stdout[-3000:]
    assert "bringing up nodes" in out.stdout, out.stdout[-3000:]  # the suite form: pytest-xdist workers
