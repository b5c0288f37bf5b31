"""Stage while verifying: one read of each file feeds the hashes and the copy on the staging device.

The crc32c check reads every file once through the byte pipeline (daemon.bytepipe.files). Each
chunk lands in one buffer: on a CPU staging device the destination itself (the flat staging
tensor), on a GPU a pinned host buffer of the pool. That buffer is CRC'd (reader threads), fed to
the strong hash (in file order) and, on a GPU, copied from the same pinned memory to the flat
device tensor on the reader's stream, overlapped with the hashing, before it is reused. So the
staged bytes are exactly the bytes hashed, and the digest is computed from the bytes read.

The later checks (finite, forward) look at the staged copy through views at the header offsets
(`StagedCopy.tensors`): nothing is read from disk again. The copy lives for one `run_checks`
and is released there whatever the outcome; it is never exported to a worker.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from daemon.bytepipe.files import read_files
from daemon.bytepipe.sinks import DeviceCopy
from daemon.formats import TensorLocation
from daemon.hashing import CHUNK_BYTES, FileDigest

ALIGN = 256  # each file starts at a multiple of this in the flat buffer

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E5M2": torch.float8_e5m2, "F8_E4M3": torch.float8_e4m3fn,
}  # fmt: skip


class StageReadError(OSError):
    """Reading a file into the staging copy failed; the message names the file."""


class StagedTensors:
    """A checkpoint's tensors staged on a device, as views: what finite and forward read."""

    device: str

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def raw_tensor(self, name: str, loc: TensorLocation, root: Path) -> torch.Tensor:
        """The tensor's bytes as a flat uint8 view (no copy)."""
        raise NotImplementedError

    def tensor(self, name: str, loc: TensorLocation, root: Path) -> torch.Tensor:
        """The tensor at `loc` with its dtype and shape: a view when its address suits its element
        size (always, in practice); otherwise a copy of that one tensor."""
        dtype = _TORCH_DTYPES.get(loc.entry.dtype)
        if dtype is None:
            raise ValueError(f"tensor {name!r}: dtype {loc.entry.dtype} has no torch equivalent")
        return typed(self.raw_tensor(name, loc, root), dtype).view(tuple(loc.entry.shape))

    @property
    def shareable(self) -> bool:
        """True when another process can open this copy without a copy of its bytes (CUDA IPC, a
        shared segment): then the check process's forward canary reads it (daemon.checks.isolation)
        instead of reading the files a second time."""
        return False

    @property
    def owned_elsewhere(self) -> bool:
        """True when the bytes belong to another process (the loader), which frees them on its own
        accounting: a view of them may then close after the check answers, off the update's path."""
        return False

    def release(self) -> None:
        raise NotImplementedError


def typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A uint8 view reinterpreted as `dtype` (copied first only if its address is misaligned)."""
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)


@functools.lru_cache(maxsize=1024)
def _relative(file: Path, root: Path) -> str:
    # once per file, not per tensor: on the H100 host (Python 3.12) pathlib's relative_to took
    # ~110 us a call, 32 ms of the forward check's 45 ms of views over the 8B layout's 291 tensors
    return file.relative_to(root).as_posix()


@dataclass(slots=True)
class StagedCopy(StagedTensors):
    """The files of one checkpoint, byte for byte, in one flat uint8 tensor on `device`."""

    device: str
    buffer: torch.Tensor
    bases: dict[str, int]  # relative posix path -> offset of the file's first byte in `buffer`
    sizes: dict[str, int]
    hashed: bool  # True: every byte in it was hashed as it was read (the crc32c check's pass)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def file_bytes(self, rel: str) -> torch.Tensor:
        base = self.bases[rel]
        return self.buffer[base : base + self.sizes[rel]]

    def raw(self, rel: str, start: int, end: int) -> torch.Tensor:
        """Bytes [start, end) of file `rel` as a uint8 view (no copy)."""
        if not 0 <= start <= end <= self.sizes[rel]:
            raise ValueError(f"{rel}: bytes [{start}, {end}) outside the staged {self.sizes[rel]} bytes")
        base = self.bases[rel]
        return self.buffer[base + start : base + end]

    def raw_tensor(self, name: str, loc: TensorLocation, root: Path) -> torch.Tensor:
        return self.raw(_relative(loc.file, root), loc.entry.start, loc.entry.end)

    @property
    def shareable(self) -> bool:
        # a GPU copy crosses as a CUDA IPC handle (torch's reductions); a host copy would be copied
        # into shared memory whole, slower than the child reading the files from the page cache
        return bool(self.buffer.is_cuda)

    def release(self) -> None:
        """Free the copy; on a GPU also give the memory back to the driver (the loader and the
        workers are other processes: memory held in this process's cache is lost to them)."""
        on_gpu = self.buffer.device.type == "cuda"
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if on_gpu:
            torch.cuda.ipc_collect()  # blocks the check process has let go of (a no-op where none was shared)
            torch.cuda.empty_cache()


def stage_files(
    root: Path,
    rels: Sequence[str],
    device: str,
    *,
    alg: str | None,
    crc: bool = True,
    threads: int | None = None,
    chunk: int = CHUNK_BYTES,
) -> tuple[list[FileDigest], StagedCopy]:
    """Read every file once into a flat tensor on `device`, hashing each chunk from the buffer it
    was read into (CRC32C when `crc`, `alg` when not None). Digests in `rels` order.

    On a CPU device the readers read straight into the flat tensor; on a GPU into pinned buffers
    of the pool, each copied on its reader's stream while the same bytes are hashed.
    Raises StageReadError (an OSError) when a file is not a regular file, shrinks or changes size.
    """
    dev = torch.device(device)
    on_gpu = dev.type == "cuda"
    paths = [root / r for r in rels]
    sizes = []
    for p, rel in zip(paths, rels, strict=True):
        try:
            sizes.append(p.stat().st_size)
        except OSError as exc:
            raise StageReadError(f"{rel}: cannot open ({exc.strerror})") from None
    bases: dict[str, int] = {}
    total = 0
    for rel, size in zip(rels, sizes, strict=True):
        bases[rel] = total
        total += -(-max(size, 1) // ALIGN) * ALIGN
    buffer = torch.empty(total, dtype=torch.uint8, device=dev)
    host = None if on_gpu else memoryview(buffer.numpy())
    copy = DeviceCopy(lambda job: [(buffer[job.dst : job.dst + job.nbytes], 0, job.nbytes)]) if on_gpu else None
    digests = read_files(
        paths, list(rels), alg=alg, crc=crc, threads=max(1, threads or os.cpu_count() or 1), chunk=chunk,
        error=StageReadError, bases=[bases[r] for r in rels],
        into=(lambda job: host[job.dst : job.dst + job.nbytes]) if host is not None else None,
        extra=[copy] if copy is not None else [], pinned=on_gpu, on_exit=copy.finish if copy is not None else None,
    )  # fmt: skip
    # the sizes read must be the sizes laid out (a file replaced between stat and open)
    for rel, size, d in zip(rels, sizes, digests, strict=True):
        if d.bytes != size:
            raise StageReadError(f"{rel}: size changed while hashing ({size} -> {d.bytes} bytes)")
    if on_gpu:
        torch.cuda.synchronize(dev)
    copy_ = StagedCopy(str(device), buffer, bases, dict(zip(rels, sizes, strict=True)), hashed=alg is not None or crc)
    return digests, copy_
