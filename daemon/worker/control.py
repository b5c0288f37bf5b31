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
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any

from daemon.worker import updates
from daemon.worker.engine import Engine, probe
from daemon.worker.model import LoadedModel
from daemon.worker.store import WeightStore

log = logging.getLogger("hotswap.worker.control")


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
    ) -> None:
        self.loaded = loaded
        self.before_write = tuple(before_write)  # test seam (tests/hooked_worker.py); empty in production
        self.store = store
        self.engine = engine
        self.model_dir = model_dir
        self._state = WorkerState.RUNNING
        self._hold: str | None = None  # in UPDATED: "pause" or "drain", what still holds traffic
        self._admin = threading.Lock()  # one admin transition at a time
        self._counters = threading.Lock()
        self.requests_total = 0
        self.requests_failed = 0

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
        cur, prev = self.store.current, self.store.previous
        return {
            "version": cur.version,
            "digest": cur.digest,
            "state": self.state.value,
            "in_flight": self.engine.in_flight,
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
            "unhealthy_reason": self.store.unhealthy,
            "model_dir": self.model_dir,
            "last_update": self.store.last_update,
        }

    # -- transitions -------------------------------------------------------------------------
    def drain(self, timeout_s: float) -> dict[str, Any]:
        with self._admin:
            state = self.state
            if state not in (WorkerState.RUNNING, WorkerState.DRAINING):
                raise StateConflict(f"cannot drain in state {state.value}")
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
            return {"state": self.state.value, "mode": mode, "finished": finished,
                    "in_flight": self.engine.in_flight, "kept": self.engine.active}

    def resume(self) -> dict[str, Any]:
        with self._admin:
            if self.state is WorkerState.UNHEALTHY:
                raise Unavailable(f"worker is unhealthy ({self.store.unhealthy}); roll back or restart it")
            self._state = WorkerState.RUNNING
            self._hold = None
            self.engine.resume()
            return {"state": self.state.value, "version": self.store.current.version}

    def update(self, raw: Any) -> dict[str, Any]:
        request = updates.parse_request(raw)
        with self._admin:
            return self._while_quiet(lambda: updates.apply_update(self.store, request, before_write=self.before_write))

    def rollback(self) -> dict[str, Any]:
        with self._admin:
            if self.state is WorkerState.UNHEALTHY:
                result = updates.rollback(self.store)  # restores the last good version
                self._state, self._hold = WorkerState.RUNNING, None
                self.engine.resume()
                result["state"] = self.state.value
                return result
            return self._while_quiet(lambda: updates.rollback(self.store))

    def probe(self, max_tokens: int = 4) -> dict[str, Any]:
        if self.state is WorkerState.UNHEALTHY:
            raise Unavailable(f"worker is unhealthy: {self.store.unhealthy}")
        return probe(self.engine, max_tokens)

    # -- helpers -----------------------------------------------------------------------------
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
            raise
        if from_running:
            self.engine.resume()
        else:
            if state in (WorkerState.PAUSED, WorkerState.DRAINING):
                self._hold = "pause" if state is WorkerState.PAUSED else "drain"
            self._state = WorkerState.UPDATED
        result["state"] = self.state.value
        return result
