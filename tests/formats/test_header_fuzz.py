"""Property tests for the safetensors header validator: hostile bytes only ever raise HeaderError.

Three generators, 10,500 examples together: structured-random JSON headers, raw byte
mutations of valid files, and real files through read_header. For every example:
no exception other than HeaderError, a per-example deadline (no hang), bounded
allocation (tracemalloc), and when our validator accepts, the safetensors library
accepts too and agrees on every tensor (we are at least as strict as it is).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tracemalloc
from datetime import timedelta
from pathlib import Path

import pytest
import safetensors
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from daemon.formats.safetensors import (
    DTYPE_SIZES,
    HEADER_CAP_BYTES,
    HeaderError,
    SafetensorsHeader,
    parse_header_bytes,
    read_header,
)

DEADLINE = timedelta(seconds=10)  # one example takes well under a millisecond; this only catches hangs (a loaded CI box stalls for seconds)
COMMON = dict(
    deadline=DEADLINE,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
    database=None,
)
MEMORY_SLACK = 512 * 1024  # fixed allowance per example, on top of a multiple of the input size
MEMORY_PER_INPUT_BYTE = 64  # parsed JSON costs a small multiple of its text


class _PeakAllocation:
    """Bytes allocated at the peak of the block; tracing is on only inside it (hypothesis stays fast)."""

    def __enter__(self) -> _PeakAllocation:
        tracemalloc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        _, self.peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()


def assert_bounded(peak: int, input_len: int) -> None:
    assert peak <= MEMORY_SLACK + MEMORY_PER_INPUT_BYTE * input_len, (
        f"validator allocated {peak} bytes for a {input_len}-byte input"
    )


def validate(raw: bytes, file_size: int | None = None) -> SafetensorsHeader | None:
    """Run the validator under the properties every example must hold."""
    size = len(raw) if file_size is None else file_size
    header = None
    with _PeakAllocation() as mem:
        try:
            header = parse_header_bytes(raw, size)
        except HeaderError as exc:
            assert str(exc)  # every rejection says why
    assert_bounded(mem.peak, len(raw))
    event("accepted" if header is not None else "rejected")  # --hypothesis-show-statistics shows the mix
    if header is not None and file_size is None:
        agree_with_safetensors(raw, header)
    return header


def agree_with_safetensors(raw: bytes, header: SafetensorsHeader) -> None:
    """Whatever we accept, the reference parser accepts, with identical names, dtypes and shapes."""
    theirs = {
        name: (spec["dtype"].upper(), tuple(spec["shape"])) for name, spec in safetensors.deserialize(raw)
    }
    ours = {e.name: (e.dtype, e.shape) for e in header.tensors}
    assert {k: v[1] for k, v in theirs.items()} == {k: v[1] for k, v in ours.items()}
    # covered exactly: contiguous, in bounds, file length exact
    cursor = header.data_start
    for e in header.tensors:
        assert e.start == cursor and e.nbytes == e.numel * DTYPE_SIZES[e.dtype]
        cursor = e.end
    assert cursor == header.file_size == len(raw)


# ---------------------------------------------------------------- structured-random headers

dims = st.one_of(st.integers(0, 5), st.integers(0, 2**64 + 5), st.sampled_from([-1, 2**63, 2**64 - 1]))
dtypes = st.one_of(
    st.sampled_from(sorted(DTYPE_SIZES)), st.sampled_from(["F4", "f32", "", "C64"]), st.integers()
)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def structured_file(draw: st.DrawFn) -> bytes:
    """A header built tensor by tensor: usually consistent, then bent by one or more random choices."""
    n_tensors = draw(st.integers(0, 6))
    header: dict[str, object] = {}
    cursor = 0
    for i in range(n_tensors):
        dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        nbytes = DTYPE_SIZES[dtype]
        for d in shape:
            nbytes *= d
        offsets: object = [cursor, cursor + nbytes]
        entry: dict[str, object] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        # each field has a small chance to be replaced by something hostile
        if draw(st.integers(0, 9)) == 0:
            entry["dtype"] = draw(dtypes)
        if draw(st.integers(0, 9)) == 0:
            entry["shape"] = draw(st.one_of(st.lists(dims, max_size=5), json_values))
        if draw(st.integers(0, 9)) == 0:
            entry["data_offsets"] = draw(
                st.one_of(st.lists(st.integers(-3, cursor + nbytes + 8), min_size=0, max_size=3), json_values)
            )
        if draw(st.integers(0, 19)) == 0:
            entry[draw(st.text(max_size=5))] = draw(json_values)
        name = draw(st.one_of(st.just(f"t{i}"), st.text(max_size=6)))
        header[name] = entry if draw(st.integers(0, 19)) else draw(json_values)
        cursor += nbytes
    if draw(st.booleans()):
        header["__metadata__"] = draw(
            st.one_of(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3), json_values)
        )
    text = json.dumps(header)
    if draw(st.integers(0, 9)) == 0:  # duplicate a key by hand (json.dumps cannot)
        text = text.replace("{", '{"t0": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, ', 1)
    body = text.encode()
    body += b" " * draw(st.integers(0, 8))
    data_len = cursor + draw(st.sampled_from([0] * 8 + [1, -1]))
    declared = len(body) + draw(st.sampled_from([0] * 12 + [1, -1, 2**40, 2**64 - 1 - len(body)]))
    declared = max(0, min(declared, 2**64 - 1))
    return struct.pack("<Q", declared) + body + b"\0" * max(0, data_len)


@settings(max_examples=5000, **COMMON)
@given(structured_file())
def test_structured_random_headers_only_raise_header_error(raw: bytes) -> None:
    validate(raw)


# ---------------------------------------------------------------- byte mutations of valid files


def _valid_files() -> list[bytes]:
    files = []
    specs = [
        {"a": ("F32", [2, 3]), "b": ("BF16", [4]), "c": ("I64", [1])},
        {"w": ("F16", [0]), "x": ("U8", [5]), "__metadata__": {"format": "pt"}},
        {"only": ("F8_E4M3", [3, 2])},
        {},
    ]
    for spec in specs:
        header: dict[str, object] = {}
        cursor = 0
        for name, value in spec.items():
            if name == "__metadata__":
                header[name] = value
                continue
            dtype, shape = value
            n = DTYPE_SIZES[dtype]
            for d in shape:
                n *= d
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + n]}
            cursor += n
        body = json.dumps(header).encode()
        files.append(struct.pack("<Q", len(body)) + body + os.urandom(cursor))
    return files


VALID = _valid_files()


@st.composite
def mutated_file(draw: st.DrawFn) -> bytes:
    raw = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(
            st.sampled_from(["flip", "set", "insert", "delete", "truncate", "length", "extend", "splice"])
        )
        pos = draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and raw:
            raw[pos] = draw(
                st.sampled_from([0x00, 0x22, 0x2C, 0x3A, 0x5B, 0x5D, 0x7B, 0x7D, 0x30, 0x39, 0xFF, 0xC3])
            )
        elif op == "insert":
            raw[pos:pos] = draw(st.binary(min_size=1, max_size=6))
        elif op == "delete":
            del raw[pos : pos + draw(st.integers(1, 6))]
        elif op == "truncate":
            del raw[pos:]
        elif op == "length" and len(raw) >= 8:
            value = draw(
                st.one_of(
                    st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63, 2**64 - 1, HEADER_CAP_BYTES + 1])
                )
            )
            raw[:8] = struct.pack("<Q", value)
        elif op == "extend":
            raw += b"\0" * draw(st.integers(1, 16))
        elif op == "splice":
            other = draw(st.sampled_from(VALID))
            cut = draw(st.integers(0, len(other)))
            raw[pos:] = other[cut:]
    return bytes(raw)


@settings(max_examples=5000, **COMMON)
@given(mutated_file())
def test_byte_mutations_of_valid_files_only_raise_header_error(raw: bytes) -> None:
    validate(raw)


# ---------------------------------------------------------------- through the file reader


@settings(max_examples=500, **COMMON)
@given(st.one_of(mutated_file(), structured_file()))
def test_read_header_on_files_only_raises_header_error(
    tmp_path_factory: pytest.TempPathFactory, raw: bytes
) -> None:
    path = tmp_path_factory.getbasetemp() / "fuzz.safetensors"
    path.write_bytes(raw)
    h = None
    with _PeakAllocation() as mem, contextlib.suppress(HeaderError):
        h = read_header(path)
    assert_bounded(mem.peak, len(raw))
    if h is not None:
        assert h.file_size == len(raw)


# ---------------------------------------------------------------- named hostile inputs


def _file(header_text: bytes, data: bytes = b"", declared: int | None = None) -> bytes:
    return struct.pack("<Q", len(header_text) if declared is None else declared) + header_text + data


@pytest.mark.parametrize(
    "raw,message",
    [
        (_file(b"{}", declared=2**64 - 1), "exceeds the cap"),
        (_file(b"{}", declared=HEADER_CAP_BYTES), "runs past the end"),
        (
            _file(b'{"a": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 1]}}', b"x"),
            "not valid JSON",
        ),
        (_file(b"[" * 100_000 + b"]" * 100_000), "not valid JSON"),
        (
            _file(
                b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {"dtype": "U8", "shape": [1], '
                b'"data_offsets": [0, 1]}}',
                b"x",
            ),
            "names 'a' twice",
        ),
        (
            _file(
                json.dumps(
                    {"a": {"dtype": "U8", "shape": [2**63] * 20_000, "data_offsets": [0, 1]}}
                ).encode(),
                b"x",
            ),
            "needs more bytes than the whole data section",
        ),
        (
            _file(json.dumps({"": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}).encode(), b"x"),
            "empty name",
        ),
        (
            _file(json.dumps({"a": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}).encode(), b"xyz"),
            "gap of 1",
        ),
        (
            _file(json.dumps({"a" * 10**6: {"dtype": "X", "shape": [], "data_offsets": [0, 0]}}).encode()),
            "unknown dtype",
        ),
        (_file(b"\xff\xfe{}"), "not valid UTF-8"),
    ],
    ids=[
        "huge-length",
        "length-past-end",
        "5000-digit-int",
        "deep-nesting",
        "duplicate-name",
        "huge-shape-product",
        "empty-name",
        "gap",
        "megabyte-name",
        "not-utf8",
    ],
)
def test_named_hostile_headers_are_rejected_quickly_with_a_reason(raw: bytes, message: str) -> None:
    with pytest.raises(HeaderError, match=message) as info:
        parse_header_bytes(raw, len(raw))
    assert len(str(info.value)) < 1000  # a megabyte name is not echoed back whole


def test_null_metadata_is_accepted_like_the_safetensors_library_does() -> None:
    raw = _file(
        json.dumps(
            {"__metadata__": None, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
        ).encode(),
        b"x",
    )
    assert [e.name for e in parse_header_bytes(raw, len(raw)).tensors] == ["a"]


def test_read_header_refuses_fifos_and_directories_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(HeaderError, match="not a regular file"):
        read_header(fifo)  # a blocking open would hang this test until pytest-timeout
    with pytest.raises(HeaderError, match="not a regular file"):
        read_header(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_header(tmp_path / "absent.safetensors")
