"""One chunk of a delta: how a byte range of a result file is rebuilt from the same range of its base.

A chunk is at most `CHUNK_BYTES` of one tensor (or of a safetensors header, or of a non-tensor
file) and is encoded whichever of these is smallest:

    same    the bytes equal the base's: no payload
    sparse  the changed elements: zstd(uint32 gaps between their flat indices) + their new bytes
    xor     zstd(new XOR base)
    full    the new bytes (zstd-compressed when that is smaller): no base needed

Everything works on raw bytes with an element size (1, 2, 4 or 8), so bf16, fp16, fp32 and fp8
all work and a changed element is one whose bytes differ. Decoding is bounded: a zstd frame must
declare exactly the size the chunk says (a frame that would grow past it, a decompression bomb,
is refused before any output is allocated), sparse indices must rise strictly and stay inside
the chunk, and every length must add up. Each failure raises `DeltaError` naming the problem.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard

from daemon.delta.errors import DeltaError

CHUNK_BYTES = 16 * 1024 * 1024  # a unit of parallel decoding (a multiple of every element size)
ZSTD_LEVEL = 1  # fast: an 8B delta is encoded every training step
ENCODINGS = ("same", "sparse", "xor", "full")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True, slots=True)
class Chunk:
    """One encoded chunk: where it goes, how, and where its payload is (relative to the payload area)."""

    out: int  # offset in the result file
    length: int  # result bytes
    enc: str  # one of ENCODINGS
    base: int = -1  # offset in the base file (same, sparse, xor); -1 for full
    item: int = 1  # element size in bytes (sparse indexes elements of this size)
    at: int = 0  # payload offset
    size: int = 0  # payload bytes
    n: int = 0  # changed elements (sparse: the indices that follow; xor, full: informational, 0 unknown)
    isize: int = 0  # sparse: bytes of the compressed index stream (the values follow it)
    z: bool = False  # full: the payload is a zstd frame

    def to_list(self) -> list[object]:
        return [self.out, self.length, self.enc, self.base, self.item, self.at, self.size, self.n, self.isize,
                int(self.z)]  # fmt: skip

    @classmethod
    def from_list(cls, raw: object, where: str) -> Chunk:
        if not isinstance(raw, list) or len(raw) != 10 or not all(
            isinstance(v, int) and not isinstance(v, bool) for i, v in enumerate(raw) if i != 2
        ):
            raise DeltaError(f"{where}: a chunk must be a list of 10 numbers and an encoding, got {str(raw)[:80]}")
        out, length, enc, base, item, at, size, n, isize, z = raw
        if enc not in ENCODINGS:
            raise DeltaError(f"{where}: unknown chunk encoding {enc!r} (known: {', '.join(ENCODINGS)})")
        if item not in _UINT or length < 0 or out < 0 or at < 0 or size < 0 or n < 0 or isize < 0 or z not in (0, 1):
            raise DeltaError(f"{where}: chunk at {out} has a negative or impossible field")
        if length % item:
            raise DeltaError(f"{where}: chunk at {out}: {length} bytes is not a whole number of {item}-byte elements")
        if (enc == "full") != (base < 0):
            raise DeltaError(f"{where}: chunk at {out}: a {enc} chunk {'needs' if enc != 'full' else 'takes no'} base")
        return cls(out, length, enc, base, item, at, size, n, isize, bool(z))


def _compress(data: memoryview | bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(data)


def bounded_decompress(frame: memoryview | bytes, size: int, where: str) -> bytes:
    """The frame's output, which must be exactly `size` bytes; a frame declaring more (or no size) is refused."""
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"{where}: not a zstd frame ({exc})") from None
    if declared != size:
        what = "no size" if declared < 0 else f"{declared} bytes"
        raise DeltaError(f"{where}: zstd frame declares {what}, the delta says {size}: refused (decompression bomb?)")
    try:
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"{where}: zstd frame does not decode ({exc})") from None
    if len(out) != size:
        raise DeltaError(f"{where}: zstd frame gave {len(out)} bytes, expected {size}")
    return out


def encode(base: np.ndarray | None, new: np.ndarray, item: int, force: str | None = None) -> tuple[str, bytes, int, int, bool]:
    """The smallest encoding of `new` (uint8) given `base` (uint8 of the same length, or None).

    Returns (encoding, payload, changed elements, index-stream bytes, payload-is-zstd). `force`
    picks an encoding whatever its size (tests; "same" and "sparse" only where they apply)."""
    if force is not None:
        return _forced(base, new, item, force)
    raw = new.data.cast("B")
    if base is None or len(base) != len(new):
        packed = _compress(raw)
        return ("full", packed, 0, 0, True) if len(packed) < len(new) else ("full", bytes(raw), 0, 0, False)
    x = np.bitwise_xor(base, new)
    if not x.any():
        return "same", b"", 0, 0, False
    best: tuple[str, bytes, int, int, bool] = ("full", bytes(raw), 0, 0, False)
    xz = _compress(x.data)
    if len(xz) < len(best[1]):
        best = ("xor", xz, 0, 0, False)
    changed = np.flatnonzero(x.view(_UINT[item]))
    best = (best[0], best[1], len(changed), 0, False)  # what changed is recorded (daemon.delta.container)
    if len(changed) * item < len(best[1]):  # else the values alone already lose
        gaps = np.diff(changed, prepend=0).astype("<u4")
        index = _compress(gaps.data.cast("B"))
        values = new.view(_UINT[item])[changed].tobytes()
        if len(index) + len(values) < len(best[1]):
            best = ("sparse", index + values, len(changed), len(index), False)
    return best


def _forced(base: np.ndarray | None, new: np.ndarray, item: int, enc: str) -> tuple[str, bytes, int, int, bool]:
    if enc == "full" or base is None or len(base) != len(new):
        return "full", new.tobytes(), 0, 0, False
    x = np.bitwise_xor(base, new)
    changed = np.flatnonzero(x.view(_UINT[item]))
    if enc == "same" or (enc == "sparse" and not len(changed)):
        if len(changed):
            raise ValueError("the bytes differ: 'same' does not apply")
        return "same", b"", 0, 0, False
    if enc == "xor":
        return "xor", _compress(x.data), len(changed), 0, False
    index = _compress(np.diff(changed, prepend=0).astype("<u4").data.cast("B"))
    return "sparse", index + new.view(_UINT[item])[changed].tobytes(), len(changed), len(index), False


def decode(chunk: Chunk, base: np.ndarray | None, payload: memoryview, out: np.ndarray, where: str) -> None:
    """Write the chunk's result bytes into `out` (uint8, chunk.length) from `base` and `payload`."""
    if chunk.enc != "full" and (base is None or len(base) != chunk.length):
        raise DeltaError(f"{where}: chunk at {chunk.out} needs {chunk.length} base bytes")
    if chunk.enc == "same":
        out[:] = base
    elif chunk.enc == "full":
        data = bounded_decompress(payload, chunk.length, where) if chunk.z else payload
        if len(data) != chunk.length:
            raise DeltaError(f"{where}: full chunk at {chunk.out} has {len(data)} bytes, expected {chunk.length}")
        out[:] = np.frombuffer(data, np.uint8)
    elif chunk.enc == "xor":
        assert base is not None
        np.bitwise_xor(base, np.frombuffer(bounded_decompress(payload, chunk.length, where), np.uint8), out=out)
    else:
        _decode_sparse(chunk, base, payload, out, where)


def _decode_sparse(chunk: Chunk, base: np.ndarray | None, payload: memoryview, out: np.ndarray, where: str) -> None:
    elements = chunk.length // chunk.item
    if not 0 < chunk.n <= elements:
        raise DeltaError(f"{where}: sparse chunk at {chunk.out} changes {chunk.n} of {elements} elements")
    if chunk.isize + chunk.n * chunk.item != len(payload):
        raise DeltaError(f"{where}: sparse chunk at {chunk.out}: {len(payload)} payload bytes do not hold "
                         f"{chunk.n} values of {chunk.item} bytes after a {chunk.isize}-byte index")  # fmt: skip
    gaps = np.frombuffer(bounded_decompress(payload[: chunk.isize], chunk.n * 4, where), "<u4")
    if chunk.n > 1 and not gaps[1:].all():
        raise DeltaError(f"{where}: sparse chunk at {chunk.out}: an element index is repeated")
    index = np.cumsum(gaps, dtype=np.int64)
    if index[-1] >= elements:
        raise DeltaError(f"{where}: sparse chunk at {chunk.out}: element index {int(index[-1])} is out of range "
                         f"(the chunk has {elements})")  # fmt: skip
    values = np.frombuffer(payload[chunk.isize :], _UINT[chunk.item])
    out[:] = base
    out.view(_UINT[chunk.item])[index] = values
