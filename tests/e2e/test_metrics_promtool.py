"""`promtool check metrics` on a scrape of a real daemon that verified and rejected checkpoints.

promtool comes from scripts/check-metrics.sh (`--install` in .ci/run); without it these tests
are skipped, never passed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, publish_tiny

SCRIPT = REPO / "scripts" / "check-metrics.sh"


def _promtool_or_skip() -> None:
    # --install would fetch it; a test run only uses what is there.
    found = subprocess.run(["bash", str(SCRIPT), "--which"], capture_output=True, text=True)
    if found.returncode != 0 or not found.stdout.strip():
        pytest.skip("promtool not installed (scripts/check-metrics.sh --install)")


def _check(*scrapes: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *scrapes], capture_output=True, text=True, timeout=60)


def test_daemon_scrape_passes_promtool(daemon_factory, tmp_path: Path) -> None:
    _promtool_or_skip()
    d = daemon_factory(f"sqlite:///{tmp_path / 'metrics.db'}")
    publish_tiny(tmp_path / "build" / "good", seed=1, version="good")
    shutil.copytree(tmp_path / "build" / "good", d.watch_dir / "good")
    publish_tiny(tmp_path / "build" / "bad", seed=2, version="bad")
    weights = tmp_path / "build" / "bad" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # same size, wrong CRC: rejected at verify
    weights.write_bytes(bytes(data))
    shutil.copytree(tmp_path / "build" / "bad", d.watch_dir / "bad")
    d.wait_status("good", "verified")
    d.wait_status("bad", "rejected")

    url = d.api_url + "/metrics"
    scrape = d.get("/metrics").text
    # The series promtool is asked about are really there, with labels.
    assert 'hotswap_checkpoints{status="rejected"}' in scrape
    assert 'hotswap_verify_seconds_count{outcome="ok"}' in scrape
    assert "hotswap_checkpoints_discovered_total" in scrape
    out = _check(url)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"metrics  {url}: ok" in out.stdout
    # every series the shipped alert rules read is one this daemon exports (the rules cannot
    # drift from the names: prometheus/hotswap-alerts.yml, tested by scripts/check-alerts.sh)
    rules = (REPO / "prometheus" / "hotswap-alerts.yml").read_text()
    exported = set(re.findall(r"^# TYPE (\w+) ", scrape, flags=re.M))
    exported |= {n + "_total" for n in exported}
    read = set(re.findall(r"\b(hotswap_\w+)\b", rules))
    assert read and read <= exported, sorted(read - exported)


def test_promtool_check_fails_on_bad_names(tmp_path: Path) -> None:
    """The check can fail: a counter without _total and a family without HELP are reported."""
    _promtool_or_skip()
    bad = tmp_path / "bad.prom"
    bad.write_text(
        "# HELP w_requests Requests\n# TYPE w_requests counter\nw_requests 1\n# TYPE w_up gauge\nw_up 1\n"
    )
    out = _check(str(bad))
    assert out.returncode == 1
    assert 'w_requests counter metrics should have "_total" suffix' in out.stderr
    assert "w_up no help text" in out.stderr


def test_missing_scrape_file_is_an_error(tmp_path: Path) -> None:
    _promtool_or_skip()
    out = _check(str(tmp_path / "nope.prom"))
    assert out.returncode == 1
    assert "no such file" in out.stderr
