"""The ipc transport's worker side: weights from a loader's staged buffer, by copy or by pointer swap.

The daemon side (`daemon.transport.ipc_stage`) stages the version in the loader and sends

    POST /admin/update {"version": version, "transport": "ipc", "descriptor": descriptor,
                        "mode": "copy" | "swap", "expect": {"digest": digest, "tensors": n, "files": [...]}}

With `expect.files` (check while loading) the worker never takes the sender's descriptor on
trust: it asks the loader named in it (which must run as this user or root, checked with
SO_PEERCRED) for its own descriptor of the version, requires the loader's per-file digests,
computed by the loader from the bytes it staged, to equal the registry's (`tie_to_loader`), and
maps only segment files owned by that user and sealed read-only.

`open_update(request, store)` builds an `IpcTransport`: it parses the descriptor strictly;
`table()` reports the tensor table without mapping anything; `open()` acquires the version at
the loader (when the descriptor names one) and opens the buffer once per version (`IpcOpener`,
in `ipc_open.py`, caches and reference-counts open buffers), so a dead loader or a bad buffer is
a refusal before anything is written; `write_into(params)` copies (mode `copy`: graph-safe, the
parameters keep their own storage); `lease(params)` gives validated pairs of parameters and
tensors in the shared buffer (mode `swap`: the worker's store points the parameters at them and
keeps a pointer flip back); `close()` drops this transport's reference and releases the version
at the loader. A lease outlives the update: its `release` (when no version record uses it any
more) closes the buffer on a background thread, off the update's critical section. A buffer is
unmapped (or its CUDA IPC handle closed) when the last reference and the last view are gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Mapping
from typing import Any

import torch

from daemon.handoff import (
    HOST_DEVICE,
    Descriptor,
    DescriptorError,
    IpcRefused,
    LoaderClient,
    LoaderError,
    parse_descriptor,
    tie_to_loader,
)
from daemon.transport.base import (
    BadUpdateRequest,
    Expect,
    SwapLease,
    TensorSpec,
    TransportError,
    UpdateRequest,
    WorkerTransportFactory,
    pair_up,
)
from daemon.transport.check import wants_check
from daemon.transport.copyplan import CopyPlan, as_bytes, checksum, parameter_places, plan_copies, run_copies
from daemon.transport.ipc_open import OPENER, TRUSTED_UIDS, IpcOpener, OpenedVersion

log = logging.getLogger("hotswap.transport.ipc")


class LoaderRefused(IpcRefused):
    """The loader could not be reached, or no longer holds the version; nothing was written."""


def _device_uuid_of(device: torch.device) -> str:
    if device.type == "cpu":
        return HOST_DEVICE
    if device.type == "cuda":
        from daemon.handoff import device_uuid

        return device_uuid(device.index if device.index is not None else torch.cuda.current_device())
    raise DescriptorError(f"the ipc transport does not support device {device}")


class IpcTransport:
    """WeightTransport over a loader descriptor; see the module docstring for the life cycle."""

    name = "ipc"
    # copy mode: "coalesce" = runs of tensors laid out alike in the worker's flat buffer and the
    # loader's buffer move as one copy each (copyplan.py), the rest one copy per tensor;
    # "loop" = one copy per tensor; "foreach" = torch._foreach_copy_ (CUDA; measured slower)
    cuda_copy = "coalesce"
    verify_copy = True  # compare the checksum of the bytes written with the source's (bench: off to time the copy alone)

    def __init__(
        self,
        descriptor: Descriptor | Mapping[str, Any],
        *,
        device: torch.device | str = "cpu",
        worker: str | None = None,
        opener: IpcOpener | None = None,
        expect: Expect | None = None,
        flat: torch.Tensor | None = None,
    ) -> None:
        """`expect`: the registry's per-file digests; when given, the version is used only if the
        loader (running as this user) answers for it and its own staging digests match them.
        `flat`: the worker's one buffer its parameters are views of (WeightStore.flat), if any."""
        self.descriptor = descriptor if isinstance(descriptor, Descriptor) else parse_descriptor(dict(descriptor))
        self.expect = expect or Expect()
        self.checked: dict[str, Any] = {}
        self.device = torch.device(device)
        self.worker = worker or f"pid-{os.getpid()}"
        self._opener = opener or OPENER
        want = "shm" if self.device.type == "cpu" else "cuda"
        if self.descriptor.kind != want:
            raise DescriptorError(
                f"descriptor of kind {self.descriptor.kind!r} cannot feed a worker on {self.device} (needs {want!r})"
            )
        self._opened: OpenedVersion | None = None
        self._acquired = False
        self.flat = flat
        self.copies = 0  # copies the last write_into issued
        # prepare_copy's (parameter places, plan, source checksum), used by the next write_into
        self._prepared_copy: tuple[tuple[tuple[str, int], ...], CopyPlan, torch.Tensor | int | None] | None = None

    @property
    def version(self) -> str:
        return self.descriptor.version

    def table(self) -> dict[str, TensorSpec]:
        return self.descriptor.table()

    def source_digest(self) -> str | None:
        """The content digest the loader recorded when staging (the worker checks expect.digest)."""
        return self.descriptor.digest

    def stats(self) -> dict[str, Any]:
        return {**self.checked, "copies": self.copies} if self.copies else dict(self.checked)

    def _from_loader(self) -> None:
        """Check while loading, ipc: take the descriptor from the loader itself (a loader that runs
        as this user), never the sender's, and tie its digests to the registry's."""
        if not self.descriptor.loader:
            raise IpcRefused(f"version {self.version!r}: no loader named to vouch for the staged bytes")
        client = LoaderClient(self.descriptor.loader, timeout=10.0, peer_uids=TRUSTED_UIDS)
        try:
            own = parse_descriptor(client.descriptor(self.version, device=_device_uuid_of(self.device)))
        except LoaderError as exc:
            raise LoaderRefused(f"version {self.version!r}: {exc}") from None
        self.checked = tie_to_loader(own, self.descriptor, self.expect)
        self.descriptor = own

    def open(self) -> None:
        """Acquire the version at the loader and open its buffer; raises IpcRefused, writes nothing."""
        if self._opened is not None:
            return
        if wants_check(self.expect) and not self.checked:
            self._from_loader()
        buf = self.descriptor.buffer_for(_device_uuid_of(self.device))
        if self.descriptor.loader and not self._acquired:
            try:
                LoaderClient(self.descriptor.loader, timeout=10.0).acquire(
                    self.version, self.worker, pid=os.getpid()
                )
            except LoaderError as exc:
                raise LoaderRefused(f"version {self.version!r}: {exc}") from None
            self._acquired = True
        try:
            self._opened = self._opener.open(self.descriptor, buf)
        except BaseException:
            self._release_at_loader()
            raise

    def views(self) -> dict[str, torch.Tensor]:
        """Tensors pointing into the shared buffer, by name (for swap mode). Do not write into them."""
        self.open()
        assert self._opened is not None
        return self._opened.views()

    def prepare_copy(self, params: dict[str, torch.Tensor]) -> None:
        """Before the pause (issue 41): the copy plan for these very parameters, and the checksum
        of the source bytes it will copy (queued on the device, read after the copy). `write_into`
        uses both when the parameters still sit where they did, else makes them again."""
        pairs = self._pairs(params)
        plan = self._plan(pairs)
        want = self._checksum(plan, source=True) if self.verify_copy else None
        self._prepared_copy = (parameter_places(params), plan, want)

    def _pairs(self, params: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        views = self.views()
        if params.keys() != views.keys():
            raise TransportError(f"version {self.version!r}: parameter names differ from the descriptor's table")
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, p in params.items():
            v = views[name]
            if p.shape != v.shape or p.dtype != v.dtype:
                raise TransportError(
                    f"tensor {name!r}: live {p.dtype}{list(p.shape)} != incoming {v.dtype}{list(v.shape)}"
                )
            if p.data_ptr() == v.data_ptr():
                continue  # already pointing at this very buffer (swap mode): nothing to copy
            pairs.append((p.data, v))
        return pairs

    def _plan(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> CopyPlan:
        assert self._opened is not None
        return plan_copies(pairs, self.flat if self.cuda_copy == "coalesce" else None, self._opened.payload)

    def _segments(self, plan: CopyPlan, *, source: bool) -> list[torch.Tensor]:
        """The bytes a plan copies, as uint8 views: of the source (loader) or the destination."""
        assert self._opened is not None
        base = self._opened.payload if source else self.flat
        out = [base[r.src if source else r.dst :][: r.nbytes] for r in plan.runs] if plan.runs and base is not None else []
        return out + [as_bytes(s if source else d) for d, s in plan.singles]

    def _checksum(self, plan: CopyPlan, *, source: bool) -> torch.Tensor | int | None:
        """The checksum of the bytes `plan` copies, on one side; each segment read as 8-byte words
        where both sides allow it, else as bytes: the same on both sides."""
        src, dst = self._segments(plan, source=True), self._segments(plan, source=False)
        if not src:
            return None
        unit = 8
        words = [all(t.data_ptr() % unit == 0 and t.numel() % unit == 0 for t in pair) for pair in zip(src, dst, strict=True)]
        return checksum(src if source else dst, words, unit)

    def write_into(self, params: dict[str, torch.Tensor]) -> None:
        """Copy the version into `params`, then compare the checksum of the bytes written with the
        source's (one synchronisation); a mismatch raises TransportError (the update restores)."""
        prepared, self._prepared_copy = self._prepared_copy, None
        if prepared is not None and prepared[0] == parameter_places(params):
            _, plan, want = prepared
        else:
            plan = self._plan(self._pairs(params))
            want = self._checksum(plan, source=True) if self.verify_copy else None
        assert self._opened is not None
        try:
            with torch.no_grad():
                if self.cuda_copy == "foreach" and plan.singles and plan.singles[0][0].device.type == "cuda":
                    torch._foreach_copy_([d for d, _ in plan.singles], [s for _, s in plan.singles])
                    run_copies(CopyPlan(plan.runs, []), self.flat, self._opened.payload)
                else:
                    run_copies(plan, self.flat, self._opened.payload)
                self.copies = plan.copies
                if want is None:  # nothing copied, or not asked to compare
                    same = True
                    if plan.copies and self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                else:
                    got = self._checksum(plan, source=False)
                    same = bool(torch.equal(got, want)) if isinstance(got, torch.Tensor) else got == want  # one sync
        except RuntimeError as exc:
            raise TransportError(f"version {self.version!r}: copy failed ({exc})") from exc
        self.checked["copy_checksum"] = "equal" if want is not None else "not compared"
        if not same:
            raise TransportError(f"version {self.version!r}: the copied bytes' checksum differs from the staged copy's")

    def lease(self, params: dict[str, torch.Tensor]) -> SwapLease:
        """Swap mode: the parameters paired with their views (validated), held until `release`."""
        pairs = pair_up(params, self.views())
        held = self.detach()
        return SwapLease(pairs, lambda: _release_later(held))

    def detach(self) -> IpcTransport:
        """Hand this transport's loader acquisition and open buffer to a new one (a lease that
        outlives the update, for swap mode); this one is then closed without releasing them."""
        self.open()
        lease = IpcTransport(self.descriptor, device=self.device, worker=self.worker, opener=self._opener)
        lease._opened, lease._acquired = self._opened, self._acquired
        lease.checked = dict(self.checked)
        self._opened, self._acquired = None, False
        return lease

    def close(self) -> None:
        self.flat = None  # the worker's buffer: a closed transport must not keep it alive (swap mode frees it)
        self._prepared_copy = None  # its plan holds views of the parameters' storage
        if self._opened is not None:
            opened, self._opened = self._opened, None
            self._opener.release(opened)
        self._release_at_loader()

    def _release_at_loader(self) -> None:
        if not self._acquired:
            return
        self._acquired = False
        try:
            LoaderClient(self.descriptor.loader or "", timeout=10.0).release(self.version, self.worker)
        except LoaderError as exc:
            # The loader is gone or restarted: it holds nothing for us any more.
            log.warning("could not release %s at the loader: %s", self.version, exc)

    def __enter__(self) -> IpcTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._opened is not None or self._acquired:
                self.close()


def point_params_at(params: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Swap: make every parameter's `.data` the tensor in `targets`; returns the previous `.data`.

    A pointer flip per tensor, no bytes move; flipping back with the returned dict is the
    rollback. Breaks captured CUDA graphs (they hold the old addresses): copy mode is for those.
    """
    previous: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        t = targets[name]
        if p.shape != t.shape or p.dtype != t.dtype or p.device != t.device:
            raise TransportError(
                f"tensor {name!r}: cannot point live {p.dtype}{list(p.shape)}@{p.device} "
                f"at {t.dtype}{list(t.shape)}@{t.device}"
            )
    for name, p in params.items():
        previous[name] = p.data
        p.data = targets[name]
    return previous


def map_ahead(loader: str, version: str, device: torch.device | str, opener: IpcOpener | None = None) -> OpenedVersion:
    """Worker side, before the update (issue 41): open `version`'s buffer in this process while the
    loader still fills it or the daemon still checks it, so the update's own open finds it open.
    Nothing is read through it here; the update still takes its descriptor from the loader once
    exported and ties it to the registry's digests. The caller gives the reference back
    (`opener.release`). A shared-memory segment opens only once sealed (after the stage)."""
    dev = torch.device(device)
    client = LoaderClient(loader, timeout=10.0, peer_uids=TRUSTED_UIDS)
    try:
        desc = parse_descriptor(client.descriptor(version, device=_device_uuid_of(dev), purpose="map"))
    except LoaderError as exc:
        raise LoaderRefused(f"version {version!r}: {exc}") from None
    want = "shm" if dev.type == "cpu" else "cuda"
    if desc.kind != want or desc.version != version:
        raise DescriptorError(f"the loader's map descriptor of {version!r} ({desc.kind}) cannot feed a worker on {dev}")
    return (opener or OPENER).open(desc, desc.buffer_for(_device_uuid_of(dev)))


def open_update(request: UpdateRequest, store: Any) -> IpcTransport:
    """Worker side, from an update request: `descriptor` is the loader's JSON descriptor."""
    descriptor = request.source.get("descriptor")
    if not isinstance(descriptor, dict):
        raise BadUpdateRequest("the ipc transport needs 'descriptor' (the loader's JSON descriptor)")
    return IpcTransport(descriptor, device=store.device, expect=request.expect, flat=getattr(store, "flat", None))


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


# What daemon.transport.TRANSPORTS["ipc"] names; mypy checks it against the protocol.
_WORKER_SIDE: WorkerTransportFactory = open_update
