"""Does what a worker reports match what the registry says it should serve? (issue 10, finding 4)

On every health poll, each RUNNING worker's report (version, digest, and for the disk transport
the directory it loaded) is compared with the registry's record of that version. Anything that
does not match, e.g. another process loaded its own weights into the worker under the real
version label, is drift: the worker moves to UNCERTAIN (an `events` row with what differed), an
alert is logged, and it stays UNCERTAIN, whatever it reports, until the daemon has re-installed a
known version on it (the reconcile job: `recover_uncertain`). A version the registry does not
know is not judged here: it is version drift, which the reconcile job corrects anyway.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from daemon.adapters.base import WeightInfo
from daemon.logging import get_logger
from daemon.registry.journal import CheckpointRef, Journal
from daemon.rollout.driver import WorkerDriver
from daemon.rollout.stage import Target
from daemon.rollout.states import WorkerHandle, WorkerState, parse_state

log = get_logger(__name__)
S = WorkerState


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def drift(info: WeightInfo, ckpt: CheckpointRef | None) -> str | None:
    """One line naming what the worker reports that the registry's record of its version does
    not vouch for; None when it all matches (or the version is not one the registry knows)."""
    if ckpt is None:
        return None
    if ckpt.digest and info.digest and info.digest != ckpt.digest:
        return (f"reports digest {info.digest} for {info.version}; the registry's digest of that "
                f"version is {ckpt.digest}")  # fmt: skip
    path = info.extra.get("path")
    if (info.extra.get("transport") == "disk" and isinstance(path, str) and ckpt.local_path
            and not _same_dir(path, ckpt.local_path)):
        return f"serves {info.version} from {path}; the registry has that version at {ckpt.local_path}"
    return None


def reported(info: WeightInfo) -> dict[str, Any]:
    return {"version": info.version, "digest": info.digest, "path": info.extra.get("path"),
            "transport": info.extra.get("transport")}  # fmt: skip


def check_worker(journal: Journal, driver: WorkerDriver, h: WorkerHandle, info: WeightInfo) -> str | None:
    """Compare one worker's report with the registry; on drift move it to UNCERTAIN (once) and
    alert. Returns the drift (or, for a worker already UNCERTAIN, why it still is), else None."""
    if h.state == S.UNCERTAIN:
        return "UNCERTAIN until a known version is re-installed"
    if parse_state(info.state) != S.RUNNING or not info.version:
        return None
    problem = drift(info, journal.checkpoint_by_version(info.version))
    if problem is None:
        return None
    log.error("worker_identity_drift", worker=h.name, drift=problem, reported=reported(info))
    h.observed(S.RUNNING)  # what it reports now; the drift is recorded from there
    driver.move(h, None, S.UNCERTAIN, duration_ms=None, version=info.version, error=f"drift: {problem}",
                detail={"action": "drift", "drift": problem, "reported": reported(info), "alert": True})  # fmt: skip
    return problem


def recover_uncertain(driver: WorkerDriver, handles: Iterable[WorkerHandle], target: Target | None) -> list[str]:
    """Re-install `target` (the serving version) on every UNCERTAIN worker; the names done."""
    done = []
    for h in handles:
        with h.busy:
            if h.state != S.UNCERTAIN:
                continue
            why = "reconcile: its report did not match the registry"
            if driver.recover(h, None, why, target, None):
                done.append(h.name)
    return done
