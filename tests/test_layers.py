"""Package architecture, checked statically: layer order, private names, import cycles.

Every ``.py`` file of the package (the repo root is the package ``tritonspec``: its root modules
and its top-level packages; not ``tests/``, ``perf/``, build output or hidden folders) is parsed
with ``ast`` -- nothing is imported -- and three rules are checked:

(a) layers. Lowest first::

        rank 0  demo, drafters (data: import nothing from the package), kernels
        rank 1  runtime
        rank 2  autotune, training
        rank 3  recipes
        rank 4  cli and the root package (__init__.py, __main__.py)

    A module imports from its own top-level package and from lower ranks only. Two packages of
    one rank are siblings and do not import each other (autotune/training, demo/kernels); the
    root modules (cli, __init__, __main__) count as one package. Relative imports, absolute
    ``tritonspec.*`` imports and ``__import__``/``importlib.import_module`` of a literal name
    are resolved; function-local imports count. ``from .. import __version__`` imports the root
    package (rank 4). A top-level name missing from ``LAYERS`` fails the check.

(b) private names. A name with one leading underscore (``_x``, not a dunder) belongs to the
    top-level package that defines it. Another package must not import it
    (``from ..runtime.engine import _Tree``), import from or import a private module
    (``..kernels._triton_utils``), or read/write it as an attribute. On a module of another
    package (``engine._x``, ``tritonspec.cli._x``; import aliases are followed) any private
    attribute is reported. On any other object (``rt._prefill``, ``getattr(rt, "_prefill")``)
    the name is reported when other packages define it as a member (a def, class or assignment
    in a class body, or ``self._x = ...``/``cls._x = ...``) and the using package does not: a
    module-level ``def _prefill`` of one's own is no attribute of ``rt`` and does not excuse
    ``rt._prefill``. ``self._x`` is never checked. Within a package private names are free.

(c) import cycles among the modules, over module-level imports. Function-local imports and
    ``if TYPE_CHECKING:`` imports do not run at import time and are left out of this graph (they
    still count for (a)). The implicit import of parent packages is left out as well.

The checkers take any folder (``check_tree(root)``) so the tests below feed them small synthetic
trees; ``test_package_*`` runs them on the real tree and lists every violation.
"""

from __future__ import annotations

import ast
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "tritonspec"
ROOT = Path(__file__).resolve().parent.parent  # the repo root is the package folder

# Top-level name -> rank (lowest first). Root-level modules are listed by module name.
LAYERS: dict[str, int] = {
    "demo": 0,
    "drafters": 0,
    "kernels": 0,
    "runtime": 1,
    "autotune": 2,
    "training": 2,
    "recipes": 3,
    "cli": 4,
    "__init__": 4,
    "__main__": 4,
}
# Root-level modules that form one package (the root package) for both rules.
ROOT_MODULES = frozenset({"cli", "__init__", "__main__"})
# Folders that are not part of the package (plus hidden folders and *.egg-info).
EXCLUDED_DIRS = frozenset({"tests", "perf", "build", "dist", "__pycache__"})

UPWARD = "upward import"
SAME_RANK = "same-rank import"
UNKNOWN = "unknown package"
BAD_RELATIVE = "bad relative import"
PRIVATE_NAME = "private name"
PRIVATE_MODULE = "private module"
CYCLE = "import cycle"


# ---------------------------------------------------------------------------------------------
# model


@dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. tritonspec.runtime.engine
    rel: str  # path relative to the root, for messages
    is_pkg: bool  # an __init__.py
    tree: ast.Module

    @property
    def top(self) -> str:
        return top_of(self.name)


@dataclass(frozen=True)
class Import:
    module: Module  # the importer
    line: int
    target: str  # the resolved module, e.g. tritonspec.runtime.engine
    names: tuple[str, ...] = ()  # names taken from ``target`` that are not submodules
    local: bool = False  # inside a function body
    type_checking: bool = False  # under ``if TYPE_CHECKING:``
    alias: str | None = None  # the local name bound to the module ``target`` (``import x.y as m``)


@dataclass(frozen=True, order=True)
class Violation:
    rel: str
    line: int
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.rel}:{self.line} {self.detail} [{self.rule}]"


def top_of(dotted: str) -> str:
    """The top-level name of a module of the package: ``runtime``, ``cli``, ``__init__`` (root)."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def unit_of(top: str) -> str:
    """The package a top-level name belongs to for the rules (the root modules are one)."""
    return PACKAGE if top in ROOT_MODULES else top


def label(top: str) -> str:
    return PACKAGE if top == "__init__" else top


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# ---------------------------------------------------------------------------------------------
# collection


def collect_modules(root: Path, package: str = PACKAGE) -> dict[str, Module]:
    """Parse every module of the package under ``root`` (the package folder itself)."""
    root = Path(root)
    modules: dict[str, Module] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == root:
            dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and not d.endswith(".egg-info") and d != "__pycache__"
        )
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            path = here / fn
            rel = path.relative_to(root)
            parts = rel.with_suffix("").parts
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            name = ".".join((package, *parts))
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            modules[name] = Module(name, rel.as_posix(), is_pkg, tree)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self, mod: Module, known: set[str], package: str):
        self.mod, self.known, self.package = mod, known, package
        self.func_depth = 0
        self.tc_depth = 0
        self.imports: list[Import] = []
        self.errors: list[Violation] = []

    def _add(self, node: ast.AST, target: str, names: tuple[str, ...] = (), alias: str | None = None) -> None:
        self.imports.append(Import(self.mod, node.lineno, target, names, self.func_depth > 0, self.tc_depth > 0, alias))

    def _ours(self, dotted: str | None) -> bool:
        return bool(dotted) and (dotted == self.package or dotted.startswith(self.package + "."))

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.func_depth += 1
        self.generic_visit(node)
        self.func_depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.tc_depth += 1
        for stmt in node.body:
            self.visit(stmt)
        self.tc_depth -= 1
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if self._ours(alias.name):
                self._add(node, alias.name, alias=alias.asname or (alias.name if "." not in alias.name else None))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            pkg = self.mod.name if self.mod.is_pkg else self.mod.name.rpartition(".")[0]
            parts = pkg.split(".")
            if node.level - 1 >= len(parts):
                self.errors.append(
                    Violation(
                        self.mod.rel,
                        node.lineno,
                        BAD_RELATIVE,
                        f"imports {'.' * node.level}{node.module or ''}, above the top-level package {self.package}",
                    )
                )
                return
            base = ".".join(parts[: len(parts) - (node.level - 1)])
            if node.module:
                base = f"{base}.{node.module}"
        elif self._ours(node.module):
            base = node.module
        else:
            return
        names = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if alias.name != "*" and sub in self.known:
                self._add(node, sub, alias=alias.asname or alias.name)  # `from . import submodule`
            else:
                names.append(alias.name)
        if names:
            self._add(node, base, tuple(n for n in names if n != "*"))

    def visit_Call(self, node: ast.Call) -> None:
        # __import__("tritonspec.x"), importlib.import_module("tritonspec.x"), import_module("...")
        f = node.func
        fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if (
            fname in ("__import__", "import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and self._ours(node.args[0].value)
        ):
            self._add(node, node.args[0].value)
        self.generic_visit(node)


def find_imports(mod: Module, known: set[str], package: str = PACKAGE) -> tuple[list[Import], list[Violation]]:
    """The package-internal imports of one module, resolved, and unresolvable relative imports."""
    v = _ImportVisitor(mod, known, package)
    v.visit(mod.tree)
    return v.imports, v.errors


def all_imports(modules: dict[str, Module], package: str = PACKAGE) -> tuple[list[Import], list[Violation]]:
    imports, errors = [], []
    known = set(modules)
    for mod in modules.values():
        i, e = find_imports(mod, known, package)
        imports += i
        errors += e
    return imports, errors


# ---------------------------------------------------------------------------------------------
# (a) layers


def check_layers(
    modules: dict[str, Module], layers: dict[str, int] = LAYERS, package: str = PACKAGE
) -> list[Violation]:
    imports, out = all_imports(modules, package)
    tops_in_tree: dict[str, Module] = {}
    for mod in modules.values():
        tops_in_tree.setdefault(mod.top, mod)
    for top, mod in sorted(tops_in_tree.items()):
        if top not in layers:
            out.append(
                Violation(
                    mod.rel,
                    0,
                    UNKNOWN,
                    f"top-level package {top!r} has no rank: add it to the layer table LAYERS in tests/test_layers.py",
                )
            )
    for imp in imports:
        src, tgt = imp.module.top, top_of(imp.target)
        if tgt not in layers:
            if tgt not in tops_in_tree:  # else already reported above
                out.append(
                    Violation(
                        imp.module.rel,
                        imp.line,
                        UNKNOWN,
                        f"imports {imp.target}: top-level package {tgt!r} has no rank "
                        f"(and is not in the tree): add it to LAYERS in tests/test_layers.py",
                    )
                )
            continue
        if src not in layers or unit_of(src) == unit_of(tgt):
            continue
        rs, rt = layers[src], layers[tgt]
        if rt < rs:
            continue
        what = imp.target + (f" ({', '.join(imp.names)})" if imp.names else "")
        where = " in a function" if imp.local else ""
        rule = UPWARD if rt > rs else SAME_RANK
        detail = f"imports {what} (rank {rt} {label(tgt)}) from rank {rs} {label(src)}{where}"
        if rule == SAME_RANK:
            detail += f": {label(src)} and {label(tgt)} share rank {rs} and must not import each other"
        out.append(Violation(imp.module.rel, imp.line, rule, detail))
    return sorted(set(out))


# ---------------------------------------------------------------------------------------------
# (b) private names


def private_definitions(mod: Module) -> tuple[set[str], set[str]]:
    """Private names a module defines, as (members, globals). Members can be reached as
    attributes of any object: defs, classes and assignments in class bodies, and attributes
    assigned on ``self``/``cls``. Globals are reached as attributes of the module only:
    module-level defs, classes and assignments (and defs nested in functions)."""
    members: set[str] = set()
    globals_: set[str] = set()

    def targets(t: ast.expr):
        if isinstance(t, ast.Name):
            yield t.id
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from targets(e)
        elif isinstance(t, ast.Starred):
            yield from targets(t.value)

    def scan_body(body: list[ast.stmt], out: set[str]) -> None:  # a module or class body
        for stmt in body:
            tgts: list[ast.expr] = []
            if isinstance(stmt, ast.Assign):
                tgts = stmt.targets
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                tgts = [stmt.target]
            for t in tgts:
                out.update(n for n in targets(t) if is_private(n))
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and is_private(stmt.name):
                out.add(stmt.name)
            if isinstance(stmt, ast.ClassDef):
                scan_body(stmt.body, members)
            elif isinstance(stmt, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for field in ("body", "orelse", "finalbody"):
                    scan_body(getattr(stmt, field, []) or [], out)
                for h in getattr(stmt, "handlers", []):
                    scan_body(h.body, out)

    scan_body(mod.tree.body, globals_)
    for node in ast.walk(mod.tree):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and is_private(node.name)
            and node.name not in members
        ):
            globals_.add(node.name)  # nested in a function: not reachable as an attribute anyway
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and is_private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            members.add(node.attr)
    return members, globals_


def _attribute_uses(mod: Module):
    """(line, expression, receiver, private name) for ``x._name`` and ``getattr(x, "_name")``."""
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            yield node.lineno, ast.unparse(node), node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and is_private(node.args[1].value)
        ):
            yield node.lineno, ast.unparse(node), node.args[0], node.args[1].value


def check_private(modules: dict[str, Module], package: str = PACKAGE) -> list[Violation]:
    imports, _ = all_imports(modules, package)
    out: list[Violation] = []
    for imp in imports:
        src, tgt = unit_of(imp.module.top), unit_of(top_of(imp.target))
        if src == tgt:
            continue
        owner = label(top_of(imp.target))
        private_parts = [p for p in imp.target.split(".")[1:] if is_private(p)]
        if private_parts:
            out.append(
                Violation(
                    imp.module.rel,
                    imp.line,
                    PRIVATE_MODULE,
                    f"imports {imp.target}"
                    + (f" ({', '.join(imp.names)})" if imp.names else "")
                    + f": module {'.'.join(private_parts)} is private to {owner}",
                )
            )
            continue  # the names come from a private module: one report
        for name in imp.names:
            if is_private(name):
                out.append(
                    Violation(
                        imp.module.rel, imp.line, PRIVATE_NAME, f"imports {name} from {imp.target}: private to {owner}"
                    )
                )

    # top-level name -> private members defined there
    members: dict[str, set[str]] = {}
    for mod in modules.values():
        members.setdefault(mod.top, set()).update(private_definitions(mod)[0])
    aliases: dict[str, dict[str, str]] = {}  # module -> {local name: module of the package it is bound to}
    for imp in imports:
        if imp.alias and imp.target in modules:
            aliases.setdefault(imp.module.name, {})[imp.alias] = imp.target
    for mod in modules.values():
        unit = unit_of(mod.top)
        own_members = set().union(*(names for top, names in members.items() if unit_of(top) == unit))
        seen = set()
        for line, expr, receiver, name in _attribute_uses(mod):
            if (line, name) in seen:
                continue
            rmod = _receiver_module(receiver, aliases.get(mod.name, {}), modules, package)
            if rmod is not None:  # a module of the package (`engine._Tree`, `tritonspec.cli._dtype`)
                owners = [] if unit_of(top_of(rmod)) == unit else [label(top_of(rmod))]
            elif name in own_members or (isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")):
                owners = []  # may be an attribute of one of our own objects
            else:  # an object: its attributes are members (a module-level `def _x` is no attribute of `rt`)
                owners = sorted(label(top) for top, names in members.items() if unit_of(top) != unit and name in names)
            if owners:
                seen.add((line, name))
                out.append(
                    Violation(
                        mod.rel, line, PRIVATE_NAME, f"uses {name} ({_short(expr)}): private to {', '.join(owners)}"
                    )
                )
    return sorted(set(out))


def _receiver_module(node: ast.expr, aliases: dict[str, str], modules: dict[str, Module], package: str) -> str | None:
    """The module of the package a ``Name``/``Attribute`` chain names, through import aliases."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    head = aliases.get(node.id, package if node.id == package else None)
    if head is None:
        return None
    dotted = ".".join([head, *reversed(parts)])
    return dotted if dotted in modules else None


def _short(expr: str, n: int = 60) -> str:
    expr = " ".join(expr.split())
    return expr if len(expr) <= n else expr[: n - 3] + "..."


# ---------------------------------------------------------------------------------------------
# (c) cycles


def import_graph(modules: dict[str, Module], package: str = PACKAGE) -> dict[str, dict[str, Import]]:
    """module -> {imported module: first import statement}, module-level runtime imports only."""
    imports, _ = all_imports(modules, package)
    graph: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for imp in sorted(imports, key=lambda i: i.line):
        if imp.local or imp.type_checking or imp.target not in modules:
            continue
        graph[imp.module.name].setdefault(imp.target, imp)
    return graph


def _sccs(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _cycle_through(graph: dict[str, dict[str, Import]], start: str, comp: set[str]) -> list[str]:
    """A shortest cycle start -> ... -> start inside one strongly connected component."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in comp:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return []


def check_cycles(modules: dict[str, Module], package: str = PACKAGE) -> list[Violation]:
    graph = import_graph(modules, package)
    out = []
    for comp in _sccs(graph):
        if len(comp) == 1 and comp[0] not in graph[comp[0]]:
            continue
        cycle = _cycle_through(graph, comp[0], set(comp))
        hops = [f"{a} ({graph[a][b].module.rel}:{graph[a][b].line})" for a, b in zip(cycle, cycle[1:])]
        detail = "import cycle: " + " -> ".join([*hops, cycle[-1]])
        if len(comp) > len(cycle) - 1:
            detail += f"; the cycle's component also holds {', '.join(m for m in comp if m not in cycle)}"
        first = graph[cycle[0]][cycle[1]]
        out.append(Violation(first.module.rel, first.line, CYCLE, detail))
    return sorted(out)


# ---------------------------------------------------------------------------------------------


CHECKS = {"layers": check_layers, "private": check_private, "cycles": check_cycles}


def check_tree(root: Path, package: str = PACKAGE) -> list[Violation]:
    modules = collect_modules(root, package)
    return sorted({v for check in CHECKS.values() for v in check(modules, package=package)})


def _report(violations: list[Violation], what: str) -> str:
    return f"{len(violations)} {what} violation(s):\n" + "\n".join(f"  {v}" for v in violations)


# ---------------------------------------------------------------------------------------------
# the real tree


@pytest.fixture(scope="module")
def real_modules() -> dict[str, Module]:
    return collect_modules(ROOT)


def test_real_tree_is_collected(real_modules):
    names = set(real_modules)
    assert {
        PACKAGE,
        f"{PACKAGE}.__main__",
        f"{PACKAGE}.cli",
        f"{PACKAGE}.runtime.engine",
        f"{PACKAGE}.kernels",
        f"{PACKAGE}.demo",
    } <= names
    assert not any(m.rel.startswith(("tests/", "perf/", "build/", ".")) for m in real_modules.values())


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_package(real_modules, check):
    """The package obeys the layer table, keeps private names private and has no import cycles."""
    violations = CHECKS[check](real_modules)
    if violations:
        legend = "layers (lowest first): " + "; ".join(
            f"{r}: {', '.join(label(t) for t in LAYERS if LAYERS[t] == r)}" for r in sorted(set(LAYERS.values()))
        )
        pytest.fail(_report(violations, check) + "\n" + legend, pytrace=False)


# ---------------------------------------------------------------------------------------------
# the checkers on synthetic trees


def make_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, src in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(src))
    return root


CLEAN = {
    "__init__.py": """\
        from .runtime.engine import Engine
        from .demo import PAIRS
        __version__ = "0"
        """,
    "__main__.py": "from .cli import main\n",
    "cli.py": """\
        import tritonspec as ts
        from . import __version__
        def _dtype(x):
            return x
        def main():
            from .recipes.demo import run
            from .training import train
            from .autotune.tune import tune
            return ts.Engine, run, train, tune, _dtype
        """,
    "demo/__init__.py": "PAIRS = {}\n_private = 1\n",
    "kernels/__init__.py": "",
    "kernels/_utils.py": "def _pow2(x):\n    return x\n",
    "kernels/ops.py": "from ._utils import _pow2\nfrom . import _utils\nX = _utils._pow2(3)\n",
    "runtime/__init__.py": "",
    "runtime/engine.py": """\
        from ..kernels.ops import X
        from tritonspec.kernels import ops
        class Engine:
            def __init__(self):
                self._tree = None
            def _prefill(self):
                return self._tree
        def run(e):
            return e._prefill()
        """,
    "runtime/helpers.py": """\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from .engine import Engine
        def f():
            from .engine import run
            return run
        """,
    "autotune/__init__.py": "",
    "autotune/tune.py": """\
        from ..runtime.engine import Engine, run
        from ..demo import PAIRS
        def tune(x):
            x._local = 1
            return x._local, x._cache, x._modules  # torch's or our own: not defined elsewhere
        _cache = {}
        """,
    "training/__init__.py": "from .train import train\n",
    "training/train.py": "from ..runtime import engine\ndef train():\n    return engine.Engine\n",
    "recipes/__init__.py": "",
    "recipes/demo.py": """\
        from ..training import train
        from ..autotune import tune
        def run():
            return train, tune
        """,
    "tests/test_x.py": "from tritonspec.cli import _dtype\n",  # excluded
    "perf/bench.py": "from tritonspec.runtime.engine import Engine\nEngine()._prefill()\n",  # excluded
    ".hidden/x.py": "from tritonspec.cli import main\n",  # excluded
}


def _check(tmp_path: Path, overrides: dict[str, str]) -> list[Violation]:
    return check_tree(make_tree(tmp_path, {**CLEAN, **overrides}))


def test_clean_tree_reports_nothing(tmp_path):
    modules = collect_modules(make_tree(tmp_path, CLEAN))
    assert "tritonspec.perf.bench" not in modules and "tritonspec.tests.test_x" not in modules
    assert len(modules) == len([k for k in CLEAN if not k.startswith(("tests/", "perf/", "."))])
    assert check_tree(tmp_path) == []


def test_upward_import_is_reported(tmp_path):
    v = _check(tmp_path, {"runtime/profiles.py": "from .engine import run\nfrom ..autotune import tune\n"})
    assert [(x.rel, x.line, x.rule) for x in v] == [("runtime/profiles.py", 2, UPWARD)]
    assert str(v[0]) == (
        "runtime/profiles.py:2 imports tritonspec.autotune.tune (rank 2 autotune) from rank 1 runtime [upward import]"
    )


@pytest.mark.parametrize(
    "src, target",
    [
        ("def f():\n    from ..cli import main\n", "tritonspec.cli (main) (rank 4 cli)"),  # function-local
        ("import tritonspec.training.train as t\n", "tritonspec.training.train (rank 2 training)"),  # absolute
        ("from tritonspec import runtime\n", "tritonspec.runtime (rank 1 runtime)"),
        ("from .. import __version__\n", "tritonspec (__version__) (rank 4 tritonspec)"),  # the root package
        ("import tritonspec\n", "tritonspec (rank 4 tritonspec)"),
        (
            "import importlib\nm = importlib.import_module('tritonspec.recipes.demo')\n",
            "tritonspec.recipes.demo (rank 3 recipes)",
        ),
    ],
)
def test_upward_import_forms(tmp_path, src, target):
    v = _check(tmp_path, {"kernels/bad.py": src})
    assert len(v) == 1 and v[0].rule == UPWARD and v[0].rel == "kernels/bad.py", v
    assert f"imports {target} from rank 0 kernels" in str(v[0])


def test_function_local_upward_import_is_marked(tmp_path):
    v = _check(tmp_path, {"runtime/bench.py": "def f():\n    from .. import __version__\n"})
    assert [str(x) for x in v] == [
        "runtime/bench.py:2 imports tritonspec (__version__) (rank 4 tritonspec) "
        "from rank 1 runtime in a function [upward import]"
    ]


@pytest.mark.parametrize(
    "rel, src, msg",
    [
        ("autotune/x.py", "from ..training.train import train\n", "rank 2 training) from rank 2 autotune"),
        ("training/x.py", "def f():\n    from ..autotune import tune\n", "rank 2 autotune) from rank 2 training"),
        ("demo/x.py", "from ..kernels import ops\n", "rank 0 kernels) from rank 0 demo"),
        ("kernels/x.py", "from ..demo import PAIRS\n", "rank 0 demo) from rank 0 kernels"),
    ],
)
def test_sibling_rank_import_is_reported(tmp_path, rel, src, msg):
    v = _check(tmp_path, {rel: src})
    assert len(v) == 1 and v[0].rule == SAME_RANK and msg in str(v[0]), v


def test_demo_imports_nothing_from_the_package(tmp_path):
    v = _check(tmp_path, {"demo/__init__.py": "from ..runtime.engine import Engine\nimport tritonspec\n"})
    # (`import tritonspec` also closes a cycle: the root package imports demo)
    assert [(x.line, x.rule) for x in v if x.rule != CYCLE] == [(1, UPWARD), (2, UPWARD)]


def test_unknown_top_level_package_is_reported(tmp_path):
    v = _check(
        tmp_path, {"plugins/__init__.py": "", "utils.py": "X = 1\n", "runtime/x.py": "from ..nowhere import y\n"}
    )
    assert {(x.rel, x.rule) for x in v} == {
        ("plugins/__init__.py", UNKNOWN),
        ("utils.py", UNKNOWN),
        ("runtime/x.py", UNKNOWN),
    }
    assert all("add it to" in str(x) and "LAYERS" in str(x) for x in v)
    assert "'plugins'" in str(v[0]) or "'plugins'" in str(v[1])


def test_relative_import_above_the_package_is_reported(tmp_path):
    v = _check(tmp_path, {"runtime/x.py": "from ... import y\n"})
    assert [(x.rel, x.rule) for x in v] == [("runtime/x.py", BAD_RELATIVE)]


@pytest.mark.parametrize(
    "src, rule, needle",
    [
        (
            "from ..runtime.engine import _Engine_helper\n",
            PRIVATE_NAME,
            "imports _Engine_helper from tritonspec.runtime.engine: private to runtime",
        ),
        (
            "def f():\n    from ..cli import _dtype\n",
            PRIVATE_NAME,
            "imports _dtype from tritonspec.cli: private to cli",
        ),
        ("from ..kernels._utils import _pow2 as p\n", PRIVATE_MODULE, "module _utils is private to kernels"),
        ("from ..kernels import _utils\n", PRIVATE_MODULE, "imports tritonspec.kernels._utils:"),
        ("def f(rt):\n    return rt._prefill()\n", PRIVATE_NAME, "uses _prefill (rt._prefill): private to runtime"),
        (
            "def f(rt):\n    return rt._tree\n",
            PRIVATE_NAME,
            "uses _tree (rt._tree): private to runtime",
        ),  # self._tree =
        ("import tritonspec.demo as d\nX = d._private\n", PRIVATE_NAME, "uses _private (d._private): private to demo"),
        ("def f(rt):\n    return getattr(rt, '_prefill')\n", PRIVATE_NAME, "uses _prefill (getattr(rt, '_prefill'))"),
        (
            "from .. import runtime as r\nX = r.engine._Tree\n",
            PRIVATE_NAME,
            "uses _Tree (r.engine._Tree): private to runtime",
        ),
        (
            "import tritonspec\nf = tritonspec.cli._dtype\n",
            PRIVATE_NAME,
            "uses _dtype (tritonspec.cli._dtype): private to cli",
        ),
    ],
)
def test_private_cross_package_use_is_reported(tmp_path, src, rule, needle):
    v = [x for x in _check(tmp_path, {"training/bad.py": src}) if x.rule in (PRIVATE_NAME, PRIVATE_MODULE)]
    assert len(v) == 1 and v[0].rule == rule and v[0].rel == "training/bad.py", v
    assert needle in str(v[0]), str(v[0])


def test_private_member_defined_in_own_package_is_not_reported(tmp_path):
    # training has a _prefill method itself, so x._prefill there may be its own: not reported
    src = """\
        from . import helpers
        class Loop:
            def _prefill(self):
                return self._apply()  # self: never checked
        def f(rt):
            return rt._prefill(), helpers._tree  # helpers is our own module
        """
    assert _check(tmp_path, {"training/own.py": src, "training/helpers.py": "_tree = 1\n"}) == []


def test_own_module_level_shim_does_not_hide_a_private_method(tmp_path):
    # a module-level `def _prefill(rt)` wrapping runtime's method: rt._prefill is still runtime's
    src = "def _prefill(rt):\n    return rt._prefill()\n"
    v = _check(tmp_path, {"autotune/shim.py": src})
    assert [str(x) for x in v] == ["autotune/shim.py:2 uses _prefill (rt._prefill): private to runtime [private name]"]


def test_private_attribute_of_another_packages_module_is_reported(tmp_path):
    # `engine` is runtime's module: any private attribute of it is runtime's, defined there or not
    src = "from ..runtime import engine\nfrom ..kernels import ops\n_helper = 1\nX = engine._helper, ops._x\n"
    v = _check(tmp_path, {"training/mod.py": src})
    assert [str(x) for x in v] == [
        "training/mod.py:4 uses _helper (engine._helper): private to runtime [private name]",
        "training/mod.py:4 uses _x (ops._x): private to kernels [private name]",
    ]


def test_cycle_is_reported(tmp_path):
    v = _check(
        tmp_path,
        {
            "runtime/a.py": "from .b import B\nA = 1\n",
            "runtime/b.py": "import tritonspec.runtime.c\nB = 1\n",
            "runtime/c.py": "from . import a\n",
        },
    )
    assert [(x.rel, x.line, x.rule) for x in v] == [("runtime/a.py", 1, CYCLE)]
    assert str(v[0]) == (
        "runtime/a.py:1 import cycle: tritonspec.runtime.a (runtime/a.py:1) -> "
        "tritonspec.runtime.b (runtime/b.py:1) -> tritonspec.runtime.c (runtime/c.py:1) -> "
        "tritonspec.runtime.a [import cycle]"
    )


def test_cycle_through_the_root_package_is_reported(tmp_path):
    # the root __init__ imports runtime.engine, which imports the root back at module level
    v = _check(tmp_path, {"runtime/engine.py": "from .. import __version__\nclass Engine: pass\n"})
    assert {x.rule for x in v} == {UPWARD, CYCLE}
    assert any(x.rule == CYCLE and "tritonspec (__init__.py:1) -> tritonspec.runtime.engine" in str(x) for x in v)


@pytest.mark.parametrize(
    "guard",
    ["def f():\n    from .a import A\n", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"],
)
def test_deferred_imports_make_no_cycle(tmp_path, guard):
    assert _check(tmp_path, {"runtime/a.py": "from .b import f\nA = 1\n", "runtime/b.py": guard}) == []
