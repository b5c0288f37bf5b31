"""The package's import graph, read from its source (tests/project/test_layout.py, test_public_face.py).

An import is every `import` in a module (top level, inside functions, under TYPE_CHECKING) plus
every registry entry written as "daemon.module:attribute" (resolved by name at run time), so a
cycle cannot hide behind a lazy import.

A package's `__init__` is its public face (daemon/__init__.py, `public_face`): other packages
import `from daemon.registry import Journal`, not `from daemon.registry.journal import Journal`.
`imports(..., follow=True)`, the graph of the layer, sibling and cycle checks, follows such a name
to the module the face takes it from (its `__init__`'s import of that name, eager or under
TYPE_CHECKING), so an edge still names the module used, not the package. The face's own imports
of its modules under TYPE_CHECKING are no edges of the package: they run only when a name is used,
and each user's edge names that module. `follow=False` gives the import as written, with a
package's public name (in its `__all__`) an import of the package: what the public-face check reads.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "daemon"
REGISTRY_ENTRY = re.compile(r"^(daemon(?:\.\w+)+):(\w+)$")


def modules(root: Path = REPO) -> dict[str, Path]:
    """Dotted name -> file, for every module of `root`/daemon (a package by its `__init__.py`)."""
    out = {}
    for p in sorted((root / "daemon").rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = modules()


def resolve(name: str, mods: dict[str, Path] = MODULES) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def _parsed(path: Path, text: str) -> ast.Module:
    return ast.parse(text, str(path))


def parse(path: Path) -> ast.Module:
    return _parsed(path, path.read_text())


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def face(path: Path) -> dict[str, str]:
    """A package `__init__`'s public names -> the module each is imported from there (top level or
    under TYPE_CHECKING); a name the `__init__` defines itself maps to the package."""
    tree = parse(path)
    out: dict[str, str] = {}
    body = [n for top in tree.body for n in (top.body if isinstance(top, ast.If) and _type_checking(top) else [top])]
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.update({a.asname or a.name: node.module for a in node.names})
    return out


def public_names(path: Path) -> list[str]:
    """The `__all__` of a package's `__init__` ([] when it has none)."""
    for node in parse(path).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def target(base: str, name: str, mods: dict[str, Path] = MODULES, *, follow: bool = True) -> str | None:
    """The module `from base import name` imports: a submodule, the module `base` itself, or, for
    a package's public name, the package (follow=False) or the module its face takes it from."""
    package = resolve(base, mods)
    if package == base and mods[base].name == "__init__.py" and not follow and name in public_names(mods[base]):
        return base
    if f"{base}.{name}" in mods:
        return f"{base}.{name}"
    seen: set[str] = set()
    while follow and package is not None and mods[package].name == "__init__.py" and package not in seen:
        seen.add(package)
        source = face(mods[package]).get(name)
        if source is None or source == package:
            break
        if f"{source}.{name}" in mods:
            return f"{source}.{name}"
        package = resolve(source, mods)
    return package


def imports(module: str, path: Path, mods: dict[str, Path] = MODULES, *, follow: bool = True) -> set[str]:
    """The modules `module` (read from `path`) imports; see the module docstring."""
    tree = parse(path)
    skip: set[int] = set()
    if path.name == "__init__.py" and follow:  # the face's lazy names: edges of their users, not of the package
        skip = {id(n) for top in tree.body if _type_checking(top) for n in ast.walk(top)
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(module + ".")}  # fmt: skip
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {resolve(a.name, mods) for a in node.names if a.name.startswith("daemon")}
        elif isinstance(node, ast.ImportFrom) and id(node) not in skip:
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            if base.startswith("daemon"):
                found |= {target(base, a.name, mods, follow=follow) for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = REGISTRY_ENTRY.match(node.value)
            if m:
                found.add(target(m.group(1), m.group(2), mods, follow=follow))
    found.discard(None)
    found.discard(module)
    return {f for f in found if f is not None}
