"""The host side of a delta (daemon.delta.rebuild): several result files at once, each hashed in
memory as it is decoded and checked against the manifest before the folder is renamed into place.

Real safetensors files (the tiny model in two shards, one training-like step), the real publisher.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from conftest import publish_tiny
from support_delta import step

from daemon.client import publish_delta
from daemon.delta import DeltaError
from daemon.delta.rebuild import rebuild_delta
from daemon.delta.section import parse
from daemon.manifest import load_manifest

pytestmark = pytest.mark.quick


def _delta(tmp_path: Path) -> tuple[Path, Path, Path]:
    base, new, out = tmp_path / "v1", tmp_path / "v2", tmp_path / "watch" / "v2"
    publish_tiny(base, seed=1, shards=2)
    step(base, new, 1e-4, 2, share=0.3)
    publish_delta(new, base, out)
    return base, new, out


def test_every_shard_is_rebuilt_at_once_bit_identical_and_verified_in_memory(tmp_path: Path) -> None:
    base, new, out = _delta(tmp_path)
    m = load_manifest(out)
    spec = parse(m, "t")
    assert spec is not None and len(spec.files) == 2  # both shards changed: two files rebuilt side by side
    for threads in (1, 4):
        r = rebuild_delta(out, m, spec, base, {f.path: f for f in load_manifest(base).files}, tmp_path / f"r{threads}",
                    threads=threads)  # fmt: skip
        assert all((r.directory / f.path).read_bytes() == (new / f.path).read_bytes() for f in m.files)
        assert r.result_bytes == sum(f.bytes for f in m.files)


@pytest.mark.parametrize("field", ["hash", "crc32c"])
def test_a_result_whose_hashes_differ_from_the_manifest_is_refused_by_the_rebuild(tmp_path: Path, field: str) -> None:
    """The delta's own bytes are intact (they match the signed delta section), but the result they
    decode to is not what the manifest lists: refused during the rebuild, nothing left behind."""
    base, _new, out = _delta(tmp_path)
    m = load_manifest(out)
    spec = parse(m, "t")
    assert spec is not None
    victim = spec.files[-1].target
    wrong = "0" * len(getattr(next(f for f in m.files if f.path == victim), field))
    lying = replace(m, files=[replace(f, **{field: wrong}) if f.path == victim else f for f in m.files])
    dest = tmp_path / "rebuilt" / "v2"
    with pytest.raises(DeltaError, match=f"result file {victim} \\(rebuilt from"):
        rebuild_delta(out, lying, spec, base, {f.path: f for f in load_manifest(base).files}, dest)
    assert not dest.exists()
    assert [p.name for p in dest.parent.iterdir()] == []  # no temporary folder either


@pytest.mark.parametrize("verified", ["strong", "a shard by crc32c only"])
def test_a_base_changed_on_disk_since_it_was_verified_is_refused(tmp_path: Path, verified: str) -> None:
    """A base file the result copies unchanged, edited on this host after it was verified (same
    size): refused by the base's re-hash, with the strong hash alone where every base file has one,
    with CRC32C and the strong hash where one of them has a CRC32C alone; nothing left behind."""
    base, _new, out = _delta(tmp_path)
    m = load_manifest(out)
    spec = parse(m, "t")
    assert spec is not None
    copied = next(f.path for f in m.files if f.path not in {d.target for d in spec.files})
    raw = bytearray((base / copied).read_bytes())
    raw[len(raw) // 2] ^= 1
    (base / copied).write_bytes(bytes(raw))
    files = {f.path: f for f in load_manifest(base).files}
    if verified != "strong":
        files[spec.files[0].target] = replace(files[spec.files[0].target], hash="", hash_alg=None)
    dest = tmp_path / "rebuilt" / "v2"
    with pytest.raises(DeltaError, match=f"base file {copied} \\(changed on this host since it was verified\\): "
                                         "blake3 .* does not match the verified"):  # fmt: skip
        rebuild_delta(out, m, spec, base, files, dest)
    assert not dest.exists()
    assert [p.name for p in dest.parent.iterdir()] == []


def test_a_rebuilt_files_base_changed_on_disk_is_refused_and_named(tmp_path: Path) -> None:
    """The base of a shard the delta rebuilds, edited on this host after it was verified: the result
    decoded from it does not match the manifest, and the base's own hash then names the cause."""
    base, _new, out = _delta(tmp_path)
    m = load_manifest(out)
    spec = parse(m, "t")
    assert spec is not None
    rebuilt = spec.files[0].target
    raw = bytearray((base / rebuilt).read_bytes())
    raw[len(raw) // 2] ^= 1  # inside a tensor the delta decodes against (a sparse step changes few elements)
    (base / rebuilt).write_bytes(bytes(raw))
    dest = tmp_path / "rebuilt" / "v2"
    with pytest.raises(DeltaError, match=f"base file {rebuilt} \\(changed on this host since it was verified\\)"):
        rebuild_delta(out, m, spec, base, {f.path: f for f in load_manifest(base).files}, dest)
    assert not dest.exists()
    assert [p.name for p in dest.parent.iterdir()] == []


def test_only_the_bases_copied_unchanged_are_re_hashed_when_every_result_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rebuilt file's result hash proves the base bytes it was decoded from, so the rebuild does
    not hash those bases again (16 GB beside the decoding, for the 8B layout)."""
    import daemon.delta.rebuild as rebuild_module

    base, _new, out = _delta(tmp_path)
    m = load_manifest(out)
    spec = parse(m, "t")
    assert spec is not None
    hashed: list[str] = []
    real = rebuild_module.hash_files

    def recording(paths: list[Path], **kw: object) -> object:
        hashed.extend(p.relative_to(base).as_posix() for p in paths if p.is_relative_to(base))
        return real(paths, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(rebuild_module, "hash_files", recording)
    rebuild_delta(out, m, spec, base, {f.path: f for f in load_manifest(base).files}, tmp_path / "r")
    targets = {d.target for d in spec.files}
    copied = {f.path for f in m.files if f.path not in targets}
    assert copied and set(hashed) == copied, (hashed, copied)
