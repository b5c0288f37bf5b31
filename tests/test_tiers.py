"""The test tiers (CONTRIBUTING.md) name real modules: a renamed or removed module would silently
drop out of the quick tier, and a misspelt group would split the vLLM tests over two processes."""

from __future__ import annotations

from conftest import LONGEST_FIRST, QUICK, REPO, XDIST_GROUPS

MODULES = {p.stem for p in (REPO / "tests").glob("test_*.py")}


def test_the_quick_tier_names_existing_modules() -> None:
    assert sorted(QUICK - MODULES) == []


def test_the_groups_and_the_order_name_existing_modules_or_groups() -> None:
    assert sorted(m.removesuffix(".py") for m in XDIST_GROUPS if m.removesuffix(".py") not in MODULES) == []
    groups = set(XDIST_GROUPS.values())
    assert sorted(g for g in LONGEST_FIRST if g not in groups and g.removesuffix(".py") not in MODULES) == []
