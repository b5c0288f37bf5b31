"""The IPC descriptor: the one JSON document that crosses from the loader to a worker.

A staged version is one flat buffer per device (a CUDA allocation per GPU, or a file in
/dev/shm on hosts without a GPU). The descriptor names each buffer (device UUID plus a CUDA
IPC handle, or a shared-memory path) and the tensor table laid out inside it. It is plain
JSON, never pickle, and a worker parses it with `parse_descriptor`, which checks every field
(types, bounds, alignment, dtypes, byte counts, overlap) before anything is mapped or written:

    {"format": "hotswap.ipc/1", "kind": "cuda" | "shm", "version": "step-1200",
     "digest": "8f3a21c0" | null, "loader": "/run/hotswap/loader.sock" | null,
     "size": 16060522496,
     "tensors": [{"name": "model.embed_tokens.weight", "dtype": "BF16",
                  "shape": [128256, 4096], "offset": 0, "bytes": 1050673152}, ...],
     "buffers": [{"device_uuid": "GPU-5f0c...", "buffer_bytes": 16060522496, "offset": 0,
                  "handle": "<base64 of the 64-byte cuIpcMemHandle>"},          # kind cuda
                 {"device_uuid": "host", "buffer_bytes": ..., "offset": 0,
                  "path": "/dev/shm/hotswap-4242-1-step-1200"}]}                 # kind shm

Tensor offsets are relative to the buffer's `offset` and 256-byte aligned, so every view is
aligned for any dtype and for vectorised copies.
"""

from __future__ import annotations

import base64
import binascii
import math
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from daemon.formats import DTYPE_SIZES


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


FORMAT = "hotswap.ipc/1"
ALIGN = 256
CUDA_IPC_HANDLE_BYTES = 64
HOST_DEVICE = "host"
SHM_PREFIX = "hotswap-"
MAX_BYTES = 1 << 50  # 1 PiB: larger numbers are corrupt, not ambitious
MAX_TENSORS = 1 << 20
MAX_NAME_CHARS = 1024
MAX_DIMS = 16
MAX_VERSION_CHARS = 256

Kind = Literal["cuda", "shm"]
_TOP_KEYS = {"format", "kind", "version", "digest", "loader", "size", "tensors", "buffers"}
_OPTIONAL_KEYS = {"files", "checked"}
_TENSOR_KEYS = {"name", "dtype", "shape", "offset", "bytes"}
# content digest: "<alg>:<64 hex>" (manifest format 2, daemon.hashing) or a legacy 8-hex CRC digest
_DIGEST_RE = re.compile(r"^(?:(?:blake3|sha256):[0-9a-f]{64}|[0-9a-f]{8})$")


class IpcRefused(ValueError):
    """An ipc update refused before any parameter was written (bad descriptor, loader gone, ...)."""


class DescriptorError(IpcRefused):
    """A descriptor that breaks a rule; nothing was mapped or written. The message names the field."""


@dataclass(frozen=True, slots=True)
class TensorSlot:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    offset: int  # from the start of the buffer's payload
    nbytes: int

    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape, self.nbytes)


@dataclass(frozen=True, slots=True)
class BufferRef:
    device_uuid: str  # "GPU-<uuid>" for CUDA, "host" for shared memory
    buffer_bytes: int  # size of the whole mapping
    offset: int  # where the payload starts inside the mapping
    handle: bytes | None = None  # kind cuda: raw cuIpcMemHandle
    path: str | None = None  # kind shm: the segment file


@dataclass(frozen=True, slots=True)
class Descriptor:
    version: str
    kind: Kind
    size: int  # payload bytes, the same layout in every buffer
    tensors: tuple[TensorSlot, ...]
    buffers: tuple[BufferRef, ...]
    digest: str | None = None
    loader: str | None = None  # loader socket: workers acquire/release the version there
    # the per-file digests the loader computed itself from the bytes it staged:
    # (path relative to the checkpoint, bytes, alg, hex), and whether they matched the reference
    # the daemon gave when staging (`checked`)
    files: tuple[tuple[str, int, str, str], ...] = ()
    checked: bool = False

    def table(self) -> dict[str, TensorSpec]:
        return {t.name: t.spec() for t in self.tensors}

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def buffer_for(self, device_uuid: str) -> BufferRef:
        for b in self.buffers:
            if b.device_uuid == device_uuid:
                return b
        have = ", ".join(b.device_uuid for b in self.buffers) or "none"
        raise DescriptorError(
            f"descriptor for version {self.version!r} has no buffer on device {device_uuid} (has: {have})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "kind": self.kind,
            "version": self.version,
            "digest": self.digest,
            "loader": self.loader,
            "size": self.size,
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset, "bytes": t.nbytes}
                for t in self.tensors
            ],
            "buffers": [_buffer_json(self.kind, b) for b in self.buffers],
            "files": [{"path": p, "bytes": n, "alg": a, "hash": h} for p, n, a, h in self.files],
            "checked": self.checked,
        }


def _buffer_json(kind: Kind, b: BufferRef) -> dict[str, Any]:
    doc: dict[str, Any] = {"device_uuid": b.device_uuid, "buffer_bytes": b.buffer_bytes, "offset": b.offset}
    if kind == "cuda":
        assert b.handle is not None
        doc["handle"] = base64.b64encode(b.handle).decode("ascii")
    else:
        doc["path"] = b.path
    return doc


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def layout_tensors(entries: Iterable[tuple[str, str, tuple[int, ...]]]) -> tuple[tuple[TensorSlot, ...], int]:
    """Lay (name, dtype, shape) out back to back, each at a 256-byte boundary, in the given order.

    Returns the slots and the payload size (rounded up to the alignment).
    """
    slots: list[TensorSlot] = []
    cursor = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        slots.append(TensorSlot(name, dtype, tuple(shape), cursor, nbytes))
        cursor = align_up(cursor + nbytes)
    return tuple(slots), cursor


# ---- strict parsing ---------------------------------------------------------------------


def _int(value: Any, where: str, *, lo: int = 0, hi: int = MAX_BYTES) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise DescriptorError(f"{where} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise DescriptorError(f"{where} = {value} is out of bounds [{lo}, {hi}]")
    return value


def _str(value: Any, where: str, *, max_chars: int) -> str:
    if not isinstance(value, str) or not value:
        raise DescriptorError(f"{where} must be a non-empty string")
    if len(value) > max_chars:
        raise DescriptorError(f"{where} is longer than {max_chars} characters")
    if "\x00" in value:
        raise DescriptorError(f"{where} contains a NUL character")
    return value


def _parse_tensor(i: int, doc: Any, size: int) -> TensorSlot:
    where = f"tensors[{i}]"
    if not isinstance(doc, dict):
        raise DescriptorError(f"{where} must be an object")
    keys = set(doc)
    if keys != _TENSOR_KEYS:
        missing, extra = sorted(_TENSOR_KEYS - keys), sorted(keys - _TENSOR_KEYS)
        raise DescriptorError(f"{where}: missing fields {missing}, unknown fields {extra}")
    name = _str(doc["name"], f"{where}.name", max_chars=MAX_NAME_CHARS)
    where = f"tensor {name!r}"
    dtype = doc["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise DescriptorError(f"{where}: unknown dtype {dtype!r}")
    shape = doc["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise DescriptorError(f"{where}: shape must be a list of at most {MAX_DIMS} integers")
    dims = tuple(_int(d, f"{where}: shape[{k}]") for k, d in enumerate(shape))
    offset = _int(doc["offset"], f"{where}: offset")
    nbytes = _int(doc["bytes"], f"{where}: bytes")
    want = math.prod(dims) * DTYPE_SIZES[dtype]
    if want != nbytes:
        raise DescriptorError(f"{where}: {dtype}{list(dims)} needs {want} bytes, descriptor says {nbytes}")
    if offset % ALIGN:
        raise DescriptorError(f"{where}: offset {offset} is not {ALIGN}-byte aligned")
    if offset + nbytes > size:
        raise DescriptorError(f"{where}: bytes [{offset}, {offset + nbytes}) run past the payload size {size}")
    return TensorSlot(name, dtype, dims, offset, nbytes)


def _parse_buffer(i: int, doc: Any, kind: Kind, size: int) -> BufferRef:
    where = f"buffers[{i}]"
    if not isinstance(doc, dict):
        raise DescriptorError(f"{where} must be an object")
    specific = "handle" if kind == "cuda" else "path"
    want = {"device_uuid", "buffer_bytes", "offset", specific}
    if set(doc) != want:
        missing, extra = sorted(want - set(doc)), sorted(set(doc) - want)
        raise DescriptorError(f"{where}: missing fields {missing}, unknown fields {extra} for kind {kind!r}")
    uuid = _str(doc["device_uuid"], f"{where}.device_uuid", max_chars=128)
    buffer_bytes = _int(doc["buffer_bytes"], f"{where}.buffer_bytes")
    offset = _int(doc["offset"], f"{where}.offset")
    if offset % ALIGN:
        raise DescriptorError(f"{where}.offset {offset} is not {ALIGN}-byte aligned")
    if offset + size > buffer_bytes:
        raise DescriptorError(
            f"{where}: payload [{offset}, {offset + size}) runs past the buffer ({buffer_bytes} bytes)"
        )
    if kind == "cuda":
        if not uuid.startswith("GPU-"):
            raise DescriptorError(f"{where}.device_uuid {uuid!r} is not a GPU UUID (GPU-...)")
        raw = doc["handle"]
        if not isinstance(raw, str):
            raise DescriptorError(f"{where}.handle must be a base64 string")
        try:
            handle = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise DescriptorError(f"{where}.handle is not valid base64") from None
        if len(handle) != CUDA_IPC_HANDLE_BYTES:
            raise DescriptorError(f"{where}.handle has {len(handle)} bytes, a CUDA IPC handle has 64")
        return BufferRef(uuid, buffer_bytes, offset, handle=handle)
    if uuid != HOST_DEVICE:
        raise DescriptorError(f"{where}.device_uuid must be {HOST_DEVICE!r} for kind 'shm', got {uuid!r}")
    path = _str(doc["path"], f"{where}.path", max_chars=4096)
    if not path.startswith("/") or posixpath.normpath(path) != path:
        raise DescriptorError(f"{where}.path {path!r} must be an absolute, normalised path")
    if not posixpath.basename(path).startswith(SHM_PREFIX):
        raise DescriptorError(f"{where}.path {path!r} is not a hotswap segment ({SHM_PREFIX}*)")
    return BufferRef(uuid, buffer_bytes, offset, path=path)


def parse_descriptor(doc: Any) -> Descriptor:
    """Validate a descriptor decoded from JSON; raises DescriptorError naming the first problem."""
    if not isinstance(doc, dict):
        raise DescriptorError("descriptor must be a JSON object")
    keys = set(doc) - _OPTIONAL_KEYS
    if keys != _TOP_KEYS or set(doc) - _TOP_KEYS - _OPTIONAL_KEYS:
        missing, extra = sorted(_TOP_KEYS - keys), sorted(keys - _TOP_KEYS)
        raise DescriptorError(f"descriptor: missing fields {missing}, unknown fields {extra}")
    if doc["format"] != FORMAT:
        raise DescriptorError(f"descriptor format {doc['format']!r} is not {FORMAT!r}")
    kind = doc["kind"]
    if kind not in ("cuda", "shm"):
        raise DescriptorError(f"descriptor kind {kind!r} is not 'cuda' or 'shm'")
    version = _str(doc["version"], "version", max_chars=MAX_VERSION_CHARS)
    digest = doc["digest"]
    if digest is not None and (not isinstance(digest, str) or not _DIGEST_RE.match(digest)):
        raise DescriptorError(f"digest {digest!r:.80} must be '<blake3|sha256>:<64 hex>', 8 lowercase hex or null")
    loader = doc["loader"]
    if loader is not None:
        loader = _str(loader, "loader", max_chars=4096)
        if not loader.startswith("/"):
            raise DescriptorError(f"loader socket {loader!r} must be an absolute path")
    size = _int(doc["size"], "size")
    raw_tensors = doc["tensors"]
    if not isinstance(raw_tensors, list) or not 1 <= len(raw_tensors) <= MAX_TENSORS:
        raise DescriptorError(f"tensors must be a list of 1 to {MAX_TENSORS} entries")
    tensors = [_parse_tensor(i, t, size) for i, t in enumerate(raw_tensors)]
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise DescriptorError(f"tensor {t.name!r} appears twice")
        seen.add(t.name)
    ordered = sorted(tensors, key=lambda t: (t.offset, t.nbytes))
    for prev, cur in zip(ordered, ordered[1:], strict=False):
        if cur.offset < prev.offset + prev.nbytes:
            raise DescriptorError(f"tensor {cur.name!r} overlaps tensor {prev.name!r}")
    raw_buffers = doc["buffers"]
    if not isinstance(raw_buffers, list) or not 1 <= len(raw_buffers) <= 64:
        raise DescriptorError("buffers must be a list of 1 to 64 entries")
    buffers = [_parse_buffer(i, b, kind, size) for i, b in enumerate(raw_buffers)]
    if len({b.device_uuid for b in buffers}) != len(buffers):
        raise DescriptorError("two buffers name the same device")
    files = _parse_files(doc.get("files", []))
    checked = doc.get("checked", False)
    if not isinstance(checked, bool):
        raise DescriptorError("checked must be true or false")
    return Descriptor(version, kind, size, tuple(tensors), tuple(buffers), digest, loader, files, checked)


def _parse_files(raw: Any) -> tuple[tuple[str, int, str, str], ...]:
    if not isinstance(raw, list) or len(raw) > MAX_TENSORS:
        raise DescriptorError(f"files must be a list of at most {MAX_TENSORS} entries")
    out = []
    for i, f in enumerate(raw):
        ok = (isinstance(f, dict) and set(f) == {"path", "bytes", "alg", "hash"} and isinstance(f["path"], str)
              and isinstance(f["alg"], str) and isinstance(f["hash"], str) and len(f["hash"]) <= 128)  # fmt: skip
        if not ok:
            raise DescriptorError(f"files[{i}] must be {{path, bytes, alg, hash}}")
        out.append((_str(f["path"], f"files[{i}].path", max_chars=4096), _int(f["bytes"], f"files[{i}].bytes"),
                    f["alg"], f["hash"]))  # fmt: skip
    return tuple(out)
