"""An assert that fails in a helper thread fails the test that asked for `thread_errors`
(tests/conftest.py); without it pytest only warns, and the test passes. Run as a child pytest on a
generated test file, with this suite's conftest as its plugin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO

BODY = '''
import threading


def poller():
    raise AssertionError("boom in the poller: status 503")


def test_with(thread_errors):
    t = threading.Thread(target=poller, name="poller")
    t.start()
    t.join()


def test_without():
    t = threading.Thread(target=poller, name="poller")
    t.start()
    t.join()
'''


def test_a_failing_helper_thread_fails_the_test(tmp_path: Path) -> None:
    (tmp_path / "test_child.py").write_text(BODY)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
                          "-W", "default", str(tmp_path / "test_child.py")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO / "tests") + ":" + str(REPO), "PATH": "/usr/bin:/bin"})  # fmt: skip
    text = out.stdout + out.stderr
    assert "1 failed, 1 passed" in text, text[-3000:]
    assert "FAILED test_child.py::test_with" in text and "in poller: AssertionError: boom in the poller" in text, text[-3000:]
