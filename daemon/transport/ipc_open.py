"""The ipc transport's open buffers: each staged version's buffer is opened once per worker process.

`daemon.transport.ipc` (the worker side's `IpcTransport`) asks `OPENER` for a version's buffer in
`open()` and gives its reference back in `close()`; swap-mode leases hold theirs until the
worker lets the version go. This module owns that process-wide cache (`IpcOpener`): it maps the
buffer (a sealed shared-memory segment owned by a trusted user, `daemon.handoff.shm`, or a CUDA IPC
handle, `daemon.handoff.cuda`) on first use, counts references, builds the tensor views once
(`OpenedVersion.views`), and unmaps when the last reference and the last view are gone. It
lives apart from the transport because it outlives any one update and is shared by all of them.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from daemon.handoff import BufferRef, Descriptor, DescriptorError, IpcRefused
from daemon.transport.base import ST_TO_TORCH

log = logging.getLogger("hotswap.transport.ipc")


TORCH_DTYPES: dict[str, torch.dtype] = {
    st: getattr(torch, name) for st, name in ST_TO_TORCH.items() if hasattr(torch, name)
}


@dataclass(eq=False)
class OpenedVersion:
    """One open buffer of one staged version in this process, shared by every transport that uses it."""

    key: tuple[str, str]
    version: str
    mapping: Any  # ShmMapping | ImportedBuffer
    payload: torch.Tensor  # uint8 view of the descriptor's payload
    descriptor: Descriptor
    refs: int = 0
    _views: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def views(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            views: dict[str, torch.Tensor] = {}
            for t in self.descriptor.tensors:
                dtype = TORCH_DTYPES.get(t.dtype)
                if dtype is None:
                    raise DescriptorError(f"tensor {t.name!r}: dtype {t.dtype} is not supported by this torch")
                raw = self.payload[t.offset : t.offset + t.nbytes]
                views[t.name] = raw.view(dtype).view(t.shape)
            self._views = views
        return self._views


TRUSTED_UIDS = frozenset({os.getuid(), 0})  # the loader must run as this worker's user (or root)


class IpcOpener:
    """Process-wide cache of open buffers: each version's buffer is opened once and closed once."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, str], OpenedVersion] = {}
        self._opening: dict[tuple[str, str], threading.Event] = {}  # being mapped by a thread now
        self._lock = threading.Lock()

    def open(self, desc: Descriptor, buf: BufferRef) -> OpenedVersion:
        key = (desc.version, buf.path or (buf.handle or b"").hex())
        while True:
            with self._lock:
                opened = self._open.get(key)
                if opened is not None:
                    return self._take(opened, desc)
                opening = self._opening.get(key)
                if opening is None:
                    self._opening[key] = threading.Event()
            if opening is not None:  # another thread maps this buffer now: take its mapping
                opening.wait()
                continue
            # mapped outside the lock (a CUDA IPC open of 8B takes ~80 ms): an open ahead of the
            # next version (`map_ahead`) never holds up the open of another, and a buffer is
            # never mapped twice at once
            try:
                mapping = _map_buffer(desc, buf)
                payload = mapping.tensor()[buf.offset : buf.offset + desc.size]
                with self._lock:
                    self._open[key] = OpenedVersion(key, desc.version, mapping, payload, desc)
                    return self._take(self._open[key], desc)
            finally:
                with self._lock:
                    self._opening.pop(key).set()

    @staticmethod
    def _take(opened: OpenedVersion, desc: Descriptor) -> OpenedVersion:
        if opened.descriptor is not desc:
            # opened ahead (`map_ahead`, a descriptor with no digests yet): the same buffer must
            # hold the same layout; views are built from the newest descriptor
            if (opened.descriptor.size, opened.descriptor.tensors) != (desc.size, desc.tensors):
                raise DescriptorError(f"version {desc.version!r}: its buffer was opened with another layout")
            opened.descriptor = desc
        opened.refs += 1
        return opened

    def release(self, opened: OpenedVersion) -> bool:
        """Drop one reference; at zero, drop our views and the mapping. True when unmapped now."""
        with self._lock:
            opened.refs -= 1
            if opened.refs > 0:
                return False
            self._open.pop(opened.key, None)
            opened._views = None
            opened.payload = torch.empty(0, dtype=torch.uint8)
            # closed under the lock: an open of the same buffer never runs beside its close
            closed = bool(opened.mapping.close())
        if not closed:
            log.info("ipc buffer of %s stays mapped until its last view is gone", opened.version)
        return closed

    def open_versions(self) -> dict[str, int]:
        with self._lock:
            return {o.version: o.refs for o in self._open.values()}


OPENER = IpcOpener()


def _map_buffer(desc: Descriptor, buf: BufferRef) -> Any:
    if desc.kind == "shm":
        from daemon.handoff import ShmMapping

        assert buf.path is not None
        return ShmMapping(buf.path, buf.buffer_bytes, trusted_uids=TRUSTED_UIDS)
    from daemon.handoff import CudaIpcError, ImportedBuffer

    assert buf.handle is not None
    try:
        return ImportedBuffer(buf.device_uuid, buf.handle, buf.buffer_bytes)
    except CudaIpcError as exc:
        raise IpcRefused(f"version {desc.version!r}: cannot open the CUDA IPC handle ({exc})") from None
