"""The coordinator's warm-up (importing torch and transformers for the forward check), with the
watchdog heartbeat going on meanwhile.

The import takes ~3 s of CPU, half a minute or more on a cold or busy host. The coordinator's own
loop pings systemd's watchdog, so a stuck pipeline stops the pings; during the warm-up a helper
thread pings instead, up to WARMUP_BEAT_MAX_S, so a daemon that is only importing is not restarted
and a hung import is still caught.

A stop never waits for the warm-up: `import torch` cannot be interrupted, so the coordinator's
stop does not join a thread inside it (`warming` is set meanwhile) and `run_daemon` ends the
process once everything else has stopped (a stop takes well under 3 s; bench/RESULTS.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from daemon.common import get_logger

log = get_logger(__name__)
WARMUP_BEAT_MAX_S = 600.0


def warm_up(warmup: Callable[[], None], beat: Callable[[], object] | None, interval_s: float,
            warming: threading.Event | None = None) -> None:  # fmt: skip
    """Run `warmup` here; call `beat` every `interval_s` from another thread until it returns;
    `warming` is set meanwhile."""
    done = threading.Event()
    if warming is not None:
        warming.set()
    beater: threading.Thread | None = None
    if beat is not None and interval_s > 0:

        def beating() -> None:
            deadline = time.monotonic() + WARMUP_BEAT_MAX_S
            while time.monotonic() < deadline:
                beat()
                if done.wait(interval_s):
                    return

        beater = threading.Thread(target=beating, name="coordinator-warmup-beat", daemon=True)
        beater.start()
    try:
        warmup()
    except Exception:
        log.exception("warm-up failed")
    finally:
        done.set()
        if warming is not None:
            warming.clear()
        if beater is not None:
            beater.join()
