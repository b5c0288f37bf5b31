"""Every figure in the summary tables (bench/RESULTS.md, docs/reference/performance.md) names its
record in bench/results/, and that record is there: a figure nobody can check is not shown."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TABLES = [REPO / "bench" / "RESULTS.md", REPO / "docs" / "reference" / "performance.md"]
HEADER = "| what | measured | goal | anchor (same work, same run) | record (`bench/results/`) |"


def summary_rows(page: Path) -> list[str]:
    lines = page.read_text().splitlines()
    assert HEADER in lines, f"{page.relative_to(REPO)}: no summary table with a record column"
    rows = []
    for line in lines[lines.index(HEADER) + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


@pytest.mark.parametrize("page", TABLES, ids=lambda p: p.name)
def test_every_summary_figure_names_a_record_that_exists(page: Path) -> None:
    rows = summary_rows(page)
    assert len(rows) >= 10, rows
    for row in rows:
        record = row.rstrip().rstrip("|").split("|")[-1]
        files = re.findall(r"`([^`]+)`", record)
        assert files, f"{page.relative_to(REPO)}: no record for: {row[:100]}"
        for name in files:
            assert (REPO / "bench" / "results" / name).is_file(), f"{page.relative_to(REPO)}: {name} is not in bench/results/"


def test_both_tables_show_the_same_figures() -> None:
    assert summary_rows(TABLES[0]) == summary_rows(TABLES[1])
