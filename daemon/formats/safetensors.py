"""Strict safetensors header parsing, shared by checks, the disk transport and the loader.

Only the header is read: 8 bytes of little-endian length, then that many bytes of
JSON. Every rule safetensors' own parser enforces is enforced here too, plus the
ones it leaves to the reader (exact file length, contiguity), so that a file
that passes can be read by offsets without further checks.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

HEADER_CAP_BYTES = 100 * 1024 * 1024  # safetensors' own limit

# bytes per element; the names are safetensors' dtype strings
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
FLOAT_DTYPES = frozenset({"F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64"})


class HeaderError(ValueError):
    """A safetensors file whose header breaks a rule; the message names file and tensor."""


_U64 = 1 << 64


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # json.loads keeps the last of repeated keys silently; a header naming a tensor twice is ambiguous
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _q(value: object, limit: int = 120) -> str:
    """repr() for messages, cut short: a hostile header can hold 100 MB names."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def _short(exc: BaseException, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."


def _short_shape(shape: list[int]) -> str:
    return str(shape) if len(shape) <= 8 else f"[{', '.join(map(str, shape[:8]))}, ... {len(shape)} dims]"


def _nbytes(shape: list[int], itemsize: int, limit: int) -> int | None:
    """Bytes the shape needs, or None once it exceeds `limit` (never builds a huge product)."""
    if 0 in shape:
        return 0
    total = itemsize
    for d in shape:
        total *= d
        if total > limit:
            return None
    return total


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int  # absolute, exclusive

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    path: Path
    header_len: int
    data_start: int  # 8 + header_len
    file_size: int
    metadata: dict[str, str]
    tensors: tuple[TensorEntry, ...]  # sorted by start offset

    @property
    def data_bytes(self) -> int:
        return self.file_size - self.data_start


def parse_header_bytes(
    raw: bytes, file_size: int, path: Path | str = "<bytes>", cap: int = HEADER_CAP_BYTES
) -> SafetensorsHeader:
    """Validate a header given the first bytes of a file (at least 8 + header length)."""
    where = str(path)
    if len(raw) < 8:
        raise HeaderError(f"{where}: file too short for a safetensors header ({file_size} bytes)")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > cap:
        raise HeaderError(f"{where}: header length {n} exceeds the cap of {cap} bytes")
    if 8 + n > file_size:
        raise HeaderError(f"{where}: header length {n} runs past the end of the file ({file_size} bytes)")
    if len(raw) < 8 + n:
        raise HeaderError(f"{where}: only {len(raw) - 8} of {n} header bytes given")
    body = raw[8 : 8 + n]
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"{where}: header is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as exc:
        raise HeaderError(f"{where}: header names {_q(exc.key)} twice") from None
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and ints longer than Python's digit limit
        raise HeaderError(f"{where}: header is not valid JSON ({_short(exc)})") from None
    if not isinstance(doc, dict):
        raise HeaderError(f"{where}: header is not a JSON object")

    metadata: dict[str, str] = {}
    entries: list[TensorEntry] = []
    data_start = 8 + n
    data_len = file_size - data_start
    for name, spec in doc.items():
        if name == "__metadata__":
            if spec is None:  # safetensors accepts an explicit null
                continue
            if not isinstance(spec, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in spec.items()
            ):
                raise HeaderError(f"{where}: __metadata__ must map strings to strings")
            metadata = dict(spec)
            continue
        entries.append(_parse_entry(where, name, spec, data_start, data_len))

    entries.sort(key=lambda e: (e.start, e.end))
    cursor = data_start
    prev: TensorEntry | None = None
    for e in entries:
        if e.start < cursor:
            assert prev is not None
            raise HeaderError(
                f"{where}: tensor {_q(e.name)} (data_offsets [{e.start - data_start}, {e.end - data_start}]) "
                f"overlaps tensor {_q(prev.name)} ([{prev.start - data_start}, {prev.end - data_start}])"
            )
        if e.start > cursor:
            raise HeaderError(f"{where}: gap of {e.start - cursor} bytes before tensor {_q(e.name)}")
        cursor = e.end
        prev = e
    if cursor != file_size:
        raise HeaderError(f"{where}: file length {file_size} does not match header + data ({cursor} bytes)")
    return SafetensorsHeader(
        path=Path(path),
        header_len=n,
        data_start=data_start,
        file_size=file_size,
        metadata=metadata,
        tensors=tuple(entries),
    )


def _parse_entry(where: str, name: str, spec: object, data_start: int, data_len: int) -> TensorEntry:
    if not name:
        raise HeaderError(f"{where}: a tensor has an empty name")
    if not isinstance(spec, dict):
        raise HeaderError(f"{where}: tensor {_q(name)}: entry is not an object")
    extra = set(spec) - {"dtype", "shape", "data_offsets"}
    if extra:
        raise HeaderError(f"{where}: tensor {_q(name)}: unknown fields {_q(sorted(extra))}")
    dtype = spec.get("dtype")
    shape = spec.get("shape")
    offsets = spec.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise HeaderError(f"{where}: tensor {_q(name)}: unknown dtype {_q(dtype)}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < _U64 for d in shape
    ):
        raise HeaderError(f"{where}: tensor {_q(name)}: shape must be a list of integers in [0, 2**64)")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and 0 <= o < _U64 for o in offsets)
    ):
        raise HeaderError(f"{where}: tensor {_q(name)}: data_offsets must be two integers in [0, 2**64)")
    begin, end = offsets
    if begin > end:
        raise HeaderError(f"{where}: tensor {_q(name)}: data_offsets begin {begin} > end {end}")
    if end > data_len:
        raise HeaderError(
            f"{where}: tensor {_q(name)}: data_offsets end {end} is past the data section ({data_len} bytes)"
        )
    need = _nbytes(shape, DTYPE_SIZES[dtype], data_len)
    if need is None:
        raise HeaderError(
            f"{where}: tensor {_q(name)}: {dtype}{_short_shape(shape)} needs more bytes than the "
            f"whole data section ({data_len})"
        )
    if need != end - begin:
        raise HeaderError(
            f"{where}: tensor {_q(name)}: {dtype}{_short_shape(shape)} needs {need} bytes, "
            f"offsets span {end - begin}"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def read_header(path: str | os.PathLike[str], cap: int = HEADER_CAP_BYTES) -> SafetensorsHeader:
    """Read and validate the header of a safetensors file without reading tensor data.

    Raises HeaderError for a bad header or a path that is not a regular file (a FIFO
    would block, a device never ends), OSError (e.g. FileNotFoundError) when unreadable.
    At most 8 + min(cap, file size) bytes are read.
    """
    p = Path(path)
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise HeaderError(f"{p}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb", buffering=0) as f:
        size = st.st_size
        head = _read_exact(f, 8)
        if len(head) < 8:
            raise HeaderError(f"{p}: file too short for a safetensors header ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > cap:
            raise HeaderError(f"{p}: header length {n} exceeds the cap of {cap} bytes")
        if 8 + n > size:
            raise HeaderError(f"{p}: header length {n} runs past the end of the file ({size} bytes)")
        body = _read_exact(f, n)
    return parse_header_bytes(head + body, size, p, cap)


def _read_exact(f: io.RawIOBase, n: int) -> bytes:
    chunks: list[bytes] = []
    left = n
    while left > 0:
        chunk = f.read(left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
