"""Stage while verifying: one read of each file feeds the hashes and the copy on the staging device.

The crc32c check reads every file once. Each chunk lands in one buffer: on a CPU staging device
the destination itself (the flat staging tensor), on a GPU a pinned host buffer. That buffer is
CRC'd (reader threads), fed to the strong hash (one consumer per file, in file order) and, on a
GPU, copied from the same pinned memory to the flat device tensor before it is reused. So the
staged bytes are exactly the bytes hashed, and the digest is computed from the bytes read.

The later checks (finite, forward) look at the staged copy through views at the header offsets
(`StagedCopy.tensors`): nothing is read from disk again. The copy lives for one `run_checks`
and is released there whatever the outcome; it is never exported to a worker.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import crc32c as _crc32c
import torch

from daemon.crc import crc32c_combine, crc32c_shift
from daemon.formats.checkpoint import TensorLocation
from daemon.hashing import CHUNK_BYTES, FileDigest, new_strong_hash

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

    def release(self) -> None:
        raise NotImplementedError


def typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A uint8 view reinterpreted as `dtype` (copied first only if its address is misaligned)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if raw.data_ptr() % itemsize:
        raw = raw.clone()
    return raw.view(dtype)


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
        return self.raw(loc.file.relative_to(root).as_posix(), loc.entry.start, loc.entry.end)

    def release(self) -> None:
        """Free the copy; on a GPU also give the memory back to the driver (the loader and the
        workers are other processes: memory held in this process's cache is lost to them)."""
        on_gpu = self.buffer.device.type == "cuda"
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if on_gpu:
            torch.cuda.empty_cache()


# pinned host buffers for GPU staging, kept between versions (pinning costs ~ms per MB)
_PINNED: list[torch.Tensor] = []
_PINNED_LOCK = threading.Lock()


def _take_pinned(n: int, nbytes: int) -> list[torch.Tensor]:
    with _PINNED_LOCK:
        ok = [b for b in _PINNED if b.numel() >= nbytes]
        taken = ok[:n]
        for b in taken:
            _PINNED.remove(b)
    while len(taken) < n:
        taken.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
    return taken


def _give_pinned(bufs: list[torch.Tensor]) -> None:
    with _PINNED_LOCK:
        _PINNED.extend(bufs)


def _read_into(fd: int, rel: str, pos: int, view: memoryview, crc: bool) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], pos + got)
        if n <= 0:
            raise StageReadError(f"{rel}: file shrank while hashing (short read at byte {pos + got})")
        got += n
    return _crc32c.crc32c(view) if crc else 0


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

    Raises StageReadError (an OSError) when a file is not a regular file, shrinks or changes size.
    """
    dev = torch.device(device)
    on_gpu = dev.type == "cuda"
    fds: dict[str, tuple[int, int]] = {}
    try:
        for rel in rels:
            fds[rel] = _open_regular(root / rel, rel)
        bases: dict[str, int] = {}
        total = 0
        for rel in rels:
            bases[rel] = total
            total += -(-max(fds[rel][1], 1) // ALIGN) * ALIGN
        buffer = torch.empty(total, dtype=torch.uint8, device=dev)
        copy = StagedCopy(str(device), buffer, bases, {r: fds[r][1] for r in rels}, hashed=alg is not None or crc)
        host = None if on_gpu else memoryview(buffer.numpy())
        n_threads = max(1, threads or os.cpu_count() or 1)
        consumers = min(n_threads, max(1, len(rels)))
        depth = max(2, -(-n_threads // consumers))
        hash_threads = max(1, n_threads // consumers)
        stop = threading.Event()
        readers = ThreadPoolExecutor(n_threads, thread_name_prefix="stage-read")

        def one(rel: str) -> FileDigest:
            fd, size = fds[rel]
            base = bases[rel]
            strong = new_strong_hash(alg, threads=hash_threads) if alg is not None else None
            total_crc, full_shift = 0, crc32c_shift(chunk)
            pinned = _take_pinned(min(depth, max(1, -(-size // chunk))), chunk) if on_gpu else []
            free = list(range(len(pinned))) if on_gpu else []
            pending: deque[tuple[int, int, int, Future[int]]] = deque()  # pos, n, pinned slot, crc future
            next_pos = 0
            stream = torch.cuda.Stream(device=dev) if on_gpu else None

            def submit() -> None:
                nonlocal next_pos
                want = min(chunk, size - next_pos)
                if on_gpu:
                    slot = free.pop()
                    view = memoryview(pinned[slot].numpy())[:want]
                else:
                    assert host is not None
                    slot, view = -1, host[base + next_pos : base + next_pos + want]
                pending.append((next_pos, want, slot, readers.submit(_read_into, fd, rel, next_pos, view, crc)))
                next_pos += want

            try:
                while next_pos < size and (free or not on_gpu) and len(pending) < depth:
                    submit()
                while pending:
                    if stop.is_set():
                        raise StageReadError(f"{rel}: stopped (another file failed)")
                    pos, n, slot, fut = pending.popleft()
                    part_crc = fut.result()
                    if on_gpu:
                        src = pinned[slot][:n]
                        data = memoryview(src.numpy())
                    else:
                        assert host is not None
                        data = host[base + pos : base + pos + n]
                    if strong is not None:
                        strong.update(data)
                    if crc:
                        total_crc = crc32c_combine(total_crc, part_crc, n, shift=full_shift if n == chunk else crc32c_shift(n))
                    if on_gpu:
                        assert stream is not None
                        with torch.cuda.stream(stream):  # the very bytes just hashed
                            buffer[base + pos : base + pos + n].copy_(src, non_blocking=True)
                        stream.synchronize()  # before the pinned buffer is read into again
                        free.append(slot)
                    if next_pos < size and (free or not on_gpu):
                        submit()
                now = os.fstat(fd).st_size
                if now != size:
                    raise StageReadError(f"{rel}: size changed while hashing ({size} -> {now} bytes)")
            finally:
                for *_x, fut in pending:  # stopped early: no reader may still use this buffer
                    if not fut.cancel():
                        with contextlib.suppress(BaseException):
                            fut.result()
                if pinned:
                    _give_pinned(pinned)
            return FileDigest(size, f"{total_crc:08x}" if crc else "", alg, strong.hexdigest() if strong else "")

        order = sorted(rels, key=lambda r: -fds[r][1])
        out: dict[str, FileDigest] = {}
        try:
            with ThreadPoolExecutor(consumers, thread_name_prefix="stage-file") as pool:
                futures = {r: pool.submit(one, r) for r in order}
                try:
                    for r, fut in futures.items():
                        out[r] = fut.result()
                except BaseException:
                    stop.set()
                    for fut in futures.values():
                        fut.cancel()
                    raise
        finally:
            readers.shutdown(wait=True, cancel_futures=True)
    finally:
        for fd, _size in fds.values():
            os.close(fd)
    if on_gpu:
        torch.cuda.synchronize(dev)
    return [out[r] for r in rels], copy


def _open_regular(path: Path, rel: str) -> tuple[int, int]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise StageReadError(f"{rel}: cannot open ({exc.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise StageReadError(f"{rel}: not a regular file")
    return fd, st.st_size
