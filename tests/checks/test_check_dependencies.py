"""Check dependencies (issue 10, finding 3): the crc32c check never passes on nothing.

It needs the manifest check's file list (and the manifest's or the recorded hashes to
compare with). A config that leaves the dependency out is refused with one line naming
the key; `hotswap verify --checks crc32c` runs the dependency too; `--skip manifest`
is refused; a check that did not run is shown as skipped, never pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import hotswap_cli, make_config_file
from support_checks import flip_bit_in_data, published

from daemon.checks import CheckSettings, run_checks
from daemon.cli.verify import main as verify_main
from daemon.config import ConfigError, load_config
from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.quick


@pytest.fixture
def corrupted(tmp_path: Path) -> Path:
    d = published(tmp_path / "v", shards=2)
    flip_bit_in_data(sorted(d.glob("*.safetensors"))[0])
    return d


def test_verify_checks_crc32c_alone_runs_the_manifest_check_and_rejects(
    corrupted: Path, capsys: pytest.CaptureFixture[str]
):
    assert verify_main([str(corrupted), "--checks", "crc32c", "--json", "--no-progress"]) == 1
    report = json.loads(capsys.readouterr().out)
    statuses = {r["name"]: r["status"] for r in report["results"]}
    assert statuses["manifest"] == "pass" and statuses["crc32c"] == "fail"
    assert "model-00001-of-00002.safetensors" in report["reason"]
    assert "0 files" not in json.dumps(report)


def test_verify_skip_manifest_with_crc32c_on_is_refused_with_one_line(
    corrupted: Path, capsys: pytest.CaptureFixture[str]
):
    assert verify_main([str(corrupted), "--skip", "manifest", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hotswap verify: --skip manifest: the crc32c check needs it (skip crc32c too, or keep manifest)"]
    # skipping both is allowed, and then crc32c is shown as skipped, and no digest is claimed
    assert verify_main([str(corrupted), "--skip", "manifest,crc32c,forward", "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {r["name"]: r["status"] for r in report["results"]}["crc32c"] == "skipped"
    assert report["digest"] is None


@pytest.mark.parametrize(
    "checks,words",
    [
        ({"enabled": ["headers", "crc32c", "finite"]}, "'crc32c' needs 'manifest'"),
        ({"enabled": ["headers", "finite"], "require_manifest": True}, "'manifest' is not enabled"),
        ({"enabled": ["manifest", "headers"], "hmac_keys": {"k": "/k"}}, "'crc32c' is not enabled"),
    ],
)
def test_config_that_disables_a_required_check_is_refused_with_one_line(tmp_path: Path, checks: dict, words: str):
    cfg = make_config_file(tmp_path / "c.toml", checks=checks)
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    message = str(info.value)
    assert "\n" not in message and "checks.enabled" in message and words in message


def test_daemon_refuses_such_a_config_at_start(tmp_path: Path):
    cfg = make_config_file(
        tmp_path / "c.toml",
        daemon={"state_dir": str(tmp_path / "state")},
        checks={"enabled": ["headers", "crc32c", "finite"]},
    )
    out = hotswap_cli("daemon", "-c", str(cfg), cwd=tmp_path, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "checks.enabled" in lines[0] and "'crc32c' needs 'manifest'" in lines[0]


def test_a_settings_object_changed_after_validation_still_never_passes_crc32c_on_nothing(corrupted: Path):
    settings = CheckSettings()
    settings.enabled = ("headers", "crc32c")  # bypassing the dataclass validation
    report = run_checks(corrupted, settings)
    assert not report.ok and report.results[-1].name == "crc32c"
    assert "needs the 'manifest' check" in report.reason


def test_recorded_digests_are_the_reference_for_a_checkpoint_without_manifest(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "idx", seed=4, shards=2)
    first = run_checks(d, CheckSettings(enabled=("manifest", "headers", "crc32c")))
    assert first.ok and "nothing (no manifest)" in first.results[-1].detail["compared"]
    assert all(f.hash_alg == "blake3" and f.hash for f in first.files)
    again = run_checks(d, CheckSettings(enabled=("manifest", "crc32c")), recorded=first.files)
    assert again.ok and again.digest == first.digest and "recorded" in again.results[-1].detail["compared"]
    shard = sorted(d.glob("*.safetensors"))[1]
    flip_bit_in_data(shard)
    changed = run_checks(d, CheckSettings(enabled=("manifest", "crc32c")), recorded=first.files)
    assert not changed.ok and shard.name in changed.reason and "the recorded" in changed.reason
    (d / "extra.bin").write_bytes(b"x")
    grown = run_checks(d, CheckSettings(enabled=("manifest", "crc32c")), recorded=first.files)
    assert not grown.ok and "extra.bin: new since the recorded verify" in grown.reason


def test_compat_without_a_serving_version_is_skipped_not_passed(tmp_path: Path):
    d = published(tmp_path / "v")
    report = run_checks(d, CheckSettings(enabled=("manifest", "headers", "compat")))
    compat = report.results[-1]
    assert report.ok and compat.name == "compat" and compat.status == "skipped" and compat.skipped
    assert compat.detail == {"skipped": "no serving version or configured reference to compare with"}
    assert (d / MANIFEST_NAME).exists()
