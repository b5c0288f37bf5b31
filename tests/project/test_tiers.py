"""The test tree's shape (CONTRIBUTING.md): every test module lives in a folder named for what it
tests, the quick tier is declared in the modules themselves (`pytestmark` with `pytest.mark.quick`)
and starts no daemon, and the xdist groups name real modules (a misspelt group would split the
vLLM tests over two processes)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import LONGEST_FIRST, REPO, XDIST_GROUPS

TESTS = REPO / "tests"
MODULES = {p.stem: p for p in TESTS.rglob("test_*.py")}


def quick_modules(paths: dict[str, Path]) -> set[str]:
    """Modules whose module-level `pytestmark` carries `pytest.mark.quick`."""
    out = set()
    for name, p in paths.items():
        for node in ast.parse(p.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(getattr(t, "id", "") == "pytestmark" for t in targets) and "pytest.mark.quick" in ast.unparse(node):
                out.add(name)
    return out


def test_every_test_module_is_in_a_folder() -> None:
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == []


def test_the_quick_tier_is_declared_in_its_modules_and_starts_no_daemon() -> None:
    quick = quick_modules(MODULES)
    assert len(quick) >= 40, sorted(quick)  # a marker lost in a refactor shows here
    daemons = ("DaemonProcess", "daemon_factory", "support_fleet_daemons")
    assert sorted(m for m in quick if any(d in MODULES[m].read_text() for d in daemons)) == []


def test_a_quick_marker_is_found(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text("import pytest\npytestmark = [pytest.mark.timeout(9), pytest.mark.quick]\n")
    (tmp_path / "test_b.py").write_text("import pytest\npytestmark = pytest.mark.slow\n")
    assert quick_modules({p.stem: p for p in tmp_path.glob("*.py")}) == {"test_a"}


def test_the_groups_and_the_order_name_existing_modules_or_groups() -> None:
    assert sorted(m.removesuffix(".py") for m in XDIST_GROUPS if m.removesuffix(".py") not in MODULES) == []
    groups = set(XDIST_GROUPS.values())
    assert sorted(g for g in LONGEST_FIRST if g not in groups and g.removesuffix(".py") not in MODULES) == []



HELPERS = {"wait_until": "support_wait.py", "free_port": "support_wait.py", "free_ports": "support_wait.py",
           "moto_server": "conftest.py"}  # fmt: skip


def defined_helpers(root: Path) -> list[str]:
    """`path: name` for each top-level function under `root` named like a shared helper
    (`free_port_number` too) outside the helper's home module."""
    out = []
    for p in sorted(root.rglob("*.py")):
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith(tuple(HELPERS)) and \
                    HELPERS.get(node.name, "") != p.name:
                out.append(f"{p.relative_to(root)}: {node.name}")
    return out


def test_waiting_ports_and_moto_have_one_helper_each() -> None:
    """One helper each (issue 35): a test that needs a port, a wait or an S3 server imports it."""
    assert defined_helpers(TESTS) == []


def test_the_helper_check_finds_a_second_definition(tmp_path: Path) -> None:
    (tmp_path / "test_b.py").write_text("def free_port_number() -> int:\n    return 1\n\n\ndef wait_until():\n    pass\n")
    assert defined_helpers(tmp_path) == ["test_b.py: free_port_number", "test_b.py: wait_until"]
