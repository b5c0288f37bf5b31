"""A package's `__init__` is its public face: code outside a package imports only the names its
`__init__` exports (`__all__`), never one of its modules (ARCHITECTURE.md). Every import counts:
top level, inside a function, under TYPE_CHECKING, and registry strings "daemon.module:attribute".
"""

from __future__ import annotations

import importlib
import types
from pathlib import Path

import pytest
from support_imports import MODULES, imports, modules, public_names

pytestmark = pytest.mark.quick


def face_breaches(mods: dict[str, Path]) -> list[str]:
    """"importer -> imported" for each module inside a package P, other than P's `__init__`,
    imported by a module outside P (a package's public name counts as an import of the package)."""
    packages = [m for m, p in mods.items() if p.name == "__init__.py"]
    out = []
    for m, p in sorted(mods.items()):
        for d in sorted(imports(m, p, mods, follow=False)):
            if any(d.startswith(P + ".") and not (m == P or m.startswith(P + ".")) for P in packages):
                out.append(f"{m} -> {d}")
    return out


def test_no_module_outside_a_package_imports_one_of_its_modules() -> None:
    assert face_breaches(MODULES) == []


def test_the_face_check_finds_each_way_past_a_face(tmp_path: Path) -> None:
    files = {
        "daemon/__init__.py": "",
        "daemon/a/__init__.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from daemon.a.impl import X\n"
                                 "__all__ = ['X', 'ns']\n"),
        "daemon/a/impl.py": "X = 1\n",
        "daemon/a/ns.py": "Y = 2\n",
        "daemon/a/hidden.py": "Z = 3\n",
        "daemon/a/inner.py": "from daemon.a.impl import X\n",  # inside the package: its own business
        "daemon/b/__init__.py": "",
        "daemon/b/fine.py": "from daemon.a import X, ns\nS = 'daemon.a:X'\n",
        "daemon/b/lazy.py": "def f():\n    from daemon.a.impl import X\n",
        "daemon/b/plain.py": "import daemon.a.hidden\n",
        "daemon/b/submodule.py": "from daemon.a import hidden\n",
        "daemon/b/string.py": "ENTRY = 'daemon.a.impl:X'\n",
        "daemon/root.py": "from daemon.a.impl import X\n",
    }  # fmt: skip
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert face_breaches(modules(tmp_path)) == [
        "daemon.b.lazy -> daemon.a.impl", "daemon.b.plain -> daemon.a.hidden",
        "daemon.b.string -> daemon.a.impl", "daemon.b.submodule -> daemon.a.hidden", "daemon.root -> daemon.a.impl"]  # fmt: skip


PACKAGES = sorted(m for m, p in MODULES.items() if p.name == "__init__.py")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_of_a_package_resolves(package: str) -> None:
    """Each name of `__all__` is there (eager, or lazy through `public_face`), and a name that is
    also a submodule's is that submodule (a function of the same name would shadow it)."""
    mod = importlib.import_module(package)
    names = public_names(MODULES[package])
    assert sorted(names) == sorted(set(names)), "a name twice in __all__"
    for name in names:
        value = getattr(mod, name)
        if f"{package}.{name}" in MODULES:
            assert isinstance(value, types.ModuleType) and value.__name__ == f"{package}.{name}", name


def test_the_face_graph_follows_a_public_name_to_its_module() -> None:
    assert imports("daemon.x", MODULES["daemon.controller.served"]) >= {"daemon.registry.journal"}
    assert "daemon.registry" in imports("daemon.x", MODULES["daemon.controller.served"], follow=False)
