"""`python -m tests.hooked_worker WORKER_ARGS`: the reference worker with test hooks installed.

Production code has no test hooks; this entry point passes them in through the worker's seams
(`daemon.worker.server.main(before_write=...)`), configured by environment variables read here:

  HOTSWAP_TEST_PAUSE_BEFORE_WRITE_S   sleep this long inside every update, after validation and
                                      right before the write (a test damages the source then)
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from daemon.worker.server import main

PAUSE_BEFORE_WRITE_ENV = "HOTSWAP_TEST_PAUSE_BEFORE_WRITE_S"


def _hooks() -> list[Any]:
    delay = float(os.environ.get(PAUSE_BEFORE_WRITE_ENV, "0") or 0)
    return [lambda _request: time.sleep(delay)] if delay > 0 else []


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], before_write=_hooks()))
