"""A daemon stops at once on SIGTERM or Ctrl-C, even while its warm-up (the forward check's
`import torch`) runs (issue 36, item 10: the stop waited for it, 14-16 s). Measured in
bench/RESULTS.md; here, the order of what happens, with a real daemon process.

The warm-up is held from the test side: a `sitecustomize` on the daemon's PYTHONPATH makes its
import of `transformers` wait (for ten minutes) in the coordinator's thread; production code has
no hook for it.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO, DaemonProcess, wait_until

pytestmark = pytest.mark.timeout(300)

SLOW_IMPORT = '''
import sys, threading, time

class _Slow:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" and threading.current_thread().name == "coordinator":
            print("test: warm-up held", flush=True)
            time.sleep(600)
        return None

sys.meta_path.insert(0, _Slow())
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_does_not_wait_for_the_warm_up(
    sig: signal.Signals, tmp_path: Path, db_url: str, daemon_factory: Callable[..., DaemonProcess]
) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_IMPORT)
    d = daemon_factory(db_url, env={"PYTHONPATH": f"{hooks}:{REPO}"})
    wait_until(lambda: "test: warm-up held" in d.log(), 120, 0.1, "the warm-up held in its import")
    assert d.proc is not None
    d.proc.send_signal(sig)
    code = d.proc.wait(60)
    log = d.log()
    assert code == 0, log[-3000:]
    assert "stopped during the warm-up (not waited for)" in log, log[-3000:]
    assert log.index('"stopping"') < log.index('"stopped"')
