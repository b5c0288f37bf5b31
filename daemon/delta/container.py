"""One delta file (`<path>.hsd`): every chunk that rebuilds one result file from its base file.

    b"HSDELTA1" | u64 little-endian header length | header (JSON) | payloads

    header: {"format": "hotswap.delta-file/1", "target": result path, "bytes": result size,
             "base_bytes": base file size or null, "tensors": [[name, dtype, shape, start, end]],
             "chunks": [codec.Chunk.to_list(), ...]}

A safetensors result is cut at its header and at each tensor, so a tensor is compared with the
base tensor of the same name (same dtype and shape, else it is sent full), and a changed header
is a chunk of its own; any other file (config, tokenizer) is compared byte for byte with the
base file of the same path. `tensors` lists the base tensors the chunks read: the rebuild parses
the base's header and refuses a base whose tensor has another dtype, shape or place. The chunks
must tile the result exactly, and each decodes alone, so a pool of threads decodes them at once
(zstd and numpy release the GIL).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from pathlib import Path
from typing import Any

import numpy as np

from daemon.delta.codec import CHUNK_BYTES, Chunk, DeltaError, decode, encode
from daemon.formats import DTYPE_SIZES, HeaderError, SafetensorsHeader, parse_header_bytes

MAGIC = b"HSDELTA1"
FORMAT = "hotswap.delta-file/1"
HEADER_CAP_BYTES = 64 * 1024 * 1024
_PREFIX = len(MAGIC) + 8


def map_file(path: Path) -> np.ndarray:
    """The file's bytes, read-only and mapped (an empty file is an empty array)."""
    size = path.stat().st_size
    if size == 0:
        return np.zeros(0, np.uint8)
    with open(path, "rb") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)


def _safetensors(data: np.ndarray, name: str) -> SafetensorsHeader | None:
    if not name.endswith(".safetensors") or len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8].tobytes())
    if 8 + n > len(data):
        return None
    try:
        return parse_header_bytes(data[: 8 + n].tobytes(), len(data), name)
    except HeaderError:
        return None


def _segments(target: str, new: np.ndarray, base: np.ndarray | None) -> tuple[list[tuple[int, int, int, int]], list[list[Any]]]:
    """[(out start, out end, base start or -1, element size)] tiling `new`, and the base tensors used."""
    whole = [(0, len(new), 0 if base is not None and len(base) == len(new) else -1, 1)]
    head = _safetensors(new, target)
    if head is None:
        return whole, []
    old = _safetensors(base, target) if base is not None else None
    by_name = {t.name: t for t in old.tensors} if old is not None else {}
    segs = [(0, head.data_start, 0 if old is not None and old.data_start == head.data_start else -1, 1)]
    used: list[list[Any]] = []
    for t in head.tensors:
        b = by_name.get(t.name)
        item = DTYPE_SIZES.get(t.dtype, 1)
        if b is not None and b.dtype == t.dtype and b.shape == t.shape:
            segs.append((t.start, t.end, b.start, item))
            used.append([t.name, t.dtype, list(t.shape), b.start, b.end])
        else:
            segs.append((t.start, t.end, -1, item))
    return segs, used


def encode_file(target: str, new: np.ndarray, base: np.ndarray | None, pool: Executor,
                force: str | None = None, chunk_bytes: int = CHUNK_BYTES) -> tuple[bytes, list[bytes], list[Chunk]]:  # fmt: skip
    """(header bytes, payloads in order, chunks) of the delta that rebuilds `new` from `base`."""
    segs, used = _segments(target, new, base)
    jobs: list[tuple[int, int, int, int]] = []
    for start, end, bstart, item in segs:
        step = max(item, chunk_bytes - chunk_bytes % item)
        for off in range(start, end, step):
            n = min(step, end - off)
            jobs.append((off, n, bstart + (off - start) if bstart >= 0 else -1, item))

    def one(job: tuple[int, int, int, int]) -> tuple[str, bytes, int, int, bool]:
        off, n, boff, item = job
        return encode(base[boff : boff + n] if base is not None and boff >= 0 else None, new[off : off + n], item, force)

    chunks: list[Chunk] = []
    payloads: list[bytes] = []
    at = 0
    for (off, n, boff, item), (enc, payload, changed, isize, z) in zip(jobs, pool.map(one, jobs), strict=True):
        chunks.append(Chunk(off, n, enc, boff if enc != "full" else -1, item, at, len(payload), changed, isize, z))
        payloads.append(payload)
        at += len(payload)
    header = {"format": FORMAT, "target": target, "bytes": len(new), "base_bytes": None if base is None else len(base),
              "tensors": used, "chunks": [c.to_list() for c in chunks]}  # fmt: skip
    raw = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<Q", len(raw)) + raw, payloads, chunks


def changed_counts(target: str, new: np.ndarray, base: np.ndarray | None, chunks: list[Chunk]) -> tuple[int, int]:
    """(tensors changed, their elements changed) of one encoded safetensors file; (0, 0) for any other
    file. A tensor with no base tensor of its dtype and shape counts every element as changed."""
    segs, _used = _segments(target, new, base)
    if len(segs) < 2:
        return 0, 0  # not a safetensors file: config, tokenizer
    tensors = elements = 0
    at = 0
    for start, end, bstart, item in segs[1:]:  # [0] is the header
        while at < len(chunks) and chunks[at].out < start:
            at += 1
        n = 0
        while at < len(chunks) and chunks[at].out < end:
            c = chunks[at]
            n += c.length // item if c.enc == "full" and (bstart < 0 or not c.n) and c.length else c.n
            at += 1
        tensors += n > 0
        elements += n
    return tensors, elements


def write_file(path: Path, header: bytes, payloads: list[bytes]) -> int:
    """Write one delta file; returns its size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(header)
        for p in payloads:
            f.write(p)
    return len(header) + sum(len(p) for p in payloads)


def read_header(data: np.ndarray, where: str) -> tuple[dict[str, Any], list[Chunk], int]:
    """(header, chunks, where the payloads start) of a mapped delta file, every field checked."""
    if len(data) < _PREFIX or data[: len(MAGIC)].tobytes() != MAGIC:
        raise DeltaError(f"{where}: not a hotswap delta file (no {MAGIC.decode()} magic)")
    (n,) = struct.unpack("<Q", data[len(MAGIC) : _PREFIX].tobytes())
    if n > HEADER_CAP_BYTES or _PREFIX + n > len(data):
        raise DeltaError(f"{where}: header length {n} is over the cap or past the end of the file")
    try:
        head = json.loads(data[_PREFIX : _PREFIX + n].tobytes())
    except ValueError as exc:
        raise DeltaError(f"{where}: header is not JSON ({str(exc)[:100]})") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise DeltaError(f"{where}: format is not {FORMAT!r}")
    size, base_bytes = head.get("bytes"), head.get("base_bytes")
    if not isinstance(size, int) or size < 0 or not (base_bytes is None or (isinstance(base_bytes, int) and base_bytes >= 0)):
        raise DeltaError(f"{where}: bytes and base_bytes must be non-negative integers")
    if not isinstance(head.get("chunks"), list) or not isinstance(head.get("tensors"), list):
        raise DeltaError(f"{where}: chunks and tensors must be lists")
    chunks = sorted((Chunk.from_list(c, where) for c in head["chunks"]), key=lambda c: c.out)
    payload_bytes = len(data) - _PREFIX - n
    pos = 0
    for c in chunks:
        if c.out != pos:
            raise DeltaError(f"{where}: chunks do not tile the result: a chunk starts at {c.out}, expected {pos}")
        pos += c.length
        if c.at + c.size > payload_bytes:
            raise DeltaError(f"{where}: chunk at {c.out}: its payload runs past the end of the file")
        if c.enc != "full" and (base_bytes is None or c.base + c.length > base_bytes):
            raise DeltaError(f"{where}: chunk at {c.out} reads base bytes past the base's size")
    if pos != size:
        raise DeltaError(f"{where}: chunks cover {pos} bytes, the result has {size}")
    return head, chunks, _PREFIX + n


def check_base(head: dict[str, Any], base: np.ndarray | None, where: str) -> None:
    """The base file is the one the delta was made against: its size and every tensor it reads."""
    if head["base_bytes"] is None:
        return
    if base is None:
        raise DeltaError(f"{where}: needs a base file of {head['base_bytes']} bytes; the base has none")
    if len(base) != head["base_bytes"]:
        raise DeltaError(f"{where}: the base file has {len(base)} bytes, the delta was made against {head['base_bytes']}")
    if not head["tensors"]:
        return
    old = _safetensors(base, str(head.get("target", "")))
    by_name = {t.name: t for t in old.tensors} if old is not None else {}
    for spec in head["tensors"]:
        if not isinstance(spec, list) or len(spec) != 5:
            raise DeltaError(f"{where}: a tensors entry must be [name, dtype, shape, start, end]")
        name, dtype, shape, start, end = spec
        t = by_name.get(name)
        if t is None:
            raise DeltaError(f"{where}: tensor {name!r} is not in the base")
        if (t.dtype, list(t.shape), t.start, t.end) != (dtype, shape, start, end):
            raise DeltaError(f"{where}: tensor {name!r} is {t.dtype} {list(t.shape)} in the base, the delta "
                             f"expects {dtype} {shape}: dtype or size disagrees with the base")  # fmt: skip


class Lent:
    """One buffer of `ChunkBuffers`, lent out: back in the pool once every `hold` was `release`d."""

    __slots__ = ("array", "_owner", "_holds")

    def __init__(self, owner: ChunkBuffers | None, array: np.ndarray) -> None:
        self.array = array
        self._owner = owner
        self._holds = 1

    def hold(self) -> None:
        if self._owner is not None:
            with self._owner._lock:
                self._holds += 1

    def release(self) -> None:
        if self._owner is not None:
            self._owner._release(self)


class ChunkBuffers:
    """Decoded chunks' buffers, reused: a fresh 16 MB array per chunk costs its page faults every
    time (more than the decoding itself). A buffer is lent to one chunk and comes back once
    written and hashed (an in-order hash holds it while it waits its turn), so the pool grows only
    to the chunks in flight: bounded by the callers' windows. A chunk longer than `nbytes` gets an
    array of its own."""

    def __init__(self, nbytes: int = CHUNK_BYTES) -> None:
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._free: list[Lent] = []
        self.made = 0

    def take(self, length: int) -> Lent:
        if length > self.nbytes:
            return Lent(None, np.empty(length, np.uint8))
        with self._lock:
            if self._free:
                lent = self._free.pop()
                lent._holds = 1
                return lent
            self.made += 1
        return Lent(self, np.empty(self.nbytes, np.uint8))

    def _release(self, lent: Lent) -> None:
        with self._lock:
            lent._holds -= 1
            if lent._holds == 0:
                self._free.append(lent)


def rebuild_file(delta: Path, base: np.ndarray | None, out: Path, pool: Executor, where: str,
                 on_chunk: Callable[[Chunk, np.ndarray, Lent], None] | None = None, window: int = 16,
                 buffers: ChunkBuffers | None = None) -> int:  # fmt: skip
    """Write the result file `out` from the delta file and the (mapped) base bytes; returns its size.
    `on_chunk(chunk, result_bytes, lent)` sees each decoded chunk in memory, in the decoding thread
    (`lent.hold()` keeps the bytes past the call: `release()` gives them back). At most `window`
    chunks are in flight (decoded, or parked by an in-order hash behind a slow one), so memory
    stays bounded: `window` x 16 MB. `buffers`: a pool shared with other files decoded at once."""
    data = map_file(delta)
    head, chunks, start = read_header(data, where)
    check_base(head, base, where)
    lend = buffers if buffers is not None else ChunkBuffers()
    # no O_TRUNC: a recycled file (daemon.delta.rebuild) keeps its blocks and cached pages and is
    # overwritten in place; ftruncate makes any file exactly the result's size, and the chunks tile
    # it (read_header), so every byte is written and no stale tail is left
    fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, head["bytes"])

        def one(c: Chunk) -> None:
            lent = lend.take(c.length)
            try:
                buf = lent.array[: c.length]
                b = base[c.base : c.base + c.length] if base is not None and c.base >= 0 else None
                decode(c, b, data[start + c.at : start + c.at + c.size].data, buf, where)
                done = 0
                while done < c.length:  # a short write (a full disk) goes on, or raises
                    done += os.pwrite(fd, buf.data[done:], c.out + done)
                if on_chunk is not None:
                    on_chunk(c, buf, lent)
            finally:
                lent.release()

        flight: deque[Future[None]] = deque()
        try:
            for c in chunks:
                if len(flight) >= max(1, window):
                    flight.popleft().result()
                flight.append(pool.submit(one, c))
            while flight:
                flight.popleft().result()
        except BaseException:
            # no chunk may still write once the descriptor is closed (its number could be reused)
            for f in flight:
                f.cancel()
            wait(flight)
            raise
        # no fsync: 16 GB through the disk would cost seconds on the update's path, and the result is
        # never trusted from disk alone: the checks hash it against the manifest, and every load
        # (disk reload, loader staging) checks the digests again, so bytes torn by a power cut are
        # refused, never served (daemon.delta.rebuild)
        if os.fstat(fd).st_size != head["bytes"]:
            raise DeltaError(f"{where}: {out} is {os.fstat(fd).st_size} bytes after the rebuild, not {head['bytes']}")
    finally:
        os.close(fd)
    return int(head["bytes"])
