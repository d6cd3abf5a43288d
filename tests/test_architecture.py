"""The import structure of envace_core, read from the code with `ast`: no import cycles between its
modules, no import of another module's `_private` name, and no Flyte import (orchestration lives in
tasks/ and workflows/; envace_core runs without flytekit).

Imports count wherever they are, at module level or inside a function (a function-level import
still closes a cycle at run time), except under `if TYPE_CHECKING:`, which never runs. An edge
goes to the module imported: `from a.b import c` is an edge to `a.b.c` when that is a module, else
to the package `a.b` (its __init__).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FLYTE_PACKAGES = ("flytekit", "flytekitplugins")


@dataclass
class ImportFacts:
    """What the modules of one package import: `edges` {module: modules it imports}, `private`
    ("m imports t._x at file:line") and `flyte` ("m imports flytekit... at file:line")."""

    edges: dict[str, set[str]] = field(default_factory=dict)
    private: list[str] = field(default_factory=list)
    flyte: list[str] = field(default_factory=list)


def package_modules(package_dir: Path) -> dict[str, Path]:
    """{dotted module name: file} of every .py file under `package_dir` (a package named after it)."""
    out = {}
    for f in sorted(package_dir.rglob("*.py")):
        rel = f.relative_to(package_dir.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = f
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside the body (not the else) of `if TYPE_CHECKING:` / `if typing.TYPE_CHECKING:`."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                skip |= {id(sub) for stmt in node.body for sub in ast.walk(stmt)}
    return skip


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_facts(package_dir: Path) -> ImportFacts:
    """Walk every module of the package at `package_dir` (see the module docstring for the rules)."""
    mods = package_modules(package_dir)
    facts = ImportFacts(edges={m: set() for m in mods})
    for m, f in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        skip = _type_checking_only(tree)
        aliases: dict[str, str] = {}  # local name -> package module it is bound to (for `mod._x`)
        for node in ast.walk(tree):
            where = f"{f.relative_to(package_dir.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in FLYTE_PACKAGES:
                        facts.flyte.append(f"{m} imports {a.name} at {where}")
                    if id(node) not in skip and a.name in mods and a.name != m:
                        facts.edges[m].add(a.name)
                        if a.asname:
                            aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(m, f.name == "__init__.py", node)
                if target.split(".")[0] in FLYTE_PACKAGES:
                    facts.flyte.append(f"{m} imports {target} at {where}")
                if id(node) in skip or not (target in mods or any(f"{target}.{a.name}" in mods for a in node.names)):
                    continue
                for a in node.names:
                    dest = f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target
                    if dest == m:
                        continue
                    facts.edges[m].add(dest)
                    if dest == target and a.name.startswith("_") and not a.name.startswith("__"):
                        facts.private.append(f"{m} imports {target}.{a.name} at {where}")
                    if dest != target:
                        aliases[a.asname or a.name] = dest
        for node in ast.walk(tree):  # `import pkg.mod as mod; mod._helper()`
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_") and not node.attr.startswith("__")):
                facts.private.append(f"{m} uses {aliases[node.value.id]}.{node.attr} at "
                                     f"{f.relative_to(package_dir.parent)}:{node.lineno}")
    return facts


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, as the modules of one strongly connected component (Tarjan), each one
    sorted and written so that it can be followed: [a, b, ..., a] along real edges."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def strong(v: str) -> None:  # recursion depth <= number of modules (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
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
                comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return [_cycle_path(c, edges) for c in sorted(comps)]


def _cycle_path(comp: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A closed path through the component from its first module back to it (breadth-first)."""
    inside, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ()) & inside):
                if w == start:
                    path = [start]
                    while v != start:
                        path.append(v)
                        v = prev[v]
                    return [start, *reversed(path[1:]), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp  # unreachable for a strongly connected component


# ------------------------------------------------------------------------------------ envace_core
@pytest.fixture(scope="module")
def envace_core_facts() -> ImportFacts:
    return import_facts(REPO / "envace_core")


def test_envace_core_has_no_import_cycles(envace_core_facts):
    cycles = import_cycles(envace_core_facts.edges)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_envace_core_imports_no_private_name_of_another_module(envace_core_facts):
    assert not envace_core_facts.private, "\n".join(envace_core_facts.private)


def test_envace_core_does_not_import_flyte(envace_core_facts):
    assert not envace_core_facts.flyte, "\n".join(envace_core_facts.flyte)


def test_the_walk_sees_the_whole_package(envace_core_facts):
    """Guards the checks above against passing vacuously (a wrong root, a parse that finds nothing)."""
    edges = envace_core_facts.edges
    assert len(edges) > 50 and sum(map(len, edges.values())) > 150
    assert "envace_core.store.uri" in edges["envace_core.stages.inputs"]  # module level
    assert "envace_core.stages.dataset" in edges["envace_core.stages.curate"]


# --------------------------------------------------------------------------- the checker itself
def _package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / "pkg" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "pkg"


def test_checker_finds_a_cycle_closed_by_a_function_level_import(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.b import g\n\ndef f():\n    return g()\n",
        "b.py": "def g():\n    from pkg import c\n    return c.h()\n",
        "c.py": "import pkg.a\n\ndef h():\n    return 1\n",
        "d.py": "from pkg.a import f\n",  # imports into the cycle, is not part of it
    })
    assert import_cycles(import_facts(pkg).edges) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def test_checker_resolves_relative_imports_and_ignores_type_checking_blocks(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "sub/__init__.py": "from .x import X\n",
        "sub/x.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ..y import Y\n"
                    "else:\n    Y = None\n\nclass X:\n    pass\n",
        "y.py": "from .sub import X\n\nclass Y(X):\n    pass\n",
    })
    edges = import_facts(pkg).edges
    assert edges["pkg.sub"] == {"pkg.sub.x"} and edges["pkg.y"] == {"pkg.sub"}
    assert edges["pkg.sub.x"] == set() and import_cycles(edges) == []
    (pkg / "sub" / "x.py").write_text("from ..y import Y\n")  # the same import, outside TYPE_CHECKING
    assert import_cycles(import_facts(pkg).edges) == [["pkg.sub", "pkg.sub.x", "pkg.y", "pkg.sub"]]


def test_checker_flags_private_names_and_flyte_imports(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "_SECRET = 1\n\ndef _helper():\n    return 2\n\ndef run():\n    return _helper()\n",
        "b.py": "from pkg.a import _SECRET\n",
        "c.py": "import pkg.a as a\n\ndef f():\n    return a._helper()\n",
        "d.py": "from pkg import a\n\nprint(a.__name__, a.run())\n",  # dunder and public names are fine
        "e.py": "def deck():\n    from flytekit import Deck\n    return Deck\n",
        "f.py": "import flytekitplugins.kfpytorch\n",
    })
    facts = import_facts(pkg)
    assert [p.split(" at ")[0] for p in facts.private] == ["pkg.b imports pkg.a._SECRET", "pkg.c uses pkg.a._helper"]
    assert [p.split(" at ")[0] for p in facts.flyte] == ["pkg.e imports flytekit",
                                                          "pkg.f imports flytekitplugins.kfpytorch"]
    assert facts.private[0].endswith("pkg/b.py:1")
