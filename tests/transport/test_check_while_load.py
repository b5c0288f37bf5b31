"""Check while loading, disk transport: every byte read is hashed and compared with the verified digests.

Real safetensors files (tiny random Llama checkpoints); the reference is computed from the bytes
before the damage, exactly as the verify stage records it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support_check import expect_of, flip_byte

from daemon.formats.checkpoint import tensor_table, weight_files
from daemon.formats.safetensors import HeaderError
from daemon.tinymodel import make_tiny_checkpoint
from daemon.transport.base import BadUpdateRequest, Expect, ExpectedFile, TransportError, check_table
from daemon.transport.disk import DiskTransport

pytestmark = pytest.mark.quick


def params_like(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(directory):
        out.update({n: torch.full_like(t, 7.0) for n, t in load_file(f).items()})
    return out


def first_tensor_byte(directory: Path) -> tuple[Path, int]:
    table, _ = tensor_table(directory)
    loc = min(table.values(), key=lambda x: (str(x.file), x.entry.start))
    return loc.file, loc.entry.start + loc.entry.nbytes // 2


@pytest.mark.parametrize(("staged", "chunk", "shards"), [(None, 32 << 20, 1), (True, 4096, 3), (True, 10_000, 2), (False, 4096, 3)])
@pytest.mark.parametrize("alg", ["blake3", "sha256"])
def test_matching_bytes_load_and_say_checked(tmp_path: Path, staged: bool | None, chunk: int, shards: int, alg: str) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=1, shards=shards)
    params = params_like(d)
    tr = DiskTransport(d, staged=staged, chunk_bytes=chunk, readers=3, expect=expect_of(d, alg))
    check_table(tr.table(), params)
    tr.write_into(params)
    st = tr.stats()
    assert st["checked_files"] == shards and st["check_alg"] == alg and st["check_weak"] is False
    for f in weight_files(d):
        for n, t in load_file(f).items():
            assert torch.equal(params[n], t), n


@pytest.mark.parametrize(("staged", "chunk"), [(None, 32 << 20), (True, 4096), (False, 4096)])
def test_a_byte_flipped_after_verify_is_refused(tmp_path: Path, staged: bool | None, chunk: int) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=2, shards=2)
    expect = expect_of(d)
    file, off = first_tensor_byte(d)
    flip_byte(file, off)
    tr = DiskTransport(d, staged=staged, chunk_bytes=chunk, readers=3, expect=expect)
    params = params_like(d)
    with pytest.raises(TransportError, match="does not match the verified .*changed since it was verified"):
        tr.write_into(params)


def test_a_changed_header_byte_is_refused(tmp_path: Path) -> None:
    """The header is hashed too (read by the hasher itself: no chunk covers it)."""
    d = make_tiny_checkpoint(tmp_path / "c", seed=3)
    expect = expect_of(d)
    (f,) = weight_files(d)
    raw = f.read_bytes()
    assert b'"format":"pt"' in raw[:200]
    data = raw.replace(b'"format":"pt"', b'"format":"px"', 1)  # still a valid header, same length
    f.write_bytes(data)
    with pytest.raises(TransportError, match="does not match the verified"):
        DiskTransport(d, expect=expect).write_into(params_like(d))


def test_a_grown_file_or_an_unlisted_file_is_refused_before_any_write(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=4, shards=2)
    expect = expect_of(d)
    params = params_like(d)
    before = {n: p.clone() for n, p in params.items()}
    files = weight_files(d)
    with open(files[0], "ab") as fh:
        fh.write(b"\0")
    with pytest.raises((TransportError, HeaderError), match="does not match header|bytes now, .* verified"):
        DiskTransport(d, expect=expect).write_into(params)
    assert all(torch.equal(params[n], before[n]) for n in params), "written although refused"
    with open(files[0], "r+b") as fh:
        fh.truncate(files[0].stat().st_size - 1)
    short = Expect(files=tuple(f for f in expect.files if f.path != files[1].name))
    with pytest.raises(TransportError, match="no verified digest for this file"):
        DiskTransport(d, expect=short).write_into(params)


def test_crc_only_reference_is_checked_and_reported_weak(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=5)
    tr = DiskTransport(d, expect=expect_of(d, crc_only=True))
    tr.write_into(params_like(d))
    assert tr.stats()["check_weak"] is True and tr.stats()["check_alg"] == "crc32c"
    file, off = first_tensor_byte(d)
    flip_byte(file, off)
    with pytest.raises(TransportError, match="crc32c"):
        DiskTransport(d, expect=tr.expect).write_into(params_like(d))


def test_check_on_without_digests_is_a_bad_request(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "c", seed=6)
    with pytest.raises(BadUpdateRequest, match="expect.files"):
        DiskTransport(d, check=True, expect=Expect(files=(ExpectedFile("x", 1, {}),)))
    tr = DiskTransport(d, check=False, expect=expect_of(d))
    file, off = first_tensor_byte(d)
    flip_byte(file, off)
    tr.write_into(params_like(d))  # off means off: benchmarks compare the two
    assert "checked_files" not in tr.stats()
