"""The worker's adapter admin calls (routes in admin.py), over daemon.worker.lora.

    POST /admin/adapters/load   {name, version, path, expect: {digest, files}}
        -> {name, version, previous_version, ms, probe}   (409: refused, the name keeps what it served)
    POST /admin/adapters/unload {name} -> {name, unloaded: version | null}
    POST /admin/probe           {max_tokens, adapter}: the greedy probe with that adapter applied

A load never pauses anything: the adapter is read and checked beside the serving base, then the
name points at it in one assignment (lora.py). Its probe runs under the store lock like any
step, between two steps of the scheduler.
"""

from __future__ import annotations

import time
from typing import Any

from daemon.transport import BadUpdateRequest, Expect
from daemon.worker.engine import probe
from daemon.worker.lora import AdapterRefused
from daemon.worker.updates import BadRequest, Refused, UpdateError


class Unavailable(UpdateError):
    status = 503


def _str(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{key}' must be a non-empty string")
    return value


def load_adapter(ctl: Any, body: dict[str, Any]) -> dict[str, Any]:
    name, version, path = _str(body, "name"), _str(body, "version"), _str(body, "path")
    try:
        expect = Expect.from_json(body.get("expect"))
    except BadUpdateRequest as exc:
        raise BadRequest(str(exc)) from None
    if ctl.store.unhealthy:
        raise Unavailable(f"worker is unhealthy ({ctl.store.unhealthy})")
    adapters = ctl.engine.adapters
    before = adapters.get(name)
    t0 = time.perf_counter()
    try:
        loaded = adapters.load(name, version, path, expect, served_name=ctl.served_name)
    except AdapterRefused as exc:
        raise Refused(f"adapter {name} {version}: {exc}") from None
    ms = (time.perf_counter() - t0) * 1e3
    try:
        checked = probe(ctl.engine, 4, adapter=loaded)
    except Exception as exc:  # noqa: BLE001 - reported; the daemon's post-check fails on it
        checked = {"finite": False, "error": f"{type(exc).__name__}: {exc}"}
    ctl.event("adapter_loaded", adapter=name, version=version, previous=before.version if before else None,
              ms=round(ms, 3))  # fmt: skip
    return {"name": name, "version": version, "previous_version": before.version if before else None,
            "ms": ms, "probe": checked, "state": ctl.state.value}  # fmt: skip


def unload_adapter(ctl: Any, body: dict[str, Any]) -> dict[str, Any]:
    name = _str(body, "name")
    gone = ctl.engine.adapters.unload(name)
    ctl.event("adapter_unloaded", adapter=name, version=gone.version if gone else None)
    return {"name": name, "unloaded": gone.version if gone else None}


def adapter_probe(ctl: Any, name: str, max_tokens: int) -> dict[str, Any]:
    adapter = ctl.engine.adapters.get(name)
    if adapter is None:
        raise Refused(f"adapter {name!r} is not loaded here (loaded: {', '.join(ctl.engine.adapters.names()) or 'none'})")
    if ctl.store.unhealthy:
        raise Unavailable(f"worker is unhealthy: {ctl.store.unhealthy}")
    return probe(ctl.engine, max_tokens, adapter=adapter)
