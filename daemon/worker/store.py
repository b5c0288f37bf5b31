"""The one object that owns the served weights and knows which version they are.

`WeightStore` holds

* `params`: safetensors name -> live tensor (the model's own Parameters). Copy-mode transports
  write into these tensors' storage; nothing else may replace them except a swap hook.
* `lock`: held by the scheduler for every generation step and by an update for its whole write
  phase, so no forward pass ever sees a half-written model.
* `current` / `previous`: `VersionRecord`s. `commit(record)` makes `record` current and keeps
  the old current as `previous` (the retained version that `/admin/rollback` returns to).
* `invalidators`: callbacks run after every change of weights (the engine drops its KV caches,
  any prefix cache is cleared); kept sequences are re-prefilled under the new weights.
* `unhealthy`: set when a failed write could not be undone; the worker then refuses traffic.

Hook points for transports (see `daemon.worker.updates`):

* `VersionRecord.request` keeps the update body that produced a version, so the transport
  registry can rebuild a transport for it (restore after a failed write, rollback).
* `VersionRecord.restore`: an optional zero-copy way back to that version (swap mode sets it to
  a pointer flip that re-points `params` at the retained buffers); when set, rollback and
  failure recovery call it instead of re-reading the source.
* `VersionRecord.release`: called when a record is dropped from the store (swap mode frees or
  returns the retained buffers / IPC handles of a version nobody can roll back to any more).
* `release(fn)`: how anything an update opened is let go (a record's release, a transport's
  close). With `defer_releases` (the worker's controller sets it) they are kept until
  `take_deferred()`, which the controller calls once the worker serves again: closing an IPC
  handle (a device synchronize) or a loader round trip never runs inside the pause.

Swap mode lives here, whatever transport leased the tensors: `swap_in(lease, record)` points
every parameter at the lease's tensors (the worker's own storage is remembered at the first
swap), and `prepare_for_copy()`, called before every in-place write, points them back at the
worker's own storage first (a leased buffer is never written) and forgets "own storage holds
version X", since the write is about to overwrite it. Rollback is a pointer flip both ways.
Once no retained version lives in the own storage (two swaps on: current and previous are both
leases), `commit` lets it go: on a GPU it is a whole model that the loader needs for the next
staged version (8B swap mode with two workers then fits an 80 GB card: the loader's serving,
previous and next copies, not those plus each worker's own). A copy-mode write after that
allocates it again, holding the current values, before writing (`own_storage` says which).
Swap mode breaks captured CUDA graphs (they keep the old addresses); copy mode is the default.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from daemon.transport import SwapLease
from daemon.worker.flat import pack_flat


@dataclass(slots=True)
class VersionRecord:
    version: str
    digest: str | None
    transport: str  # "disk", "ipc", ...
    path: str | None = None  # disk: checkpoint directory
    mode: str = "copy"
    request: dict[str, Any] = field(default_factory=dict)  # the update body that produced it
    loaded_at: float = field(default_factory=time.time)
    restore: Callable[[], None] | None = None  # zero-copy way back (swap mode)
    release: Callable[[], None] | None = None  # free what this version retains

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "digest": self.digest, "transport": self.transport,
                "path": self.path, "mode": self.mode, "loaded_at": self.loaded_at}


class _Flip:
    """A zero-copy restore: point every parameter at its paired tensor (validated when paired)."""

    def __init__(self, store: WeightStore, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.store = store
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = pairs

    def __call__(self) -> None:
        if self.pairs is None:
            raise RuntimeError("the buffers of this version were released")
        for p, t in self.pairs:  # the whole flip: one .data assignment per tensor
            p.data = t
        self.store._pointing_at = self

    def clear(self) -> None:
        self.pairs = None


class WeightStore:
    def __init__(self, params: dict[str, torch.Tensor], device: torch.device, current: VersionRecord) -> None:
        self.params = params
        self.device = device
        self.lock = threading.RLock()
        self.current: VersionRecord = current
        self.previous: VersionRecord | None = None
        self.update_count = 0
        self.unhealthy: str | None = None  # reason, when the weights are not a whole version
        self.invalidators: list[Callable[[], None]] = []
        self.last_update: dict[str, Any] = {}
        self._own: _Flip | None = None  # the worker's own storage, captured at the first swap
        self._own_released = False  # let go in swap mode: allocated again before a copy-mode write
        self._own_order: list[str] | None = None  # names by offset in the flat buffer, when packed
        self._own_refs: list[StorageWeakRef] = []  # the released own storage, to observe that it went
        self._own_drop: Callable[[], None] | None = None  # its release (run after the others)
        self._pointing_at: _Flip | None = None  # where the parameters point now (None: never swapped)
        self.defer_releases = False  # True: `release` keeps closers until `take_deferred`
        self._deferred: list[Callable[[], None]] = []
        self._deferred_lock = threading.Lock()
        self.flat: torch.Tensor | None = None  # the one buffer every parameter is a view of, when packed
        self.stage_disk = "auto"  # disk updates read ahead before the pause: auto (CUDA) | on | off

    # -- facts -------------------------------------------------------------------------------
    @property
    def tensors(self) -> int:
        return len(self.params)

    @property
    def bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in self.params.values():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def data_ptrs(self) -> dict[str, int]:
        return {n: t.data_ptr() for n, t in self.params.items()}

    # -- changes (call with `lock` held) -----------------------------------------------------
    def commit(self, record: VersionRecord) -> None:
        """`record` is now served; the old current becomes the retained previous version."""
        dropped = self.previous
        self.previous = self.current
        self.current = record
        self.update_count += 1
        self.unhealthy = None
        if dropped is not None and dropped.release is not None and dropped is not self.current:
            self.release(dropped.release)
        self._release_own_if_unused()

    def release(self, fn: Callable[[], None]) -> None:
        """Let go of something an update opened: now, or with `defer_releases` once serving again."""
        if not self.defer_releases:
            fn()
            return
        with self._deferred_lock:
            self._deferred.append(fn)

    def take_deferred(self) -> list[Callable[[], None]]:
        """The releases kept since the last call, in order (the caller runs them); the own storage's
        last: its memory goes back to the device only once the transports closed before it, which
        held the flat buffer, are gone too."""
        with self._deferred_lock:
            fns, self._deferred = self._deferred, []
        return [f for f in fns if f is not self._own_drop] + [f for f in fns if f is self._own_drop]

    def swap_current_and_previous(self) -> None:
        """After a rollback: the version we came from becomes the retained one."""
        if self.previous is None:
            raise RuntimeError("no previous version retained")
        self.previous, self.current = self.current, self.previous
        self.update_count += 1
        self.unhealthy = None

    def invalidate_caches(self) -> None:
        for fn in self.invalidators:
            fn()

    # -- swap mode (call with `lock` held) ---------------------------------------------------
    def swap_in(self, lease: SwapLease, record: VersionRecord) -> None:
        """Point every parameter at the lease's tensors; `record` gets the flip back and the release."""
        if self._own is None and not self._own_released:  # first swap: the parameters are on own storage
            self._own = _Flip(self, [(p, p.data) for p in self.params.values()])
            if self.flat is not None:
                self._own_order = sorted(self.params, key=lambda n: self.params[n].data_ptr())
            self._pointing_at = self._own
        came_from = self._pointing_at
        flip = _Flip(self, lease.pairs)
        try:
            flip()
        except BaseException:
            if came_from is not None:
                came_from()
            lease.release()
            raise
        if came_from is self._own and self.current.restore is None:
            self.current.restore = self._own  # the version we came from still sits in own storage
        record.restore = flip

        def release() -> None:
            flip.clear()  # drop our views first, so the buffer can be unmapped when the lease ends
            lease.release()

        record.release = release

    @property
    def own_storage(self) -> str:
        """"own" (never swapped, or own storage kept); "released" once swap mode let it go and its
        memory really went (observed: no tensor anywhere refers to it); "releasing" until then."""
        if not self._own_released:
            return "own"
        return "released" if all(ref.expired() for ref in self._own_refs) else "releasing"

    def _release_own_if_unused(self) -> None:
        own = self._own
        if own is None or self._pointing_at is own:
            return
        if any(rec is not None and rec.restore is own for rec in (self.current, self.previous)):
            return  # a rollback flips back to it
        held: list[Any] = [own, self.flat]  # the last references, dropped after resume
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for _p, t in own.pairs or ()}
        self._own_refs = [StorageWeakRef(st) for st in storages.values()]
        self._own, self._own_released, self.flat = None, True, None

        def drop() -> None:
            own.clear()
            held.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # back to the driver: the loader allocates the next version there

        self._own_drop = drop
        self.release(drop)

    def _own_again(self) -> _Flip:
        """Own storage allocated again, holding the current values (a write need not cover every tensor)."""
        with torch.no_grad():
            if self._own_order is not None:
                self.flat = pack_flat(self.params, self._own_order)
            else:
                for p in self.params.values():
                    p.data = p.data.clone()
        self._own_released = False
        return _Flip(self, [(p, p.data) for p in self.params.values()])

    def prepare_for_copy(self) -> None:
        """Before writing in place: back onto own storage, which no longer holds its old version."""
        if self._own_released:  # allocate it again (an out-of-memory error fails the write, restored)
            self._own = self._pointing_at = self._own_again()
            return
        if self._own is None:
            return
        if self._pointing_at is not self._own:
            self._own()
        for rec in (self.current, self.previous):
            if rec is not None and rec.restore is self._own:
                rec.restore = None
