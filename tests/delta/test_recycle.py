"""A rebuild over a stale rebuilt directory's files (daemon.delta.rebuild `recycle`): the files of the
result's paths and sizes are overwritten in place (same inode), whatever they held; the rest of that
directory is deleted, and the directory itself is gone afterwards, on success and on failure.

Real safetensors files (the tiny model in two shards, one training-like step), the real publisher.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import publish_tiny
from support_delta import step

from daemon.bytepipe import hash_files
from daemon.client import publish_delta
from daemon.delta import DeltaError
from daemon.delta.container import map_file, rebuild_file
from daemon.delta.rebuild import rebuild_delta
from daemon.delta.section import DeltaSpec, parse
from daemon.formats import MANIFEST_NAME
from daemon.manifest import Manifest, load_manifest

pytestmark = pytest.mark.quick


def _delta(tmp_path: Path) -> tuple[Path, Path, Path, Manifest, DeltaSpec]:
    base, new, out = tmp_path / "v1", tmp_path / "v2", tmp_path / "watch" / "v2"
    publish_tiny(base, seed=1, shards=2)
    step(base, new, 1e-4, 2, share=0.3)
    publish_delta(new, base, out)
    m = load_manifest(out)
    spec = parse(m, "t")
    assert spec is not None and len(spec.files) == 2
    return base, new, out, m, spec


def _garbage(path: Path, size: int, seed: int) -> int:
    """A file of `size` random bytes; its inode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    return path.stat().st_ino


def test_a_stale_directory_of_the_same_layout_is_overwritten_in_place_and_the_result_verified(tmp_path: Path) -> None:
    """Every rebuilt file of the stale directory holds other bytes of the same size: the result is the
    trainer's bytes exactly, hashed in memory against the manifest and on disk against it again, in
    the stale files' own inodes; the stale directory's other files are gone with it."""
    base, new, out, m, spec = _delta(tmp_path)
    root = tmp_path / "deltas"
    stale = root / "v0"
    sizes = {f.path: f.bytes for f in m.files}
    inodes = {d.target: _garbage(stale / d.target, sizes[d.target], i) for i, d in enumerate(spec.files)}
    (stale / MANIFEST_NAME).write_text("{}")  # not a rebuilt file: deleted, the delta's manifest copied in
    _garbage(stale / "extra" / "junk.bin", 4096, 9)  # in no result: deleted
    r = rebuild_delta(out, m, spec, base, {f.path: f for f in load_manifest(base).files}, root / "v2", recycle=stale)
    assert not stale.exists()
    assert sorted(p.name for p in root.iterdir()) == ["v2"]  # no temporary folder, nothing else left
    assert {t: (r.directory / t).stat().st_ino for t in inodes} == inodes  # the very files, overwritten
    assert r.recycled_bytes == sum(sizes[t] for t in inodes)
    assert sorted(p.relative_to(r.directory).as_posix() for p in r.directory.rglob("*") if p.is_file()) == sorted(
        [*sizes, MANIFEST_NAME])  # fmt: skip
    assert all((r.directory / f.path).read_bytes() == (new / f.path).read_bytes() for f in m.files)
    for f, digest in zip(m.files, hash_files([r.directory / f.path for f in m.files], alg=m.hash_alg or "blake3"),
                         strict=True):  # fmt: skip
        digest.check(f, f.path)


def test_files_of_another_size_or_shared_with_another_name_are_never_overwritten(tmp_path: Path) -> None:
    """A stale file one byte longer than the result is deleted, never reused; a file with a second
    hard link (overwriting it would change the other name's bytes too) is deleted as a name only:
    the other name keeps its bytes."""
    base, new, out, m, spec = _delta(tmp_path)
    root = tmp_path / "deltas"
    stale = root / "v0"
    sizes = {f.path: f.bytes for f in m.files}
    longer, linked = spec.files[0].target, spec.files[1].target
    _garbage(stale / longer, sizes[longer] + 1, 1)
    _garbage(tmp_path / "elsewhere.bin", sizes[linked], 2)
    os.link(tmp_path / "elsewhere.bin", stale / linked)
    kept = (tmp_path / "elsewhere.bin").read_bytes()
    r = rebuild_delta(out, m, spec, base, {f.path: f for f in load_manifest(base).files}, root / "v2", recycle=stale)
    assert r.recycled_bytes == 0 and not stale.exists()
    assert (tmp_path / "elsewhere.bin").read_bytes() == kept
    assert (r.directory / linked).stat().st_ino != (tmp_path / "elsewhere.bin").stat().st_ino
    assert all((r.directory / f.path).read_bytes() == (new / f.path).read_bytes() for f in m.files)


def test_a_stale_directory_already_gone_means_fresh_files(tmp_path: Path) -> None:
    """Retention (or another rebuild) took it between the choice and the rebuild: nothing to recycle."""
    base, new, out, m, spec = _delta(tmp_path)
    r = rebuild_delta(out, m, spec, base, {f.path: f for f in load_manifest(base).files}, tmp_path / "d" / "v2",
                      recycle=tmp_path / "d" / "gone")  # fmt: skip
    assert r.recycled_bytes is None
    assert all((r.directory / f.path).read_bytes() == (new / f.path).read_bytes() for f in m.files)


def test_a_failure_after_the_stale_directory_was_taken_leaves_nothing(tmp_path: Path) -> None:
    """The decoded result differs from the manifest (a lying result hash): refused mid-rebuild; no
    result, no temporary folder, and the stale directory is not left half-present under its name."""
    base, _new, out, m, spec = _delta(tmp_path)
    root = tmp_path / "deltas"
    stale = root / "v0"
    sizes = {f.path: f.bytes for f in m.files}
    for i, d in enumerate(spec.files):
        _garbage(stale / d.target, sizes[d.target], i)
    victim = spec.files[-1].target
    lying = replace(m, files=[replace(f, hash="0" * len(f.hash)) if f.path == victim else f for f in m.files])
    with pytest.raises(DeltaError, match=f"result file {victim} \\(rebuilt from"):
        rebuild_delta(out, lying, spec, base, {f.path: f for f in load_manifest(base).files}, root / "v2",
                      recycle=stale)  # fmt: skip
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("extra", [1 << 20, -100])
def test_a_result_file_written_over_another_file_has_exactly_the_result_bytes(tmp_path: Path, extra: int) -> None:
    """rebuild_file opens an existing file without truncating it (its pages are reused) and sets its
    size to the result's: a longer one leaves no stale tail, a shorter one is extended."""
    _base, new, out, m, spec = _delta(tmp_path)
    d = spec.files[0]
    size = next(f.bytes for f in m.files if f.path == d.target)
    target = tmp_path / "over.bin"
    _garbage(target, size + extra, 5)
    with ThreadPoolExecutor(2) as pool:
        assert rebuild_file(out / d.path, map_file(tmp_path / "v1" / d.target), target, pool, d.path) == size
    assert target.read_bytes() == (new / d.target).read_bytes()
