"""Swap mode's own storage: kept while a retained version lives there, let go once none does, and
allocated again (holding the current values) before a copy-mode write."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from daemon.transport import SwapLease
from daemon.worker.flat import pack_flat
from daemon.worker.store import VersionRecord, WeightStore

pytestmark = pytest.mark.quick


def make_store(packed: bool) -> WeightStore:
    params = {n: torch.nn.Parameter(torch.full((64,), float(i)), requires_grad=False)
              for i, n in enumerate(("embed", "layer.0", "layer.1", "head"))}  # fmt: skip
    store = WeightStore(params, torch.device("cpu"), VersionRecord("v1", None, "disk"))
    if packed:
        store.flat = pack_flat(params, sorted(params))
    return store


def swap(store: WeightStore, version: str, value: float) -> dict[str, torch.Tensor]:
    """`version` swapped in from a lease whose tensors all hold `value`; returns the leased tensors."""
    views = {n: torch.full_like(p.data, value) for n, p in store.params.items()}
    record = VersionRecord(version, None, "ipc", mode="swap")
    with store.lock:
        store.swap_in(SwapLease([(p, views[n]) for n, p in store.params.items()], lambda: None), record)
        store.commit(record)
    return views


def values(store: WeightStore) -> set[float]:
    return {float(v) for p in store.params.values() for v in p.data.unique()}


@pytest.mark.parametrize("packed", [True, False])
def test_own_storage_is_let_go_once_no_retained_version_lives_there(packed: bool) -> None:
    store = make_store(packed)
    own = weakref.ref(store.flat) if packed else None
    swap(store, "v2", 2.0)
    assert store.own_storage == "own"  # v1 lives there: a rollback flips back to it
    assert store.current.version == "v2" and store.previous is not None and store.previous.restore is not None
    assert store._own is not None
    own_tensor = weakref.ref(store._own.pairs[0][1])
    swap(store, "v3", 3.0)  # now current and previous are leases: nothing restores to own storage
    assert store.own_storage == "released" and store.flat is None
    gc.collect()
    assert own_tensor() is None, "the worker's own storage is still referenced"
    if own is not None:
        assert own() is None, "the flat buffer is still referenced"
    assert values(store) == {3.0}
    assert store.previous is not None and store.previous.restore is not None
    store.previous.restore()  # a rollback between leases still flips
    assert values(store) == {2.0}


@pytest.mark.parametrize("packed", [True, False])
def test_a_copy_after_the_release_writes_new_own_storage_never_the_lease(packed: bool) -> None:
    store = make_store(packed)
    swap(store, "v2", 2.0)
    v3 = swap(store, "v3", 3.0)
    assert store.own_storage == "released"
    leased = {n: p.data_ptr() for n, p in store.params.items()}
    with store.lock:
        store.prepare_for_copy()
        assert store.own_storage == "own" and values(store) == {3.0}  # the current values, copied
        assert all(p.data_ptr() != leased[n] for n, p in store.params.items())
        if packed:
            assert store.flat is not None
            base = store.flat.data_ptr()
            assert all(base <= p.data_ptr() < base + store.flat.numel() for p in store.params.values())
        for p in store.params.values():  # the write (a copy-mode transport writes in place)
            p.data.fill_(4.0)
        store.commit(VersionRecord("v4", None, "disk"))
    assert values(store) == {4.0} and all(torch.equal(t, torch.full_like(t, 3.0)) for t in v3.values())
    assert store.previous is not None and store.previous.version == "v3" and store.previous.restore is not None
    store.previous.restore()  # back to the v3 lease: a flip, its bytes untouched
    assert values(store) == {3.0}


def test_the_own_storage_is_kept_while_a_rollback_returns_to_it() -> None:
    store = make_store(packed=True)
    swap(store, "v2", 2.0)
    with store.lock:
        assert store.previous is not None and store.previous.restore is not None
        store.previous.restore()  # back onto own storage (v1)
        store.swap_current_and_previous()
    swap(store, "v3", 3.0)  # previous is v1, in own storage: kept
    assert store.own_storage == "own" and store.flat is not None


def test_released_is_observed_a_stray_reference_keeps_it_releasing() -> None:
    """"released" means the memory went: a reference held anywhere (once: the worker's start-up
    kept the flat buffer in a local variable for its whole life) shows as "releasing"."""
    store = make_store(packed=True)
    swap(store, "v2", 2.0)
    stray = store.flat
    swap(store, "v3", 3.0)
    assert store.own_storage == "releasing"
    del stray
    gc.collect()
    assert store.own_storage == "released"


def test_the_own_storage_goes_after_the_releases_queued_with_it() -> None:
    """The update's transport is closed after the commit (after resume, with the others): it held
    the flat buffer, so the own storage's release runs last, or on a GPU its memory would stay in
    the worker's allocator cache instead of going back to the device for the loader (seen on an H100)."""
    store = make_store(packed=True)
    store.defer_releases = True
    swap(store, "v2", 2.0)
    for fn in store.take_deferred():
        fn()
    transport_flat = [store.flat]  # what a transport opened before this update holds

    swap(store, "v3", 3.0)  # queues the own storage's release
    store.release(transport_flat.clear)  # then the update's transport is closed, as apply_update does
    fns = store.take_deferred()
    for fn in fns[:-1]:
        fn()
    assert not transport_flat and store.own_storage == "releasing"  # the transport closed first
    fns[-1]()
    gc.collect()
    assert store.own_storage == "released"
