"""The worker's state machine: RUNNING, DRAINING, PAUSED, UPDATED, UNHEALTHY.

    RUNNING --drain--> DRAINING   readiness off, new completions 503, in-flight finish (bounded wait)
    RUNNING --pause--> PAUSED     scheduler parked between steps; new requests queue (keep: kept,
                                  wait: active ones finish first)
    DRAINING/PAUSED/UPDATED --update or rollback ok--> UPDATED   (what held traffic keeps holding it)
    any --resume--> RUNNING       (not from UNHEALTHY)
    any --write failed, restore failed--> UNHEALTHY   /health 503, traffic refused, requests failed
    UNHEALTHY --rollback (restore of the last good version) ok--> RUNNING

An update (or rollback) straight from RUNNING is allowed only when it is idle-safe: the
scheduler is parked first, and if a sequence is active the call is refused with 409 (pause or
drain first); otherwise the write happens with the scheduler parked, and the worker goes back
to RUNNING by itself (queued requests then start on the new weights). A write that fails and
is undone leaves the state where it was.

Keeping the pause short (issue 15): `prepare(body)` (while RUNNING, called by the daemon before
it pauses) opens and validates the transport of exactly that update body; the `update` with the
same body then only writes. After the write, still paused, `update` runs the post-update probe
itself (one greedy forward on the fixed probe tokens, logits checked finite) and returns it as
`probe`, so the daemon needs no generation round trip while requests are held. What an update
opened (IPC handles, loader acquisitions, leases of dropped versions) is let go after `resume`,
on a background thread, never inside the pause. `events` records each step with the state it
ran in (prepared, paused, updated, resumed, released), for tests and operators. `update(body,
resume_after=True)` (`?then=resume`, issue 41): from PAUSED or DRAINING, write, resume at once
(`pause_window_ms`), then probe serving; a failed probe flips back (daemon.worker.after_write).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any

from daemon.transport import StagesAhead, TransportError, UpdateRequest
from daemon.worker import updates
from daemon.worker.after_write import flip_back, probe_failure, probe_now
from daemon.worker.engine import Engine, probe
from daemon.worker.map_ahead import MappedAhead
from daemon.worker.model import LoadedModel
from daemon.worker.read_ahead import ReadAhead
from daemon.worker.store import WeightStore

log = logging.getLogger("hotswap.worker.control")

# transports whose open (and validation) may run ahead of the pause; broadcast's open is a
# collective vote with the trainer's ranks, so it stays inside the update
PREPARABLE = ("disk", "ipc")
# A preparation no update took within this long is let go (checked on each weight_info): the
# daemon prepares later workers while the first ones update, and a rollout that stops early
# (a failure, newer work) leaves theirs unused.
PREPARED_TTL_S = 120.0


class WorkerState(StrEnum):
    RUNNING = "RUNNING"
    DRAINING = "DRAINING"
    PAUSED = "PAUSED"
    UPDATED = "UPDATED"
    UNHEALTHY = "UNHEALTHY"


class StateConflict(updates.UpdateError):
    status = 409


class Unavailable(updates.UpdateError):
    status = 503


class Controller:
    def __init__(
        self,
        loaded: LoadedModel,
        store: WeightStore,
        engine: Engine,
        *,
        model_dir: str,
        before_write: Sequence[updates.BeforeWrite] = (),
        prepared_ttl_s: float = PREPARED_TTL_S,
    ) -> None:
        self.loaded = loaded
        self.served_name = ""  # what clients send as `model` for the base (set by server.build_worker)
        self.before_write = tuple(before_write)  # test seam (tests/hooked_worker.py); empty in production
        self.store = store
        self.engine = engine
        self.model_dir = model_dir
        self._state = WorkerState.RUNNING
        self._hold: str | None = None  # in UPDATED: "pause" or "drain", what still holds traffic
        self._drain_began = 0.0  # time.monotonic() when the last drain from RUNNING began
        self._admin = threading.Lock()  # one admin transition at a time
        self._counters = threading.Lock()
        self.requests_total = 0
        self.requests_failed = 0
        self.events: deque[dict[str, Any]] = deque(maxlen=64)
        self._events_lock = threading.Lock()  # appended from the releaser thread, read by weight_info
        self._prepared: tuple[str, updates.Opened] | None = None
        self._prepared_at = 0.0  # time.monotonic() of the preparation held
        self.prepared_ttl_s = prepared_ttl_s
        self._prepare_lock = threading.Lock()
        self.mapped_ahead = MappedAhead(store.device, self.event)  # a loader buffer opened before its update
        self.disk_ahead = ReadAhead(store, self.event)  # a disk version read while the daemon verifies it
        store.defer_releases = True  # closing what an update opened waits until serving again
        self._releases: queue.SimpleQueue[list[Callable[[], None]]] = queue.SimpleQueue()
        self._releaser: threading.Thread | None = None

    # -- facts -------------------------------------------------------------------------------
    @property
    def state(self) -> WorkerState:
        return WorkerState.UNHEALTHY if self.store.unhealthy else self._state

    def ready(self) -> bool:
        return self.state is WorkerState.RUNNING

    def accepting(self) -> str | None:
        """None when a new completion may be queued, else the reason it is refused (503)."""
        state = self.state
        if state is WorkerState.UNHEALTHY:
            return f"worker is unhealthy: {self.store.unhealthy}"
        if state is WorkerState.DRAINING or (state is WorkerState.UPDATED and self._hold == "drain"):
            return "worker is draining for a weight update"
        return None

    def count(self, *, failed: bool = False) -> None:
        with self._counters:
            if failed:
                self.requests_failed += 1
            else:
                self.requests_total += 1

    def weight_info(self) -> dict[str, Any]:
        self._expire_prepared()  # asked every few seconds by the daemon's health poll
        self.mapped_ahead.expire()
        self.disk_ahead.expire()
        cur, prev = self.store.current, self.store.previous
        return {
            "version": cur.version,
            "digest": cur.digest,
            "state": self.state.value,
            "in_flight": self.engine.in_flight,
            "steps": self.engine.steps,  # scheduler steps run, and wake-ups it stayed paused through
            "wakeups_paused": self.engine.wakeups_paused,
            "tensors": self.store.tensors,
            "bytes": self.store.bytes,
            "device": str(self.loaded.device),
            "update_count": self.store.update_count,
            "requests_total": self.requests_total,
            "requests_failed": self.requests_failed,
            "previous_version": prev.version if prev else None,
            "transport": cur.transport,
            "path": cur.path,
            "paused": self.engine.paused,
            # changes only if a parameter was reallocated (in-place updates keep it)
            "storage_id": hashlib.sha1(repr(sorted(self.store.data_ptrs().items())).encode()).hexdigest()[:16],
            "own_storage": self.store.own_storage,  # "released": swap mode let the worker's own copy go
            "unhealthy_reason": self.store.unhealthy,
            "model_dir": self.model_dir,
            "last_update": self.store.last_update,
            "prepared_version": self._prepared_version(),
            "mapped_ahead": self.mapped_ahead.version(),
            "read_ahead": self.disk_ahead.version(),
            "events": self.recent_events(),
            "adapters": self.engine.adapters.info(),  # LoRA adapters served by name (lora.py)
            "adapter_requests": self.engine.adapters.counters(),
        }

    def map_ahead(self, raw: Any) -> dict[str, Any]:
        """Open a version's loader buffer ahead of its update (daemon.worker.map_ahead); answers at once."""
        version, loader = updates.parse_map_ahead(raw)
        self.mapped_ahead.want(version, loader)
        return {"version": version, "state": self.state.value}

    def read_ahead(self, raw: Any) -> dict[str, Any]:
        """Read a disk version ahead of its verification (daemon.worker.read_ahead); answers at once."""
        version, path, alg, reserve = updates.parse_read_ahead(raw)
        self.disk_ahead.want(version, path, alg, reserve)
        return {"version": version, "state": self.state.value}

    def _prepared_version(self) -> str | None:
        held = self._prepared
        return None if held is None else json.loads(held[0]).get("version")

    def event(self, name: str, **detail: Any) -> None:
        with self._events_lock:
            self.events.append({"event": name, "at": time.time(), "state": self.state.value, **detail})

    def recent_events(self) -> list[dict[str, Any]]:
        with self._events_lock:
            return list(self.events)

    # -- transitions -------------------------------------------------------------------------
    def drain(self, timeout_s: float) -> dict[str, Any]:
        with self._admin:
            state = self.state
            if state not in (WorkerState.RUNNING, WorkerState.DRAINING):
                raise StateConflict(f"cannot drain in state {state.value}")
            if state is WorkerState.RUNNING:
                self._drain_began = time.monotonic()
            self._state = WorkerState.DRAINING
            drained = self.engine.wait_idle(max(0.0, timeout_s))
            return {"state": self.state.value, "drained": drained, "in_flight": self.engine.in_flight}

    def pause(self, mode: str, timeout_s: float) -> dict[str, Any]:
        if mode not in ("keep", "wait"):
            raise updates.BadRequest(f"pause mode must be 'keep' or 'wait', not {mode!r}")
        with self._admin:
            state = self.state
            if state not in (WorkerState.RUNNING, WorkerState.PAUSED):
                raise StateConflict(f"cannot pause in state {state.value}")
            finished = self.engine.pause(wait=mode == "wait", timeout_s=max(0.0, timeout_s))
            self._state = WorkerState.PAUSED
            self.event("paused", mode=mode)
            return {"state": self.state.value, "mode": mode, "finished": finished,
                    "in_flight": self.engine.in_flight, "kept": self.engine.active}

    def resume(self) -> dict[str, Any]:
        with self._admin:
            if self.state is WorkerState.UNHEALTHY:
                raise Unavailable(f"worker is unhealthy ({self.store.unhealthy}); roll back or restart it")
            self._state = WorkerState.RUNNING
            self._hold = None
            self.engine.resume()
            self.event("resumed")
            self._release_deferred()
            return {"state": self.state.value, "version": self.store.current.version}

    def prepare(self, raw: Any) -> dict[str, Any]:
        """Open and validate the transport of update body `raw` now (before the pause); the next
        `update` with the same body uses it. Replaces (and lets go of) any earlier preparation.
        Refusals are the update's own (422/409), and leave nothing open."""
        request = updates.parse_request(raw)
        if self.state is WorkerState.UNHEALTHY:
            raise Unavailable(f"worker is unhealthy ({self.store.unhealthy}); roll back or restart it")
        if request.transport not in PREPARABLE:  # e.g. broadcast: opening it is a collective step
            return {"version": request.version, "prepared": False, "state": self.state.value,
                    "reason": f"transport {request.transport!r} is opened by the update itself"}  # fmt: skip
        self._drop_prepared()
        opened = self.disk_ahead.take(request) or self._open_ahead(request)
        self.mapped_ahead.taken(request.version)  # the transport holds its own reference now
        with self._prepare_lock:
            old, self._prepared = self._prepared, (_key(request), opened)
            self._prepared_at = time.monotonic()
        if old is not None:
            old[1].close(self.store)
        self.event("prepared", version=request.version, transport=request.transport, mode=request.mode,
                   open_ms=round(opened.open_ms, 3))  # fmt: skip
        if self.state is WorkerState.RUNNING:
            self._release_deferred()
        return {"version": request.version, "prepared": True, "open_ms": opened.open_ms, "state": self.state.value}

    def _open_ahead(self, request: UpdateRequest) -> updates.Opened:
        """Open and validate `request`'s source, and read a disk copy ahead into a buffer of its own."""
        opened = updates.open_and_validate(request, self.store)
        if request.mode == "copy" and isinstance(opened.transport, StagesAhead):
            t0 = time.perf_counter()
            try:  # read and check the whole version now, into a buffer of its own
                opened.transport.stage(self.store.params)
            except (TransportError, OSError, ValueError) as exc:
                opened.close(self.store)
                raise updates.BadRequest(f"cannot read the new weights ahead of the pause: {exc}") from None
            opened.open_ms += (time.perf_counter() - t0) * 1e3
        return opened

    def update(self, raw: Any, *, resume_after: bool = False) -> dict[str, Any]:
        """Write body `raw`'s version and probe it; `resume_after`: see the module docstring."""
        request = updates.parse_request(raw)
        prepared = self._take_prepared(request)
        used = False

        def change() -> dict[str, Any]:
            nonlocal used
            used = True
            result = updates.apply_update(self.store, request, before_write=self.before_write, prepared=prepared)
            self.mapped_ahead.taken(request.version)
            if not resume_after:
                result["probe"] = probe_now(self.engine, self.store)
            self.event("updated", version=request.version, prepared=prepared is not None,
                       write_ms=round(float(result.get("write_ms", 0.0)), 3))  # fmt: skip
            return result

        try:
            with self._admin:
                if resume_after and self.state not in (WorkerState.PAUSED, WorkerState.DRAINING):
                    raise StateConflict(f"update then resume needs a paused or draining worker, not {self.state.value}")
                result = self._while_quiet(change)
                return self._resume_and_probe(request, result) if resume_after else result
        finally:
            if prepared is not None and not used:
                prepared.close(self.store)

    def _resume_and_probe(self, request: UpdateRequest, result: dict[str, Any]) -> dict[str, Any]:
        """Resume right after the write (caller holds `_admin`), probe serving, flip back if it fails."""
        drained, eng = self._hold == "drain", self.engine
        self._state, self._hold = WorkerState.RUNNING, None
        eng.resume()
        # drain: readiness off since the drain began; pause: asked -> scheduler running again
        window_ms = max(0.0, (time.monotonic() - self._drain_began if drained else eng.resumed_at - eng.asked_at) * 1e3)
        result["pause_wait_ms"] = max(0.0, (eng.parked_at - eng.asked_at) * 1e3)  # of which: the forward in flight
        self.event("resumed", after="update", pause_window_ms=round(window_ms, 3))
        result["pause_window_ms"] = window_ms
        probe_out = probe_now(self.engine, self.store)
        result["probe"] = probe_out
        why = probe_failure(probe_out, request.version)
        if why is None:
            self._release_deferred()
            result["state"] = self.state.value
            return result
        try:
            flip_back(self.engine, self.store, request.version, why, probe_out, window_ms, self.event)
        finally:
            self._release_deferred()

    def rollback(self) -> dict[str, Any]:
        with self._admin:
            if self.state is WorkerState.UNHEALTHY:
                result = updates.rollback(self.store)  # restores the last good version
                self._state, self._hold = WorkerState.RUNNING, None
                self.engine.resume()
                self._release_deferred()
                result["state"] = self.state.value
                return result
            return self._while_quiet(lambda: updates.rollback(self.store))

    def probe(self, max_tokens: int = 4) -> dict[str, Any]:
        if self.state is WorkerState.UNHEALTHY:
            raise Unavailable(f"worker is unhealthy: {self.store.unhealthy}")
        return probe(self.engine, max_tokens)

    # -- helpers -----------------------------------------------------------------------------
    def _take_prepared(self, request: UpdateRequest) -> updates.Opened | None:
        """The preparation of exactly this request, taken out of its slot; any other one is let go."""
        with self._prepare_lock:
            held, self._prepared = self._prepared, None
        if held is not None and held[0] == _key(request):
            return held[1]
        if held is not None:
            held[1].close(self.store)
        return self.disk_ahead.take(request)

    def _expire_prepared(self) -> None:
        """Let go of a preparation no update used within `prepared_ttl_s` (its rollout stopped
        before this worker's turn): an open IPC handle or a read-ahead buffer is not kept forever."""
        with self._prepare_lock:
            held = self._prepared
            if held is None or time.monotonic() - self._prepared_at < self.prepared_ttl_s:
                return
            self._prepared = None
        held[1].close(self.store)
        self.event("prepare_expired", version=json.loads(held[0]).get("version"), ttl_s=self.prepared_ttl_s)
        if self.state is WorkerState.RUNNING:
            self._release_deferred()

    def _drop_prepared(self) -> None:
        with self._prepare_lock:
            held, self._prepared = self._prepared, None
        if held is not None:
            held[1].close(self.store)

    def _release_deferred(self) -> None:
        """Run what the store kept to release, on the releaser thread (the worker serves meanwhile)."""
        fns = self.store.take_deferred()
        if not fns:
            return
        if self._releaser is None:
            self._releaser = threading.Thread(target=self._release_loop, name="hotswap-release", daemon=True)
            self._releaser.start()
        self._releases.put(fns)

    def _release_loop(self) -> None:
        while True:
            self._run_releases(self._releases.get())

    def _run_releases(self, fns: list[Callable[[], None]]) -> None:
        """Run and forget each release (no reference to what it held may outlive it: a view keeps
        a mapping alive)."""
        t0 = time.perf_counter()
        count, failed = len(fns), 0
        while fns:
            try:
                fns.pop(0)()
            except Exception as exc:  # noqa: BLE001 - a release must never take the worker down
                failed += 1
                log.warning("release after resume failed: %s", exc)
        self.event("released", count=count, failed=failed, ms=round((time.perf_counter() - t0) * 1e3, 3))

    def _while_quiet(self, change: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run a weight change in a state that allows it; set the state after it."""
        state = self.state
        if state is WorkerState.UNHEALTHY:
            raise Unavailable(f"worker is unhealthy ({self.store.unhealthy}); roll back or restart it")
        from_running = state is WorkerState.RUNNING
        if from_running:
            self.engine.pause()
            if self.engine.active:
                n = self.engine.active
                self.engine.resume()
                raise StateConflict(
                    f"worker is RUNNING with {n} request(s) in progress: pause or drain it before updating"
                )
        try:
            result = change()
        except updates.UpdateError:
            if self.store.unhealthy:
                self.engine.fail_all(f"worker unhealthy: {self.store.unhealthy}")
            elif from_running:
                self.engine.resume()
                self._release_deferred()
            raise
        if from_running:
            self.engine.resume()
            self._release_deferred()
        else:
            if state in (WorkerState.PAUSED, WorkerState.DRAINING):
                self._hold = "pause" if state is WorkerState.PAUSED else "drain"
            self._state = WorkerState.UPDATED
        result["state"] = self.state.value
        return result


def _key(request: UpdateRequest) -> str:
    """An update body in one canonical spelling: a preparation serves exactly the same body."""
    return json.dumps(request.to_json(), sort_keys=True, separators=(",", ":"))
