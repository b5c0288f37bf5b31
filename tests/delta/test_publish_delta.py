"""The trainer side: `hotswap publish DIR --delta-from BASE --out OUT` and the Python client.

Real safetensors files (the tiny model, one step of small noise), the real CLI in a subprocess,
the manifest's signed delta section, anchors (every N, adaptive), and what is refused.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from conftest import hotswap_cli, publish_tiny
from support_delta import step

from daemon.client import publish_delta
from daemon.delta import DeltaError
from daemon.delta.anchors import AnchorRule
from daemon.delta.rebuild import rebuild_delta
from daemon.delta.section import DELTA_DIR, parse
from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.manifest import ManifestError, load_manifest

pytestmark = pytest.mark.quick


def rebuilt_equals(out: Path, base: Path, new: Path, tmp: Path) -> bool:
    m = load_manifest(out)
    spec = parse(m, "t")
    assert spec is not None
    r = rebuild_delta(out, m, spec, base, {f.path: f for f in load_manifest(base).files}, tmp / "rebuilt" / out.name)
    return all((r.directory / f.path).read_bytes() == (new / f.path).read_bytes() for f in m.files)


def test_the_cli_writes_only_the_delta_and_the_manifest_last(tmp_path: Path) -> None:
    publish_tiny(tmp_path / "v1", seed=1)
    step(tmp_path / "v1", tmp_path / "v2", 1e-5, 2)
    out = tmp_path / "watch" / "v2"
    r = hotswap_cli("publish", str(tmp_path / "v2"), "--delta-from", str(tmp_path / "v1"), "--out", str(out), "--step", "2")
    assert r.returncode == 0, r.stderr
    assert "as a delta of v1" in r.stdout
    shipped = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert shipped == [f"{DELTA_DIR}/model.safetensors.hsd", MANIFEST_NAME]  # config, tokenizer: unchanged
    m = load_manifest(out)
    spec = parse(m, "t")
    assert spec is not None and spec.base_version == "v1" and spec.base_digest == load_manifest(tmp_path / "v1").digest
    assert [f.path for f in m.files] == [f.path for f in load_manifest(tmp_path / "v2").files]  # the result files
    assert spec.delta_bytes < spec.full_bytes
    assert rebuilt_equals(out, tmp_path / "v1", tmp_path / "v2", tmp_path)


def test_a_chain_continues_from_a_delta_published_base_and_anchors_adaptively(tmp_path: Path) -> None:
    publish_tiny(tmp_path / "v1", seed=1)
    prev = tmp_path / "v1"
    kinds = []
    for i in range(2, 7):
        new = tmp_path / f"v{i}"
        step(prev, new, 3e-5, i)
        p = publish_delta(new, prev, tmp_path / "watch" / new.name, rule=AnchorRule(share=0.08))
        kinds.append("delta" if p.spec is not None else "full")
        if p.spec is not None:
            assert rebuilt_equals(tmp_path / "watch" / new.name, prev, new, tmp_path)
        prev = new
    assert "full" in kinds and kinds[0] == "delta"  # the chain passed 8 % of a full checkpoint: an anchor
    anchor = kinds.index("full") + 2
    after = parse(load_manifest(tmp_path / "watch" / f"v{anchor + 1}"), "t") if anchor < 6 else None
    if after is not None:
        assert after.anchor == f"v{anchor}" and after.chain_length == 1


def test_every_n_versions_a_full_checkpoint(tmp_path: Path) -> None:
    publish_tiny(tmp_path / "v1", seed=1)
    prev, kinds = tmp_path / "v1", []
    for i in range(2, 6):
        new = tmp_path / f"v{i}"
        step(prev, new, 1e-4, i)
        p = publish_delta(new, prev, tmp_path / "w" / new.name, rule=AnchorRule(every=2))
        kinds.append("delta" if p.spec is not None else "full")
        prev = new
    assert kinds == ["delta", "full", "delta", "full"]  # anchors v1, v3, v5: one delta between them
    assert (tmp_path / "w" / "v3" / "model.safetensors").is_file()


def test_a_base_that_is_itself_a_shipped_delta_is_refused(tmp_path: Path) -> None:
    publish_tiny(tmp_path / "v1", seed=1)
    step(tmp_path / "v1", tmp_path / "v2", 1e-3, 2)
    step(tmp_path / "v2", tmp_path / "v3", 1e-3, 3)
    publish_delta(tmp_path / "v2", tmp_path / "v1", tmp_path / "w" / "v2")
    with pytest.raises(ManifestError, match="not the full files"):
        publish_delta(tmp_path / "v3", tmp_path / "w" / "v2", tmp_path / "w" / "v3")
    assert not (tmp_path / "w" / "v3").exists()  # nothing half-written
    r = hotswap_cli("publish", str(tmp_path / "v3"), "--delta-from", str(tmp_path / "v2"))
    assert r.returncode == 2 and "--delta-from needs --out" in r.stderr


def test_a_delta_naming_itself_as_its_base_is_a_loop(tmp_path: Path) -> None:
    publish_tiny(tmp_path / "v1", seed=1)
    step(tmp_path / "v1", tmp_path / "v2", 1e-5, 2)
    m = publish_delta(tmp_path / "v2", tmp_path / "v1", tmp_path / "w" / "v2").manifest
    doc = dict(m.extra["delta"])
    doc["base"] = {**doc["base"], "version": "v2"}
    with pytest.raises(DeltaError, match="names itself .* a loop"):
        parse(replace(m, extra={"delta": doc}), "t")
