"""The ipc transport inside the reference worker: the registry entry, swap mode, own-storage guard.

`daemon.worker.updates` registers these three:

* `transport_from_request(body, store)`: builds an `IpcTransport` from the update body's
  `descriptor`, acquires the version at the loader and opens its buffer right away, so a dead
  loader or a bad buffer is a refusal (422) before the worker pauses, never a failed write.
* `swap_in(transport, store, record)`: mode "swap". Takes over the transport's acquisition and
  open buffer as a lease (the update's transport is closed when the update ends; the lease
  lives as long as the record),
  points every parameter's `.data` at the shared buffer, and gives both records a zero-copy
  way back: the new record's `restore` re-points at its views, and the record we came from, if
  its weights live in the worker's own storage, gets a `restore` that re-points at that storage.
  Rollback is therefore a pointer flip in both directions. `record.release` ends the lease.
* `before_copy(store)`: called before every in-place write (copy mode, disk or ipc; restore;
  rollback by re-reading). If a swap left the parameters on a shared buffer, it points them
  back at the worker's own storage first (versions in the loader are immutable), and forgets
  "own storage holds version X" since the write is about to overwrite it.

Swap mode breaks captured CUDA graphs (they keep the old addresses); copy mode is the default.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from daemon.transport.ipc import IpcTransport
from daemon.transport.ipc_descriptor import DescriptorError

if TYPE_CHECKING:
    from daemon.worker.store import VersionRecord, WeightStore


class _Flip:
    """A zero-copy restore: point every parameter at its paired tensor (validated when paired)."""

    def __init__(self, state: _SwapState | None, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.state = state
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = pairs

    def __call__(self) -> None:
        if self.pairs is None:
            raise RuntimeError("the buffers of this version were released")
        for p, t in self.pairs:  # the whole flip: one .data assignment per tensor
            p.data = t
        if self.state is not None:
            self.state.where = self

    def clear(self) -> None:
        self.pairs = None


class _SwapState:
    """Per store: the worker's own storage (captured before the first swap) and where params point now."""

    def __init__(self, store: WeightStore) -> None:
        self.own = _Flip(self, [(p, p.data) for p in store.params.values()])
        self.where: _Flip = self.own


def _state(store: WeightStore) -> _SwapState:
    state = _STATES.get(store)
    if state is None:  # first swap: the parameters are on the worker's own storage
        state = _STATES[store] = _SwapState(store)
    return state


def _pairs(store: WeightStore, views: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    pairs = []
    for name, p in store.params.items():
        t = views[name]
        if p.shape != t.shape or p.dtype != t.dtype or p.device != t.device:
            raise DescriptorError(
                f"tensor {name!r}: cannot point live {p.dtype}{list(p.shape)}@{p.device} "
                f"at {t.dtype}{list(t.shape)}@{t.device}"
            )
        pairs.append((p, t))
    return pairs


_STATES: weakref.WeakKeyDictionary[Any, _SwapState] = weakref.WeakKeyDictionary()
# swap pairs validated when the update's transport is built, before the worker pauses
_PREPARED: weakref.WeakKeyDictionary[IpcTransport, list[tuple[torch.Tensor, torch.Tensor]]] = (
    weakref.WeakKeyDictionary()
)
log = logging.getLogger("hotswap.transport.ipc")

# Ending a lease closes an IPC handle (a device synchronize) and tells the loader: done off the
# update's critical section (a queue put), in order, by one daemon thread.
_leases: queue.SimpleQueue[IpcTransport] = queue.SimpleQueue()
_outstanding = 0
_done = threading.Condition()
_thread: threading.Thread | None = None


def _release_loop() -> None:
    global _outstanding
    while True:
        lease = _leases.get()
        try:
            lease.close()
        except Exception as exc:  # noqa: BLE001 - a release must never take the worker down
            log.warning("releasing %s failed: %s", lease.version, exc)
        with _done:
            _outstanding -= 1
            _done.notify_all()


def _release_later(lease: IpcTransport) -> None:
    global _outstanding, _thread
    with _done:
        _outstanding += 1
        if _thread is None:
            _thread = threading.Thread(target=_release_loop, name="ipc-release", daemon=True)
            _thread.start()
    _leases.put(lease)


def wait_for_releases(timeout: float = 30.0) -> bool:
    """Block until every scheduled lease release has finished (tests, benchmarks, shutdown)."""
    with _done:
        return _done.wait_for(lambda: _outstanding == 0, timeout)


def transport_from_request(body: dict[str, Any], store: WeightStore) -> IpcTransport:
    descriptor = body.get("descriptor")
    if not isinstance(descriptor, dict):
        raise DescriptorError("the ipc transport needs 'descriptor' (the loader's JSON descriptor)")
    transport = IpcTransport(descriptor, device=store.device)
    try:
        transport.prepare()
        if body.get("mode") == "swap" and transport.table().keys() == store.params.keys():
            _PREPARED[transport] = _pairs(store, transport.views())
    except BaseException:
        transport.close()
        raise
    return transport


def swap_in(transport: Any, store: WeightStore, record: VersionRecord) -> None:
    if not isinstance(transport, IpcTransport):
        raise TypeError(f"swap mode needs the ipc transport, got {type(transport).__name__}")
    state = _state(store)
    pairs = _PREPARED.pop(transport, None) or _pairs(store, transport.views())
    lease = transport.detach()  # keeps the version acquired and mapped as long as the record lives
    came_from = state.where
    flip = _Flip(state, pairs)
    try:
        flip()
    except BaseException:
        came_from()
        lease.close()
        raise
    if came_from is state.own and store.current.restore is None:
        store.current.restore = state.own  # the version we came from still sits in own storage
    record.restore = flip

    def release() -> None:
        flip.clear()  # drop our views first, so the buffer can be unmapped when the lease ends
        _release_later(lease)

    record.release = release


def before_copy(store: WeightStore) -> None:
    state = _STATES.get(store)
    if state is None:
        return
    if state.where is not state.own:
        state.own()
    for rec in (store.current, store.previous):
        if rec is not None and rec.restore is state.own:
            rec.restore = None  # own storage is about to be overwritten: re-read that version instead
