"""bench/delta_sources.py on its smallest setting (one real daemon, moto on loopback, a push), so
the bench cannot rot: each source's full version is counted as full bytes, its delta as exactly
the delta's file bytes, and the daemon's counters agree with its registry rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.delta_sources import main

pytestmark = pytest.mark.timeout(600)


def test_the_bench_counts_full_and_delta_bytes_per_source(tmp_path: Path) -> None:
    out = tmp_path / "delta_sources.json"
    assert main(["--hosts", "1", "--density", "0.01", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [s["source"] for s in doc["summary"]] == ["bucket", "push"]
    for s in doc["summary"]:
        assert s["counters_match_registry"] and s["only_delta_fetched"], s
        assert s["full_bytes_per_host"] == doc["sizes"][s["source"]]["full_bytes"]
        assert 0 < s["delta_bytes_per_host"] == s["delta_file_bytes"] < 0.05 * s["full_bytes_per_host"]
    assert {(r["version"], r["encoding"]) for r in doc["rows"]} == {
        ("s3-base", "full"),
        ("s3-delta", "delta"),
        ("push-base", "full"),
        ("push-delta", "delta"),
    }
