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
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from daemon.transport.ipc import IpcTransport, point_params_at
from daemon.transport.ipc_descriptor import DescriptorError

if TYPE_CHECKING:
    from daemon.worker.store import VersionRecord, WeightStore


class _Flip:
    """A record's zero-copy restore: point the store's parameters at `targets`."""

    def __init__(self, store: WeightStore, targets: dict[str, torch.Tensor]) -> None:
        self._store = weakref.ref(store)
        self.targets: dict[str, torch.Tensor] | None = targets

    def __call__(self) -> None:
        store = self._store()
        if store is None or self.targets is None:
            raise RuntimeError("the buffers of this version were released")
        point_params_at(store.params, self.targets)

    def clear(self) -> None:
        self.targets = None


@dataclass(eq=False)
class _SwapState:
    own: _Flip  # the worker's own parameter storage, captured before the first swap

    def on_own(self, store: WeightStore) -> bool:
        assert self.own.targets is not None
        return all(p.data_ptr() == self.own.targets[n].data_ptr() for n, p in store.params.items())


_STATES: weakref.WeakKeyDictionary[Any, _SwapState] = weakref.WeakKeyDictionary()
log = logging.getLogger("hotswap.transport.ipc")

# Ending a lease closes an IPC handle (a device synchronize) and tells the loader: done off the
# update's critical section, in order, by one thread.
_releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ipc-release")
_pending: set[Future[None]] = set()
_pending_lock = threading.Lock()


def _release_later(lease: IpcTransport) -> None:
    def run() -> None:
        try:
            lease.close()
        except Exception as exc:  # noqa: BLE001 - a release must never take the worker down
            log.warning("releasing %s failed: %s", lease.version, exc)

    fut = _releaser.submit(run)
    with _pending_lock:
        _pending.add(fut)
    fut.add_done_callback(lambda f: _discard(f))


def _discard(fut: Future[None]) -> None:
    with _pending_lock:
        _pending.discard(fut)


def wait_for_releases(timeout: float = 30.0) -> bool:
    """Block until every scheduled lease release has finished (tests, benchmarks, shutdown)."""
    with _pending_lock:
        futures = list(_pending)
    for f in futures:
        f.result(timeout=timeout)
    return True


def transport_from_request(body: dict[str, Any], store: WeightStore) -> IpcTransport:
    descriptor = body.get("descriptor")
    if not isinstance(descriptor, dict):
        raise DescriptorError("the ipc transport needs 'descriptor' (the loader's JSON descriptor)")
    transport = IpcTransport(descriptor, device=store.device)
    try:
        transport.prepare()
    except BaseException:
        transport.close()
        raise
    return transport


def swap_in(transport: Any, store: WeightStore, record: VersionRecord) -> None:
    if not isinstance(transport, IpcTransport):
        raise TypeError(f"swap mode needs the ipc transport, got {type(transport).__name__}")
    state = _STATES.get(store)
    if state is None:  # first swap: the parameters are on the worker's own storage
        state = _STATES[store] = _SwapState(_Flip(store, {n: p.data for n, p in store.params.items()}))
    was_on_own = state.on_own(store)
    lease = transport.detach()  # keeps the version acquired and mapped as long as the record lives
    try:
        views = lease.views()
        point_params_at(store.params, views)
    except BaseException:
        lease.close()
        raise
    if was_on_own and store.current.restore is None:
        store.current.restore = state.own  # the version we came from still sits in own storage
    flip = _Flip(store, views)
    record.restore = flip

    def release() -> None:
        flip.clear()  # drop our views first, so the buffer can be unmapped when the lease ends
        _release_later(lease)

    record.release = release


def before_copy(store: WeightStore) -> None:
    state = _STATES.get(store)
    if state is None:
        return
    if not state.on_own(store):
        state.own()
    for rec in (store.current, store.previous):
        if rec is not None and rec.restore is state.own:
            rec.restore = None  # own storage is about to be overwritten: re-read that version instead
