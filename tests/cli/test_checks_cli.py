"""`hotswap verify`: the same checks offline, a table or JSON, and an exit code that means something."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support_checks import flip_bit_in_data, published, shard_paths

from daemon.cli.verify import main

pytestmark = pytest.mark.quick

NO_FORWARD = ["--skip", "forward", "--no-progress"]


def test_good_checkpoint_exits_zero_and_prints_every_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    d = published(tmp_path / "v", shards=2)
    assert main([str(d), *NO_FORWARD]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
    for name in ("manifest", "headers", "crc32c", "finite", "headroom"):
        assert "pass" in rows[name]
    # no serving version: compat did not run, and forward was left out; neither says "pass"
    assert "skipped" in rows["compat"] and "pass" not in rows["compat"]
    assert "skipped" in rows["forward"] and "disabled" in rows["forward"]
    assert "verified" in out and "FAIL" not in out


def test_rejected_checkpoint_exits_one_and_json_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    d = published(tmp_path / "v", shards=2)
    shard = shard_paths(d)[0]
    flip_bit_in_data(shard)
    assert main([str(d), "--json", *NO_FORWARD]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["deferred"] is False
    assert report["reason"].startswith("crc32c: ") and shard.name in report["reason"]
    ran = [r for r in report["results"] if r["status"] != "skipped"]
    assert [(r["name"], r["status"]) for r in ran] == [("manifest", "pass"), ("headers", "pass"), ("crc32c", "fail")]
    assert ran[-1]["detail"]["file"] == shard.name
    assert {r["name"]: r["status"] for r in report["results"][3:]} == {
        n: "skipped" for n in ("compat", "finite", "headroom", "forward")
    }


def test_incompatible_reference_and_deferred_headroom_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    ref = published(tmp_path / "serving", dtype="bfloat16")
    new = published(tmp_path / "new")
    assert main([str(new), "--reference", str(ref), "--no-restart", *NO_FORWARD]) == 1
    assert "needs a restart rollout" in capsys.readouterr().out
    assert main([str(new), "--reference", str(ref), "--json", *NO_FORWARD]) == 0  # by default: a restart rollout
    compat = next(r for r in json.loads(capsys.readouterr().out)["results"] if r["name"] == "compat")
    assert compat["status"] == "pass" and compat["detail"]["restart_rollout"] is True
    assert main([str(new), "--headroom-factor", "1e9", *NO_FORWARD]) == 3
    assert "deferred" in capsys.readouterr().out


def test_signature_keys_from_flags_and_from_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    d = published(tmp_path / "v")  # unsigned
    key = tmp_path / "k"
    key.write_text("secret")
    assert main([str(d), "--checks", "manifest", "--hmac-key", f"t1={key}", "--no-progress"]) == 1
    assert "unsigned" in capsys.readouterr().out
    config = tmp_path / "hotswap.toml"
    config.write_text(f'[checks]\nenabled = ["manifest", "crc32c"]\nhmac_keys = {{ t1 = "{key}" }}\n')
    assert main([str(d), "-c", str(config), "--no-progress"]) == 1
    assert "unsigned" in capsys.readouterr().out
    # keys configured but the bytes never compared with what they sign: the config is refused
    config.write_text(f'[checks]\nenabled = ["manifest"]\nhmac_keys = {{ t1 = "{key}" }}\n')
    assert main([str(d), "-c", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checks.enabled" in err[0] and "'crc32c' is not enabled" in err[0]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--skip", "sha1"], "unknown check names"),
        (["--hmac-key", "nofile"], "KEY_ID=FILE"),
        (["--headroom-factor", "0"], "headroom_factor"),
    ],
)
def test_usage_errors_exit_two_with_a_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
):
    d = published(tmp_path / "v")
    assert main([str(d), *argv]) == 2
    assert message in capsys.readouterr().err
    assert main([str(tmp_path / "absent")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_hotswap_verify_and_publish_through_the_entry_point(tmp_path: Path):
    from daemon.tinymodel import make_tiny_checkpoint

    d = make_tiny_checkpoint(tmp_path / "step-3")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = [sys.executable, "-m", "daemon.cli.main"]
    pub = subprocess.run([*run, "publish", str(d), "--step", "3"], capture_output=True, text=True, env=env)
    assert pub.returncode == 0, pub.stderr
    assert "published step-3" in pub.stdout
    ver = subprocess.run(
        [*run, "verify", str(d), "--json", "--no-progress"], capture_output=True, text=True, env=env
    )
    assert ver.returncode == 0, ver.stderr
    report = json.loads(ver.stdout)
    assert (
        report["ok"]
        and report["version"] == "step-3"
        and [r["name"] for r in report["results"]][-1] == "forward"
    )
