"""The package's shape, checked from its source: the layers (ARCHITECTURE.md), no import cycles,
one writer of checkpoint status, one of serving and last_good, engine clients driven through their
public interface and declared capabilities, small modules, a short root, packages that say what they own,
a rollout package of at most 12 modules, no test hook read by production code, and no job-kind
dispatch in the controller (each command runs itself).

Import edges are every `import` in a module (top level, inside functions, under TYPE_CHECKING) plus
every registry entry written as "daemon.module:attribute" (resolved by name at run time), so a
cycle cannot hide behind a lazy import; a name taken from a package's public face is an edge to the
module the face takes it from (tests/support_imports.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO
from support_imports import imports, modules

pytestmark = pytest.mark.quick

PACKAGE = REPO / "daemon"
MODULES = modules()


def _imports(module: str, path: Path) -> set[str]:
    return imports(module, path, MODULES)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# The layers, bottom up, written down once (ARCHITECTURE.md "Layers" says why): a module imports
# modules of its own layer or below, never above. The longest matching prefix gives the layer.
LAYERS: dict[str, int] = {
    # 0 leaves: import nothing of the daemon's but other leaves
    "daemon": 0, "daemon.common": 0, "daemon.formats": 0, "daemon.crc": 0, "daemon.hashing": 0,
    "daemon.manifest": 0, "daemon.tinymodel": 0,
    # the one byte pipeline, and what a staged version is between processes (both leaves)
    "daemon.bytepipe": 0, "daemon.handoff": 0, "daemon.delta": 0,
    # 1 parts: the registry, what moves and checks bytes, the processes beside the daemon
    "daemon.registry": 1, "daemon.transport": 1, "daemon.checks": 1, "daemon.loader": 1,
    "daemon.engines": 1, "daemon.sources": 1, "daemon.worker": 1, "daemon.client": 1, "daemon.gates": 1, "daemon.webhooks": 1,
    # 2 the config, which reads the parts' tables (sources, worker kinds, transports)
    "daemon.config": 2, "daemon.fleet.settings": 2,
    # 3-5 the mechanism, the fleet on top of it, the policy that drives both; the pipeline
    "daemon.rollout": 3, "daemon.fleet": 4, "daemon.controller": 5, "daemon.pipeline": 5,
    # 6-8 the faces: HTTP API and process plumbing, the daemon process, the command line
    "daemon.api": 6, "daemon.process": 6, "daemon.service": 7, "daemon.cli": 8,
}


def layer(module: str) -> int:
    name = module
    while name not in LAYERS:
        name = name.rpartition(".")[0]
        assert name, f"{module} has no layer: add its package to LAYERS (and ARCHITECTURE.md)"
    return LAYERS[name]


def upward_imports(modules: dict[str, Path]) -> list[str]:
    return [f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
            for m, p in sorted(modules.items()) for d in sorted(_imports(m, p)) if layer(d) > layer(m)]


def test_no_module_imports_a_higher_layer() -> None:
    assert upward_imports(MODULES) == []


def test_the_layer_check_fails_on_an_upward_import(tmp_path: Path) -> None:
    leaf = tmp_path / "hashing.py"
    leaf.write_text("def f():\n    from daemon.rollout.engine import RolloutEngine\n")
    assert upward_imports({"daemon.hashing": leaf}) == [
        "daemon.hashing (layer 0) imports daemon.rollout.engine (layer 3)"]


def test_nothing_imports_the_cli() -> None:
    assert [f"{m} -> {d}" for m, p in MODULES.items() if not m.startswith("daemon.cli")
            for d in _imports(m, p) if d.startswith("daemon.cli")] == []


def test_transports_and_checks_never_import_rollout_fleet_api_or_cli() -> None:
    above = ("daemon.rollout", "daemon.fleet", "daemon.controller", "daemon.pipeline", "daemon.api", "daemon.cli")
    assert [f"{m} -> {d}" for m, p in MODULES.items() if m.startswith(("daemon.transport", "daemon.checks"))
            for d in _imports(m, p) if d.startswith(above)] == []


SIBLINGS = ("daemon.checks", "daemon.transport", "daemon.loader")


def sibling_imports(modules: dict[str, Path]) -> list[str]:
    """Imports between checks, transport and loader: what they share lives below them
    (daemon.bytepipe, daemon.handoff), so none of the three imports another."""
    def pkg(m: str) -> str | None:
        return next((s for s in SIBLINGS if m == s or m.startswith(s + ".")), None)

    return [f"{m} -> {d}" for m, p in sorted(modules.items()) if pkg(m)
            for d in sorted(_imports(m, p)) if pkg(d) not in (None, pkg(m))]


def test_checks_transport_and_loader_import_none_of_each_other() -> None:
    assert sibling_imports(MODULES) == []


def test_the_sibling_check_fails_on_a_lazy_import_between_them(tmp_path: Path) -> None:
    view = tmp_path / "view.py"
    view.write_text("def f():\n    from daemon.loader.store import LoaderStore\n")
    assert sibling_imports({"daemon.checks.view": view}) == ["daemon.checks.view -> daemon.loader.store"]


def test_the_root_of_the_package_holds_at_most_ten_modules() -> None:
    assert len([p.name for p in PACKAGE.glob("*.py")]) <= 10, sorted(p.name for p in PACKAGE.glob("*.py"))


def test_no_module_is_over_450_lines() -> None:
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 450}
    assert long == {}


def test_every_package_says_what_it_owns_and_architecture_md_names_it() -> None:
    arch = (REPO / "ARCHITECTURE.md").read_text()
    packages = sorted(p.parent for p in PACKAGE.rglob("__init__.py"))
    assert [p for p in packages if not ast.get_docstring(ast.parse((p / "__init__.py").read_text()))] == []
    named = [p.relative_to(REPO).as_posix() + "/" for p in packages if p.parent == PACKAGE]
    assert [n for n in named if n not in arch] == []


def test_no_import_cycle_inside_the_package() -> None:
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_a_lazy_import_and_a_registry_string_are_edges(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from daemon.config import Config\nX = {'a': 'daemon.controller.service:RolloutService'}\n")
    assert _imports("daemon.m", src) == {"daemon.config", "daemon.controller.service"}


def _status_writes(path: Path) -> list[str]:
    """Places that assign a checkpoint's status: `x.status = ...`, `Checkpoint(status=...)`, `.values(status=...)`.

    `self.status = ...` is an object's own field (an HTTP error's status code), not a checkpoint's."""
    tree = ast.parse(path.read_text(), str(path))
    hits = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == "status" and ast.unparse(t.value) != "self":
                hits.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("Checkpoint", "values") and any(k.arg == "status" for k in node.keywords):
                hits.append(f"{path.name}:{node.lineno}")
    return hits


def test_checkpoint_status_is_written_in_exactly_one_module() -> None:
    writers = {m: hits for m, p in MODULES.items() if (hits := _status_writes(p))}
    assert list(writers) == ["daemon.registry.status"], writers


ALIAS_ROWS = (r"Alias", r"AdapterAlias")
ALIAS_SQL = re.compile(r"\b(insert\s+into|update|delete\s+from)\s+\W?(adapter_)?aliases\b", re.IGNORECASE)


def _alias_writes(path: Path) -> tuple[list[str], list[str]]:
    """(places that may set an alias through the registry, places that write alias rows themselves).

    The first: every use of `.set_alias` (a call, or the method taken as a value: partial,
    a variable, getattr's string) except a call naming the `pinned` alias literally, the
    operator's hold (`journal.set_alias(alias, id)`, `adapters.set_alias(name, alias, id)`).
    The second: `Alias(...)`, `AdapterAlias(...)`, insert/update/delete of them, SQL text
    that changes `aliases` or `adapter_aliases`."""
    tree = ast.parse(path.read_text(), str(path))
    pinned: set[int] = set()  # the Attribute nodes of `.set_alias("pinned", ...)`-shaped calls
    rows = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "set_alias" and not node.keywords and len(node.args) in (2, 3):
                alias = node.args[len(node.args) - 2]
                if isinstance(alias, ast.Constant) and alias.value == "pinned":
                    pinned.add(id(f))
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            first = ast.unparse(node.args[0]) if node.args else ""
            if name in ALIAS_ROWS or (name in ("insert", "update", "delete") and first in ALIAS_ROWS):
                rows.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ALIAS_SQL.search(node.value):
            rows.append(f"{path.name}:{node.lineno}")
    sets = [f"{path.name}:{n.lineno}" for n in ast.walk(tree)
            if (isinstance(n, ast.Attribute) and n.attr == "set_alias" and id(n) not in pinned)
            or (isinstance(n, ast.Constant) and n.value == "set_alias")]  # fmt: skip
    return sets, rows


def test_serving_and_last_good_are_written_in_exactly_one_module() -> None:
    """daemon.controller.served decides nothing and writes them all (ARCHITECTURE.md, controller);
    the registry's set_alias methods are the only code that writes alias rows."""
    writes = {m: _alias_writes(p) for m, p in MODULES.items()}
    setters = {m: sets for m, (sets, _) in writes.items() if sets}
    assert sorted(setters) == ["daemon.controller.served"], setters
    row_writers = {m: rows for m, (_, rows) in writes.items() if rows}
    assert sorted(row_writers) == ["daemon.registry.adapters", "daemon.registry.journal"], row_writers


def test_the_alias_check_finds_a_write_however_it_is_spelled(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    cases = {"j.set_alias('serving', 1)": 1, "j.set_alias(name, 1)": 1, "a.set_alias(n, 'last_good', 1)": 1,
             "f = j.set_alias": 1, "getattr(j, 'set_alias')('serving', 1)": 1, "j.set_alias(name='pinned', checkpoint_id=1)": 1,
             "j.set_alias('pinned', 1)": 0, "a.set_alias(n, 'pinned', None)": 0}  # fmt: skip
    for code, found in cases.items():
        src.write_text(code + "\n")
        assert len(_alias_writes(src)[0]) == found, code
    src.write_text("s.add(Alias(name='serving'))\ns.execute(update(AdapterAlias).values(checkpoint_id=1))\n"
                   "c.exec_driver_sql('UPDATE aliases SET checkpoint_id = 2')\n")
    assert sorted(_alias_writes(src)[1]) == ["m.py:1", "m.py:2", "m.py:3"]


def private_client_calls(modules: dict[str, Path]) -> list[str]:
    """Outside daemon/engines/: calls of an engine client's private method (`h.client._admin(...)`,
    `client._call(...)`) and any `._admin(` at all. A worker is driven through the public
    `WorkerClient` interface and what its capabilities declare (daemon/engines/base.py)."""
    hits = []
    for m, p in sorted(modules.items()):
        if m.startswith("daemon.engines"):
            continue
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                attr, receiver = node.func.attr, ast.unparse(node.func.value).rpartition(".")[2]
                if attr.startswith("_") and not attr.startswith("__") and (attr == "_admin" or receiver.endswith("client")):
                    hits.append(f"{m}:{node.lineno} {ast.unparse(node.func)}")
    return hits


def test_no_code_outside_the_engines_calls_a_private_method_of_a_client() -> None:
    assert private_client_calls(MODULES) == []


def api_isinstance_of_clients(modules: dict[str, Path]) -> list[str]:
    """`isinstance(x, C)` in daemon/api/ where C is a class of daemon/engines/ other than the
    interface (base.py: the protocols and errors): the API picks workers by capability."""
    engine_classes = {n.name for m, p in modules.items() if m.startswith("daemon.engines") and m != "daemon.engines.base"
                      for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)}  # fmt: skip
    hits = []
    for m, p in sorted(modules.items()):
        if not m.startswith("daemon.api"):
            continue
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance" and len(node.args) == 2:
                named = {ast.unparse(n).rpartition(".")[2] for n in ast.walk(node.args[1]) if isinstance(n, ast.Name | ast.Attribute)}
                hits += [f"{m}:{node.lineno} isinstance(..., {c})" for c in sorted(named & engine_classes)]
    return hits


def test_the_api_never_asks_which_engine_client_a_worker_has() -> None:
    assert api_isinstance_of_clients(MODULES) == []


def test_rollout_package_has_at_most_twelve_modules() -> None:
    rollout = sorted(p.name for p in (PACKAGE / "rollout").glob("*.py"))
    assert len(rollout) <= 12, rollout


@pytest.mark.parametrize("needle", ["HOTSWAP_TEST_", "HOTSWAP_WORKER_PAUSE"])
def test_production_code_reads_no_test_hook(needle: str) -> None:
    assert [m for m, p in MODULES.items() if needle in p.read_text()] == []


def test_type_checking_blocks_import_nothing_of_the_package() -> None:
    """They exist only to keep torch out of processes that never use it, never to hide a cycle.
    One exception: a package's `__init__` names its lazy public face there, its own modules'
    names (daemon/__init__.py, `public_face`; each user's edge names the module)."""
    offenders = []
    for m, p in MODULES.items():
        own = m + "." if p.name == "__init__.py" else None
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for sub in ast.walk(node):
                    if isinstance(sub, ast.ImportFrom | ast.Import):
                        names = [sub.module or ""] if isinstance(sub, ast.ImportFrom) else [a.name for a in sub.names]
                        offenders += [f"{m}: {n}" for n in names if n.startswith("daemon")
                                      and not (own and isinstance(sub, ast.ImportFrom) and (n + ".").startswith(own))]
    assert offenders == []


def _calls(attr: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr:
                out[m] = out.get(m, 0) + 1
    return out


def test_worker_state_moves_only_through_the_state_machine() -> None:
    # the recorded transition (events + workers.state) and the handle's position change together,
    # in one place: WorkerDriver.move
    assert list(_calls("moved")) == ["daemon.rollout.driver"]
    assert list(_calls("transition")) == ["daemon.rollout.driver"]


def test_architecture_md_has_an_invariant_per_package_and_a_glossary() -> None:
    arch = (REPO / "ARCHITECTURE.md").read_text()
    code_map = arch.split("## Code map", 1)[1].split("\n## ", 1)[0]
    sections = code_map.split("\n### ")[1:]
    assert sections, "ARCHITECTURE.md has no code map"
    assert [s.splitlines()[0] for s in sections if "**Architecture invariant:**" not in s] == []
    assert "\n## Glossary\n" in arch


def test_comments_cite_only_files_the_repository_has() -> None:
    cited = re.compile(r"(?<![$\w/.-])([A-Za-z0-9_.-][A-Za-z0-9_./-]*\.md)\b")  # not $OUT/x.md
    missing = []
    for p in [*PACKAGE.rglob("*.py"), *(REPO / "bench").glob("*.py")]:
        for name in cited.findall(p.read_text()):
            if not any((base / name).exists() for base in (REPO, REPO / "docs", p.parent)):
                missing.append(f"{p.relative_to(REPO)}: {name}")
    assert missing == []


def _folder(module: str) -> str:
    return ".".join(module.split(".")[:2])


def folder_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Cycles between top-level folders (and root modules) of the package: an import that runs back up."""
    graph: dict[str, set[str]] = {}
    for m, p in modules.items():
        for d in _imports(m, p):
            if _folder(m) != _folder(d):
                graph.setdefault(_folder(m), set()).add(_folder(d))
    return _cycles(graph)


def test_at_most_one_cycle_between_folders() -> None:
    # The one left: config reads the fleet's settings table (daemon.fleet.settings, layer 2), the
    # fleet builds on the rollout, and the rollout reads the config's sections.
    assert folder_cycles(MODULES) == [["daemon.config", "daemon.fleet", "daemon.rollout"]]


def test_the_registry_imports_no_engine_client_and_no_check() -> None:
    # the registry stores what the config validated; it never reads the engines' or the checks' tables
    assert [f"{m} -> {d}" for m, p in MODULES.items() if m.startswith("daemon.registry")
            for d in _imports(m, p) if d.startswith(("daemon.engines", "daemon.checks"))] == []


# the job names the runner once dispatched on; not "deploy" nor "adapter", which also name a desired
# step (daemon.controller.desired) and a checkpoint kind
JOB_NAMES = {"rollback", "pin", "unpin", "converge", "reconcile", "adapter_deploy", "adapter_rollback",
             "adapter_pin", "adapter_unpin", "adapter_reconcile"}  # fmt: skip


def _names(node: ast.AST) -> set[str]:
    return {ast.unparse(n).rpartition(".")[2] for n in ast.walk(node) if isinstance(n, ast.Name | ast.Attribute)}


def _job_names(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in JOB_NAMES}


def job_kind_dispatch(modules: dict[str, Path]) -> list[str]:
    """Job-kind dispatch in daemon/controller/, however spelled: a job name compared or matched
    (`job.kind == "pin"`, `kind in ("reconcile", ...)`), a `Literal` of job names, a job built from
    its name (`Job("pin")`, `kind="pin"`), or a command's class asked for (`isinstance(job, Pin)`,
    `type(job) is Pin`, `case Pin()`, a table keyed by it). Each command of
    daemon.controller.commands runs itself: the runner never asks which one it holds."""
    tree = ast.parse(modules["daemon.controller.commands"].read_text())
    commands = {c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and "Command" in _names(c) | {c.name}}
    hits = []
    for m, p in sorted(modules.items()):
        if not m.startswith("daemon.controller"):
            continue
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            asks: set[str] = set()
            if isinstance(node, ast.Compare | ast.MatchValue | ast.MatchClass):
                asks = _job_names(node) | (_names(node) & commands)
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("Literal"):
                asks = _job_names(node.slice)
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("isinstance", "issubclass"):
                asks = _names(node) & commands
            elif isinstance(node, ast.Call):
                built = [*node.args[:1], *(k.value for k in node.keywords if k.arg == "kind")]
                asks = {n for a in built if isinstance(a, ast.Constant) for n in _job_names(a)}
            elif isinstance(node, ast.Dict):
                asks = {n for k in node.keys if k is not None for n in _names(k) & commands}
            if asks:
                hits.append(f"{m}:{node.lineno} {ast.unparse(node)[:60]}")
    return hits


def test_the_controller_has_no_job_kind_dispatch() -> None:
    assert job_kind_dispatch(MODULES) == []


@pytest.mark.parametrize("source", [
    'if job.kind == "pin":\n    pass\n',
    'if job.kind in ("reconcile", "adapter_reconcile"):\n    pass\n',
    'JobKind = Literal["deploy", "rollback"]\n',
    'queue.command(Job(kind="pin", version="v1"))\n',
    'queue.command(Job("reconcile"))\n',
    'if isinstance(job, Pin):\n    pass\n',
    'if type(job) is Rollback:\n    pass\n',
    'match job:\n    case Pin():\n        pass\n',
    'match job.kind:\n    case "unpin":\n        pass\n',
    'RUN = {Pin: run_pin}\n',
])  # fmt: skip
def test_the_dispatch_check_finds_each_spelling(tmp_path: Path, source: str) -> None:
    service = tmp_path / "service.py"
    service.write_text(source)
    found = job_kind_dispatch({"daemon.controller.commands": MODULES["daemon.controller.commands"],
                               "daemon.controller.service": service})  # fmt: skip
    assert len(found) == 1 and found[0].startswith("daemon.controller.service:"), found
