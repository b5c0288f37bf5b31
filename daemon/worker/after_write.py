"""After an update that resumed the worker at once (`update?then=resume`, issue 41): judge the probe
run while serving, and when it fails flip back to the retained previous version.

The flip is `updates.rollback`: swap mode points the parameters back at the previous storage (a
pointer flip), copy mode copies the previous version back from its retained record (one copy).
The scheduler is parked for the flip only. A flip that cannot be done leaves the store as
`updates.rollback` does (restored or unhealthy, and then every request fails rather than being
served by the bad weights).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NoReturn

from daemon.worker import updates
from daemon.worker.engine import Engine, probe
from daemon.worker.store import WeightStore


class ProbeRefused(updates.Refused):
    """The probe after resume failed; the previous version is back (flipped) and serving."""


def probe_now(engine: Engine, store: WeightStore) -> dict[str, Any]:
    """The post-update probe, in process: one greedy forward on the fixed probe tokens; an error is
    reported in the answer (the daemon fails the post-check), never raised."""
    t0 = time.perf_counter()
    try:
        out = probe(engine, 1)
    except Exception as exc:  # noqa: BLE001 - reported to the daemon, which fails the post-check
        out = {"weight_version": store.current.version, "finite": False, "error": f"{type(exc).__name__}: {exc}"}
    out["ms"] = (time.perf_counter() - t0) * 1e3
    return out


def probe_failure(probe_out: dict[str, Any], version: str) -> str | None:
    """Why a post-update probe fails (None when it passes): an error, non-finite logits, or
    another version than the one just written."""
    if probe_out.get("error"):
        return str(probe_out["error"])[:200]
    if probe_out.get("finite") is not True:
        return "non-finite logits"
    if probe_out.get("weight_version") != version:
        return f"it ran under version {probe_out.get('weight_version')!r}"
    return None


def flip_back(
    engine: Engine, store: WeightStore, bad: str, why: str, probe_out: dict[str, Any], window_ms: float,
    event: Callable[..., None],
) -> NoReturn:
    """Park the scheduler, roll back to the previous version, resume; always raises: ProbeRefused
    when the previous version serves again, the rollback's UpdateError when it could not."""
    t0 = time.perf_counter()
    engine.pause()
    try:
        back = updates.rollback(store)
    except updates.UpdateError:
        if store.unhealthy:
            engine.fail_all(f"worker unhealthy: {store.unhealthy}")
        else:
            engine.resume()
        raise
    engine.resume()
    flip_ms = (time.perf_counter() - t0) * 1e3
    event("flipped_back", version=back["version"], bad=bad, reason=why, ms=round(flip_ms, 3))
    raise ProbeRefused(f"version {bad} refused: the probe after resume failed ({why}); "
                       f"back on {back['version']} in {flip_ms:.1f} ms",
                       flip_back_ms=flip_ms, probe=probe_out, pause_window_ms=window_ms)  # fmt: skip
