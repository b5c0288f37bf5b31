"""The trainer side of the compacted delta: one delta from the chain's anchor to the new version,
written beside the delta (`hotswap-compact/`) and listed in the signed manifest (issue 38).

Real safetensors files (the tiny model, small training-like steps), the real CLI in a subprocess
where the command line is what is tested; what is refused and what is skipped, each with its reason.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import hotswap_cli, publish_tiny
from support_delta import step

from daemon.client import publish_delta
from daemon.delta import DeltaError
from daemon.delta.anchors import AnchorRule
from daemon.delta.compact import compact_chain
from daemon.delta.rebuild import rebuild_delta
from daemon.delta.section import COMPACT_DIR, DELTA_DIR, fetched_files, parse, shipped_files
from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.manifest import load_manifest

pytestmark = pytest.mark.quick
RULE = AnchorRule(share=100.0)  # always a delta: the tests decide what ships
HSD = "model.safetensors.hsd"


def chain(root: Path, n: int = 3, **options: object) -> dict[str, Path]:
    """v1 (full) and deltas v2..vn of the one before, published into root/out/<v>; the full folders in root/tr."""
    publish_tiny(root / "tr" / "v1", seed=1)
    out = {"v1": root / "tr" / "v1"}
    for i in range(2, n + 1):
        step(root / "tr" / f"v{i - 1}", root / "tr" / f"v{i}", 1e-3, 7)  # the same elements move each step
        out[f"v{i}"] = root / "out" / f"v{i}"
        publish_delta(root / "tr" / f"v{i}", root / "tr" / f"v{i - 1}", out[f"v{i}"], rule=RULE, **options)
    return out


def files_of(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_the_cli_writes_the_compacted_delta_from_the_anchor_and_it_rebuilds_the_version(
    tmp_path: Path,
) -> None:
    publish_tiny(tmp_path / "tr" / "v1", seed=1)
    for v, base in (("v2", "v1"), ("v3", "v2")):
        step(tmp_path / "tr" / base, tmp_path / "tr" / v, 1e-3, 7)
        r = hotswap_cli("publish", str(tmp_path / "tr" / v), "--delta-from", str(tmp_path / "tr" / base),
                        "--out", str(tmp_path / "out" / v), "--anchor-share", "100")  # fmt: skip
        assert r.returncode == 0, r.stderr
    assert "compacted delta from v1" in r.stdout, r.stdout
    out = tmp_path / "out" / "v3"
    assert files_of(out) == [f"{COMPACT_DIR}/{HSD}", f"{DELTA_DIR}/{HSD}", MANIFEST_NAME]
    assert files_of(tmp_path / "out" / "v2") == [
        f"{DELTA_DIR}/{HSD}",
        MANIFEST_NAME,
    ]  # one link: no compacting
    m, anchor = load_manifest(out), load_manifest(tmp_path / "tr" / "v1")
    spec = parse(m, "t")
    assert spec is not None and spec.compacted is not None and spec.chain_length == 2
    c = spec.compacted
    assert (c.base_version, c.base_digest, spec.anchor_digest) == ("v1", anchor.digest, anchor.digest)
    assert c.delta_bytes < spec.chain_bytes  # worth it: about one link, not two
    assert [f.path for f in fetched_files(m, "t")] == [f"{DELTA_DIR}/{HSD}"]  # a host with the base
    assert [f.path for f in fetched_files(m, "t", compacted=True)] == [
        f"{COMPACT_DIR}/{HSD}"
    ]  # a host without
    assert [f.path for f in shipped_files(m, "t")] == [
        f"{DELTA_DIR}/{HSD}",
        f"{COMPACT_DIR}/{HSD}",
    ]  # the upload
    done = rebuild_delta(
        out, m, c, tmp_path / "tr" / "v1", {f.path: f for f in anchor.files}, tmp_path / "rebuilt" / "v3"
    )
    for f in m.files:  # from the anchor alone, bit-identical to the trainer's v3
        assert (done.directory / f.path).read_bytes() == (tmp_path / "tr" / "v3" / f.path).read_bytes(), (
            f.path
        )
    assert (
        load_manifest(tmp_path / "tr" / "v3").digest == m.digest
    )  # the full folder's manifest is the same one


def test_no_compact_writes_none_and_a_longer_chain_still_compacts_from_the_anchor(tmp_path: Path) -> None:
    off = chain(tmp_path / "a", compact=False)
    assert files_of(off["v3"]) == [f"{DELTA_DIR}/{HSD}", MANIFEST_NAME]
    spec = parse(load_manifest(off["v3"]), "t")
    assert spec is not None and spec.compacted is None
    on = chain(tmp_path / "b", n=4)
    spec = parse(load_manifest(on["v4"]), "t")
    assert spec is not None and spec.compacted is not None
    assert (spec.compacted.base_version, spec.chain_length) == (
        "v1",
        3,
    )  # v1 -> v4 in one, not v1 -> v3 -> v4


def test_the_anchor_folder_is_found_given_or_its_absence_is_named(tmp_path: Path) -> None:
    publish_tiny(tmp_path / "tr" / "v1", seed=1)
    step(tmp_path / "tr" / "v1", tmp_path / "tr" / "v2", 1e-3, 7)
    publish_delta(tmp_path / "tr" / "v2", tmp_path / "tr" / "v1", tmp_path / "out" / "v2", rule=RULE)
    step(tmp_path / "tr" / "v2", tmp_path / "tr" / "v3", 1e-3, 7)
    elsewhere = tmp_path / "anchors" / "first"
    elsewhere.parent.mkdir()
    shutil.move(tmp_path / "tr" / "v1", elsewhere)  # not beside the base any more
    argv = [
        "publish",
        str(tmp_path / "tr" / "v3"),
        "--delta-from",
        str(tmp_path / "tr" / "v2"),
        "--anchor-share",
        "100",
    ]

    strict = hotswap_cli(*argv, "--out", str(tmp_path / "out" / "v3"), "--compact")
    assert strict.returncode == 1 and "--anchor-dir" in strict.stderr and "v1" in strict.stderr, strict.stderr
    assert not (tmp_path / "out" / "v3").exists()  # nothing half-written
    default = hotswap_cli(*argv, "--out", str(tmp_path / "out" / "v3"))
    assert default.returncode == 0, default.stderr
    assert "no compacted delta:" in default.stdout and "--anchor-dir" in default.stdout, default.stdout
    assert not (tmp_path / "out" / "v3" / COMPACT_DIR).exists()
    given = hotswap_cli(
        *argv, "--out", str(tmp_path / "out" / "v3b"), "--version", "v3", "--anchor-dir", str(elsewhere)
    )
    assert given.returncode == 0 and "compacted delta from v1" in given.stdout, given.stdout + given.stderr
    assert (tmp_path / "out" / "v3b" / COMPACT_DIR / HSD).is_file()


def test_another_checkpoint_under_the_anchors_name_is_refused_as_the_anchor(tmp_path: Path) -> None:
    paths = chain(tmp_path, n=2)
    step(tmp_path / "tr" / "v2", tmp_path / "tr" / "v3", 1e-3, 7)
    shutil.move(tmp_path / "tr" / "v1", tmp_path / "v1-real")
    publish_tiny(tmp_path / "tr" / "v1", seed=5, version="v1")  # same name, other weights
    with pytest.raises(DeltaError, match="another checkpoint under the anchor's name"):
        publish_delta(
            tmp_path / "tr" / "v3", tmp_path / "tr" / "v2", tmp_path / "out" / "v3", rule=RULE, compact=True
        )
    assert not (tmp_path / "out" / "v3").exists()
    p = publish_delta(tmp_path / "tr" / "v3", tmp_path / "tr" / "v2", tmp_path / "out" / "v3", rule=RULE)
    assert p.spec is not None and p.spec.compacted is None
    assert p.compact_skipped is not None and "another checkpoint" in p.compact_skipped
    assert paths["v2"].is_dir()


def test_a_compacted_delta_not_smaller_than_the_chain_is_skipped_with_the_reason(tmp_path: Path) -> None:
    chain(tmp_path, n=3, compact=False)
    out = tmp_path / "out" / "v3"
    spec = parse(load_manifest(out), "t")
    assert spec is not None
    rels = [f.path for f in load_manifest(out).files]
    with ThreadPoolExecutor(2) as pool:
        tiny_chain = replace(spec, chain_bytes=1)
        got, why = compact_chain(tiny_chain, tmp_path / "tr" / "v3", tmp_path / "tr" / "v2", rels, out, pool,
                                 "blake3", 2, None, None)  # fmt: skip
        assert got is None and why is not None and "not smaller than the chain" in why
        assert not (out / COMPACT_DIR).exists()
        with pytest.raises(DeltaError, match="not smaller than the chain"):
            compact_chain(tiny_chain, tmp_path / "tr" / "v3", tmp_path / "tr" / "v2", rels, out, pool, "blake3", 2,
                          True, None)  # fmt: skip


@pytest.mark.parametrize(("change", "why"), [
    (lambda c: {**c, "base": {**c["base"], "version": "v2"}}, "not at the chain's anchor"),
    (lambda c: {**c, "files": [{**c["files"][0], "path": f"{DELTA_DIR}/x.hsd"}]}, f"under {COMPACT_DIR}/"),
    (lambda c: {**c, "delta_bytes": -1}, "delta_bytes"),
    (lambda c: {**c, "files": [{**c["files"][0], "target": "nope.bin"}]}, "does not list"),
])  # fmt: skip
def test_a_malformed_compacted_section_is_refused_with_its_reason(tmp_path: Path, change, why: str) -> None:  # noqa: ANN001
    m = load_manifest(chain(tmp_path)["v3"])
    doc = dict(m.extra["delta"])
    doc["compacted"] = change(doc["compacted"])
    with pytest.raises(DeltaError, match=why):
        parse(replace(m, extra={"delta": doc}), "t")
    with pytest.raises(DeltaError, match="changed must count"):
        parse(
            replace(m, extra={"delta": {**m.extra["delta"], "changed": {"tensors": -1, "elements": 3}}}), "t"
        )
