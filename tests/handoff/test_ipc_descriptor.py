"""The IPC descriptor is the only thing that crosses from loader to worker: every rule is enforced."""

from __future__ import annotations

import base64
import contextlib
import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.handoff.descriptor import (
    ALIGN,
    BufferRef,
    Descriptor,
    DescriptorError,
    layout_tensors,
    parse_descriptor,
)

pytestmark = pytest.mark.quick


def make_doc(kind: str = "shm") -> dict[str, Any]:
    slots, size = layout_tensors(
        [("a.weight", "F32", (4, 3)), ("b.bias", "BF16", (5,)), ("c.idx", "I64", (2, 2)), ("d.empty", "F16", (0, 8))]
    )
    if kind == "shm":
        buf = BufferRef("host", size + ALIGN, ALIGN, path="/dev/shm/hotswap-1-1-v1")
    else:
        buf = BufferRef("GPU-5f0c1a2b-0000-1111-2222-333344445555", size, 0, handle=bytes(range(64)))
    return Descriptor("v1", kind, size, slots, (buf,), "0a1b2c3d", "/run/hotswap/loader.sock").to_json()  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["shm", "cuda"])
def test_round_trip_through_json(kind: str) -> None:
    doc = make_doc(kind)
    parsed = parse_descriptor(json.loads(json.dumps(doc)))
    assert parsed.to_json() == doc
    assert parsed.table()["a.weight"].nbytes == 48
    assert all(t.offset % ALIGN == 0 for t in parsed.tensors)


@pytest.mark.parametrize("digest", ["blake3:" + "ab" * 32, "sha256:" + "0" * 64, "0a1b2c3d", None])
def test_content_digests_of_both_manifest_formats_are_accepted(digest: str | None) -> None:
    doc = {**make_doc(), "digest": digest}
    assert parse_descriptor(doc).digest == digest


def _mutate(doc: dict[str, Any], path: list[Any], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    target = out
    for k in path[:-1]:
        target = target[k]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return out


BAD: list[tuple[str, list[Any], Any, str]] = [
    ("unaligned offset", ["tensors", 1, "offset"], 260, "not 256-byte aligned"),
    ("offset past payload", ["tensors", 0, "offset"], 1 << 20, "run past the payload size"),
    ("wrong byte count", ["tensors", 0, "bytes"], 40, "needs 48 bytes"),
    ("unknown dtype", ["tensors", 0, "dtype"], "F128", "unknown dtype 'F128'"),
    ("negative dim", ["tensors", 0, "shape"], [4, -3], "shape[1]"),
    ("bool as int", ["tensors", 0, "offset"], False, "must be an integer"),
    ("float offset", ["tensors", 0, "offset"], 0.0, "must be an integer"),
    ("missing field", ["tensors", 0, "bytes"], KeyError, "missing fields ['bytes']"),
    ("extra tensor field", ["tensors", 0, "stride"], [1], "unknown fields ['stride']"),
    ("extra top field", ["pickle"], "gASV", "unknown fields ['pickle']"),
    ("wrong format", ["format"], "hotswap.ipc/0", "is not 'hotswap.ipc/1'"),
    ("unknown kind", ["kind"], "nvlink", "kind 'nvlink'"),
    ("bad digest", ["digest"], "XYZ", "8 lowercase hex"),
    ("unknown digest algorithm", ["digest"], "md5:" + "0" * 32, "<blake3|sha256>:<64 hex>"),
    ("relative loader", ["loader"], "loader.sock", "absolute path"),
    ("empty version", ["version"], "", "non-empty"),
    ("no tensors", ["tensors"], [], "1 to"),
    ("payload past buffer", ["buffers", 0, "buffer_bytes"], 100, "runs past the buffer"),
    ("unaligned buffer offset", ["buffers", 0, "offset"], 8, "not 256-byte aligned"),
    ("relative shm path", ["buffers", 0, "path"], "dev/shm/hotswap-1", "absolute, normalised"),
    ("dotdot shm path", ["buffers", 0, "path"], "/dev/shm/../etc/hotswap-x", "absolute, normalised"),
    ("foreign shm file", ["buffers", 0, "path"], "/etc/passwd", "not a hotswap segment"),
    ("shm on a GPU", ["buffers", 0, "device_uuid"], "GPU-1", "must be 'host'"),
    ("cuda field in shm", ["buffers", 0, "handle"], "AAAA", "unknown fields ['handle']"),
]


@pytest.mark.parametrize(("what", "path", "value", "message"), BAD, ids=[b[0] for b in BAD])
def test_rejects_with_a_reason(what: str, path: list[Any], value: Any, message: str) -> None:
    with pytest.raises(DescriptorError, match=None) as err:
        parse_descriptor(_mutate(make_doc("shm"), path, value))
    assert message in str(err.value), str(err.value)


def test_rejects_overlap_and_duplicates() -> None:
    doc = make_doc()
    doc["tensors"][1]["offset"] = 0  # b.bias now sits on top of a.weight
    with pytest.raises(DescriptorError, match="overlaps"):
        parse_descriptor(doc)
    doc = make_doc()
    doc["tensors"][1]["name"] = "a.weight"
    with pytest.raises(DescriptorError, match="appears twice"):
        parse_descriptor(doc)


@pytest.mark.parametrize(
    ("handle", "message"),
    [("!!notbase64!!", "not valid base64"), (base64.b64encode(b"x" * 63).decode(), "has 63 bytes")],
)
def test_rejects_bad_cuda_handles(handle: str, message: str) -> None:
    doc = make_doc("cuda")
    doc["buffers"][0]["handle"] = handle
    with pytest.raises(DescriptorError, match=message):
        parse_descriptor(doc)
    doc = make_doc("cuda")
    doc["buffers"][0]["device_uuid"] = "host"
    with pytest.raises(DescriptorError, match="not a GPU UUID"):
        parse_descriptor(doc)


def test_missing_device_is_named() -> None:
    parsed = parse_descriptor(make_doc("cuda"))
    with pytest.raises(DescriptorError, match="no buffer on device GPU-other"):
        parsed.buffer_for("GPU-other")


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_paths = st.sampled_from(
    [["tensors", 0, "shape"], ["tensors", 2, "offset"], ["tensors", 1], ["buffers", 0], ["buffers"], ["size"],
     ["tensors", 3, "bytes"], ["version"], ["tensors", 0, "name"], ["buffers", 0, "buffer_bytes"]]
)


@settings(max_examples=300, deadline=None)
@given(path=_paths, value=_json)
def test_fuzzed_fields_fail_only_with_descriptor_error(path: list[Any], value: Any) -> None:
    with contextlib.suppress(DescriptorError):
        parse_descriptor(_mutate(make_doc(), path, value))
