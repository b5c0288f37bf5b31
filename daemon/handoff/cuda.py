"""CUDA IPC through the driver API (libcuda via ctypes): explicit lifetimes, a stable handle format.

Why not torch's `_share_cuda_` / `_new_shared_cuda`: every export through torch allocates a
cross-process reference counter that exactly one importer must release, or the block stays in
the exporter's limbo forever (an exported-but-never-opened descriptor would leak 16 GB), and
its handle bytes are a torch-internal format. Here the loader owns a plain `cuMemAlloc`
allocation per staged version and frees it when the loader's own accounting says no worker
holds it; a worker opens the 64-byte `cuIpcMemHandle` once per version and closes it when
the last tensor view of it is gone. Both sides wrap the raw pointer as a torch tensor through
`__cuda_array_interface__`, so torch copies and views work unchanged.

GPUs are matched by UUID (`torch.cuda.get_device_properties(i).uuid`), never by index, so
processes with different CUDA_VISIBLE_DEVICES agree on the device.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger("hotswap.transport.ipc")

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CudaIpcError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's reason."""


# driver symbol to call for each API name (the headers #define most of them to a _v2)
_SYMBOLS: dict[str, tuple[str, ...]] = {
    "cuCtxPushCurrent": ("cuCtxPushCurrent_v2",),
    "cuCtxPopCurrent": ("cuCtxPopCurrent_v2",),
    "cuMemAlloc": ("cuMemAlloc_v2",),
    "cuMemFree": ("cuMemFree_v2",),
    "cuMemGetInfo": ("cuMemGetInfo_v2",),
    "cuMemGetAddressRange": ("cuMemGetAddressRange_v2",),
    "cuIpcOpenMemHandle": ("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"),
}


class _CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Driver:
    """The handful of driver entry points we need, resolved once."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaIpcError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from None
        self._fn: dict[str, Any] = {}
        self._ctx: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()
        self.call("cuInit", ctypes.c_uint(0))

    def _resolve(self, name: str) -> Any:
        fn = self._fn.get(name)
        if fn is None:
            # exact symbols: a "_v2" of another call can take different arguments
            for candidate in _SYMBOLS.get(name, (name,)):
                fn = getattr(self.lib, candidate, None)
                if fn is not None:
                    break
            if fn is None:
                raise CudaIpcError(f"the CUDA driver has no {name}")
            fn.restype = ctypes.c_int
            self._fn[name] = fn
        return fn

    def call(self, name: str, *args: Any) -> None:
        rc = self._resolve(name)(*args)
        if rc != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(ctypes.c_int(rc), ctypes.byref(msg))
            reason = msg.value.decode() if msg.value else "unknown error"
            raise CudaIpcError(f"{name} failed with CUDA error {rc}: {reason}")

    def context(self, index: int) -> ctypes.c_void_p:
        """The device's primary context (the one torch uses), retained once for the process."""
        with self._lock:
            ctx = self._ctx.get(index)
            if ctx is None:
                dev = ctypes.c_int()
                self.call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(index))
                ctx = ctypes.c_void_p()
                self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
                self._ctx[index] = ctx
            return ctx

    @contextmanager
    def on(self, index: int) -> Iterator[None]:
        self.call("cuCtxPushCurrent", self.context(index))
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            self.call("cuCtxPopCurrent", ctypes.byref(popped))


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def device_uuid(index: int) -> str:
    """'GPU-<uuid>' of a visible device, as nvidia-smi prints it."""
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


def device_index(uuid: str) -> int:
    """The visible index of the GPU with this UUID; CudaIpcError when this process cannot see it."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise CudaIpcError(f"GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?)")


class _Memory:
    """Owner of a raw device pointer; tensors made from it keep it alive via the array interface."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


def _wrap(ptr: int, nbytes: int, index: int, release: Any) -> tuple[torch.Tensor, weakref.ref[Any]]:
    holder = _Memory(ptr, nbytes)
    # Runs when the last tensor view of the memory dies, in whichever thread drops it.
    weakref.finalize(holder, release)
    tensor = torch.as_tensor(holder, device=torch.device("cuda", index))
    return tensor, weakref.ref(holder)


class DeviceBuffer:
    """Loader side: one cuMemAlloc'd flat buffer on a GPU, exportable as a CUDA IPC handle."""

    def __init__(self, index: int, nbytes: int) -> None:
        d = driver()
        self.index = index
        self.nbytes = nbytes
        self.device_uuid = device_uuid(index)
        ptr = ctypes.c_uint64()
        with d.on(index):
            d.call("cuMemAlloc", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        self.ptr = ptr.value
        self._handle: bytes | None = None

        def release(ptr: int = ptr.value) -> None:
            try:
                with d.on(index):
                    d.call("cuCtxSynchronize")  # no kernel may still use it
                    d.call("cuMemFree", ctypes.c_uint64(ptr))
            except CudaIpcError as exc:  # at interpreter exit the context may be gone already
                log.warning("freeing staged buffer on GPU %d: %s", index, exc)

        tensor, self._holder = _wrap(self.ptr, nbytes, index, release)
        self._tensor: torch.Tensor | None = tensor

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise CudaIpcError(f"buffer on GPU {self.device_uuid} was freed")
        return self._tensor

    def ipc_handle(self) -> bytes:
        if self._handle is None:
            d = driver()
            h = _CUipcMemHandle()
            with d.on(self.index):
                d.call("cuIpcGetMemHandle", ctypes.byref(h), ctypes.c_uint64(self.ptr))
            # read the raw 64 bytes: a c_char array's value would stop at the first NUL
            self._handle = ctypes.string_at(ctypes.addressof(h), 64)
        return self._handle

    def free(self) -> bool:
        """Drop our reference; the memory is freed now unless a view is still alive (then when it dies)."""
        self._tensor = None
        return self._holder() is None


def check_imported_range(ptr: int, base: int, size: int, nbytes: int) -> None:
    """The allocation behind an opened IPC handle must start at the mapped pointer and hold at
    least the `nbytes` the descriptor claims; a smaller one would let copies read past its end."""
    if nbytes <= 0:
        raise CudaIpcError(f"descriptor buffer size {nbytes} must be positive")
    if base != ptr:
        raise CudaIpcError(f"IPC handle maps at {ptr:#x}, inside an allocation starting at {base:#x}")
    if size < nbytes:
        raise CudaIpcError(f"the descriptor claims {nbytes} bytes, the allocation behind the handle has {size}")


class ImportedBuffer:
    """Worker side: a loader's buffer opened through its IPC handle, on the GPU with that UUID."""

    def __init__(self, uuid: str, handle: bytes, nbytes: int) -> None:
        d = driver()
        self.index = device_index(uuid)
        self.nbytes = nbytes
        h = _CUipcMemHandle()
        ctypes.memmove(ctypes.addressof(h), handle, 64)
        ptr = ctypes.c_uint64()
        torch.cuda.init()
        with d.on(self.index):
            d.call("cuIpcOpenMemHandle", ctypes.byref(ptr), h, ctypes.c_uint(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
            # the descriptor's size is a claim: the driver says how big the allocation really is
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            try:
                d.call("cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr.value))
                check_imported_range(ptr.value, base.value, size.value, nbytes)
            except CudaIpcError:
                d.call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr.value))
                raise
        index = self.index

        def release(ptr: int = ptr.value) -> None:
            try:
                with d.on(index):
                    d.call("cuCtxSynchronize")  # no kernel may still read it
                    d.call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))
            except CudaIpcError as exc:
                log.warning("closing IPC handle on GPU %d: %s", index, exc)

        tensor, self._holder = _wrap(ptr.value, nbytes, index, release)
        self._tensor: torch.Tensor | None = tensor

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise CudaIpcError("imported buffer was closed")
        return self._tensor

    def close(self) -> bool:
        """Drop our reference; True when the handle is closed now (no view of it is alive)."""
        self._tensor = None
        return self._holder() is None


def mem_get_info(index: int) -> tuple[int, int]:
    """(free, total) bytes on the device, as the driver sees them (all processes)."""
    d = driver()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    with d.on(index):
        d.call("cuMemGetInfo", ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value
