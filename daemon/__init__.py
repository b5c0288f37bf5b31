"""hotswap: keep LLM serving workers on the newest good checkpoint without restarting them.

Every package's `__init__` is its public face: its `__all__` names what other packages may
import, and they import it from the package, never from one of its modules (ARCHITECTURE.md,
tests/project/test_public_face.py). `public_face` makes such names lazy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"


def public_face(package: str) -> Callable[[str], Any]:
    """A PEP 562 `__getattr__` for `package`'s `__init__`: a name imported there under
    `if TYPE_CHECKING:` is imported from the module named there on first use, so importing the
    package stays cheap and creates no import cycle, while mypy sees the real name. Not cached:
    each use reads the module's current attribute (a test's monkeypatch of the module holds)."""
    names: dict[str, str] | None = None

    def __getattr__(name: str) -> Any:
        nonlocal names
        if names is None:
            names = _lazy_names(package)
        source = names.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        if source == package:  # a submodule used as a namespace (`from daemon.registry import queries`)
            return importlib.import_module(f"{package}.{name}")
        return getattr(importlib.import_module(source), name)

    return __getattr__


def _lazy_names(package: str) -> dict[str, str]:
    """name -> module, for every `from M import name` under `if TYPE_CHECKING:` in the package's `__init__`."""
    import ast
    import sys

    path = sys.modules[package].__file__
    assert path is not None, package
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                if isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
                    out.update({a.asname or a.name: sub.module for a in sub.names})
    return out
