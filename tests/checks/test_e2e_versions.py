"""bench/gpu_e2e.py's versions (bench/e2e_versions.py): derived good versions pass every check and
differ in content; each bad kind is caught by the check the 8B run expects (bench/e2e_reject.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.common import TINY, write_checkpoint
from bench.e2e_reject import EXPECTED
from bench.e2e_versions import derive
from daemon.checks import CheckSettings, run_checks
from daemon.manifest import load_manifest

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("e2e") / "base"
    write_checkpoint(d, TINY, shards=3, seed=1, device="cpu")
    return d


def test_derived_versions_pass_and_differ_sharing_the_unchanged_shards(base: Path, tmp_path: Path) -> None:
    v0 = tmp_path / "v0"
    derive(base, v0, seed=0, kind="link", version="v0")
    v1 = tmp_path / "v1"
    derive(v0, v1, seed=1, version="v1")
    digests = {load_manifest(v).digest for v in (v0, v1)}
    assert len(digests) == 2
    shards = sorted(p.name for p in v1.glob("*.safetensors"))
    linked = [s for s in shards if os.path.samefile(v0 / s, v1 / s)]
    assert len(linked) == len(shards) - 1  # one shard copied and changed, the rest shared
    report = run_checks(v1, CheckSettings(), reference=v0)
    assert report.ok, report.reason


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_each_bad_kind_is_caught_by_the_expected_check(base: Path, tmp_path: Path, kind: str) -> None:
    serving = tmp_path / "serving"
    derive(base, serving, seed=0, kind="link", version="serving")
    bad = tmp_path / f"bad-{kind}"
    derive(serving, bad, seed=7, kind=kind, version=f"bad-{kind}")
    report = run_checks(bad, CheckSettings(), reference=serving)
    assert not report.ok and report.reason is not None
    assert report.results[-1].name == EXPECTED[kind], report.reason
    assert run_checks(serving, CheckSettings()).ok  # the hard links left the serving version intact
