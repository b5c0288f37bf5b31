"""Bounded reads of config.json, the index and the manifest (issue 10, finding 11).

Whatever sits under those names, reading it must not hang (FIFO, device), not eat
memory (a 1 GB config), and not leave the checkpoint (a symlink to /etc/...).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from daemon.checks import CHECK_NAMES, CheckSettings, run_checks
from daemon.formats.checkpoint import INDEX_NAME, MANIFEST_NAME, LayoutError, weight_files
from daemon.formats.smallfile import (
    CONFIG_CAP_BYTES,
    INDEX_CAP_BYTES,
    SmallFileError,
    SmallFileMissing,
    read_json_object,
)
from daemon.manifest import ManifestError, load_manifest
from daemon.sources.commit import CommitDetector
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.quick

FAST = CheckSettings(enabled=tuple(n for n in CHECK_NAMES if n != "forward"))


def _in_time(fn, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    """Run fn in a thread; fail (instead of hanging the suite) if it blocks."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the read blocked"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


def test_reads_a_regular_json_object_and_allows_symlinks_inside(tmp_path: Path):
    (tmp_path / "real.json").write_text('{"a": 1}')
    (tmp_path / "config.json").symlink_to("real.json")
    assert read_json_object(tmp_path, "config.json", 100) == {"a": 1}
    with pytest.raises(SmallFileMissing):
        read_json_object(tmp_path, "absent.json", 100)


@pytest.mark.parametrize(
    "content,words",
    [
        (b"[1, 2]", "not a JSON object"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"{" * 10 + b"}", "not valid JSON"),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
    ],
)
def test_bad_content_is_one_clear_error(tmp_path: Path, content: bytes, words: str):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(SmallFileError, match=words):
        read_json_object(tmp_path, "config.json", 10 * 1024 * 1024)


def test_oversized_file_is_refused_naming_the_file_and_the_cap_without_reading_it(tmp_path: Path):
    big = tmp_path / "config.json"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # 1 GB, sparse: refused from fstat, nothing read
    with pytest.raises(SmallFileError) as info:
        read_json_object(tmp_path, "config.json", CONFIG_CAP_BYTES)
    assert str(big) in str(info.value) and f"{CONFIG_CAP_BYTES}-byte cap" in str(info.value)


def test_fifo_and_device_are_refused_without_blocking(tmp_path: Path):
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(SmallFileError, match="not a regular file"):
        _in_time(lambda: read_json_object(tmp_path, "config.json", 100))
    inside = tmp_path / "dev"
    inside.mkdir()
    (inside / "config.json").symlink_to("/dev/zero")
    with pytest.raises(SmallFileError, match="not a regular file|leaving the checkpoint"):
        _in_time(lambda: read_json_object(inside, "config.json", 100))


def test_symlink_leaving_the_checkpoint_is_refused(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    secret = tmp_path / "secret.json"
    secret.write_text('{"password": "x"}')
    (ckpt / "config.json").symlink_to(secret)
    with pytest.raises(SmallFileError, match="symlink leaving the checkpoint"):
        read_json_object(ckpt, "config.json", 100)
    with pytest.raises(SmallFileError, match="leaves the checkpoint"):
        read_json_object(ckpt, "../secret.json", 100)


def test_the_manifest_check_rejects_an_oversized_or_escaping_config_json(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v")  # index/marker-committed: no manifest sizes to go by
    (d / "config.json").unlink()
    with open(d / "config.json", "wb") as f:
        f.truncate(CONFIG_CAP_BYTES + 1)
    report = run_checks(d, FAST)
    assert not report.ok and report.results[-1].name == "manifest"
    assert "config.json" in report.reason and f"{CONFIG_CAP_BYTES}-byte cap" in report.reason
    (d / "config.json").unlink()
    (d / "config.json").symlink_to("/etc/hostname")
    report = run_checks(d, FAST)
    assert not report.ok and "symlink leaving the checkpoint" in report.reason


def test_an_oversized_or_fifo_index_is_a_layout_error(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v", shards=2)
    (d / INDEX_NAME).unlink()
    with open(d / INDEX_NAME, "wb") as f:
        f.truncate(INDEX_CAP_BYTES + 1)
    with pytest.raises(LayoutError, match="cap"):
        weight_files(d)
    (d / INDEX_NAME).unlink()
    os.mkfifo(d / INDEX_NAME)
    with pytest.raises(LayoutError, match="not a regular file"):
        _in_time(lambda: weight_files(d))


def test_a_fifo_manifest_neither_hangs_loading_nor_commit_detection(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v")
    os.mkfifo(d / MANIFEST_NAME)
    with pytest.raises(ManifestError, match="not a regular file"):
        _in_time(lambda: load_manifest(d))
    detector = CommitDetector(["manifest", "index"], quiet_period_s=0.0)
    decision = _in_time(lambda: detector.check(d))
    assert not decision.committed  # a FIFO is no commit signal, and nothing blocked
    report = _in_time(lambda: run_checks(d, FAST))
    assert not report.ok and "not a regular file" in report.reason
