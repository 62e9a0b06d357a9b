"""The shape of the house: no import circle anywhere, and every import points down the layers that
docs/DESIGN.md draws.

Read from the source with `ast`, so a violation fails here even if no test happens to import the module. Every
import counts: at module level, inside a function (a lazy import) and under `TYPE_CHECKING` alike, since each
ties the meaning of one file to another.

The layers are the fenced ```layers block of docs/DESIGN.md: `PACKAGE: unit unit ...` lines, top first. A unit
is a direct child (module or subpackage) of PACKAGE; an import from one unit to another must go to a unit on a
lower line (units on one line are siblings and import neither each other); every child of a package that has
layers must be on one of its lines, so a new module is placed in the drawing when it is added. Imports inside
one unit are free, as long as they make no circle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kgtp_sim"
DESIGN = ROOT / "docs" / "DESIGN.md"


# ---- reading the source ------------------------------------------------------------------------------------------


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package_dir: Path = PACKAGE) -> list[str]:
    """Absolute `kgtp_sim.X...` names a module imports (relative imports resolved against its package); for
    `from P import N`, `P.N` (the caller falls back to `P` where N is a name, not a module)."""
    tree = ast.parse(path.read_text(), str(path))
    is_init = path.name == "__init__.py"
    parts = tuple(module_name(path, package_dir).split("."))
    package = parts if is_init else parts[:-1]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ((node.module,) if node.module else ()))
            else:
                module = node.module or ""
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (a package stands for its `__init__`)."""
    paths = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets: set[str] = set()
        for imported in _imports(path, package):
            if not imported.startswith(package.name + "."):
                continue
            parts = imported.split(".")
            while parts and ".".join(parts) not in paths:
                parts.pop()  # `from P import N` with N a name, not a module: P itself
            target = ".".join(parts)
            if parts and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


# ---- the two rules -----------------------------------------------------------------------------------------------


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def read_layers(text: str) -> dict[str, list[set[str]]]:
    """docs/DESIGN.md's ```layers block: package -> its units' lines, top first."""
    match = re.search(r"^```layers\n(.*?)^```", text, re.S | re.M)
    assert match, "docs/DESIGN.md has no ```layers block"
    layers: dict[str, list[set[str]]] = {}
    for line in match.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            package, units = line.split(":", 1)
            layers.setdefault(package.strip(), []).append(set(units.split()))
    return layers


def upward_imports(graph: dict[str, set[str]], layers: dict[str, list[set[str]]]) -> list[str]:
    """Every import that does not go down a drawn layer, and every unit a drawn package has but the drawing
    lacks."""
    bad = []
    modules = set(graph)
    for package, lines in layers.items():
        drawn = set().union(*lines)
        children = {m[len(package) + 1:].split(".")[0] for m in modules if m.startswith(package + ".")}
        bad += [f"{package}.{child} is in no layer of {package} (docs/DESIGN.md)" for child in
                sorted(children - drawn)]
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            common = _common_package(source, target)
            if common not in layers:
                continue
            a, b = _unit(source, common), _unit(target, common)
            if a == b:
                continue  # inside one unit (a package's __init__ naming its own modules, too): only circles count
            rank = {unit: i for i, line in enumerate(layers[common]) for unit in line}
            if a in rank and b in rank and rank[b] <= rank[a]:
                kind = "a sibling" if rank[b] == rank[a] else "a layer above"
                bad.append(f"{source} imports {target}: {kind} in {common}'s layers")
    return bad


def _common_package(a: str, b: str) -> str:
    """The deepest package that holds both modules (a package holds its own submodules, not itself)."""
    ancestors = {".".join(b.split(".")[:i]) for i in range(1, b.count(".") + 1)}
    parts = a.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in ancestors), "")


def _unit(module: str, package: str) -> str:
    return module[len(package) + 1:].split(".")[0] if module.startswith(package + ".") else ""


# ---- the tests ---------------------------------------------------------------------------------------------------


def test_no_import_circle():
    found = circles(module_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_import_points_down_the_drawn_layers():
    bad = upward_imports(module_graph(), read_layers(DESIGN.read_text()))
    assert not bad, "\n".join(bad)


def test_the_drawing_covers_the_layered_packages():
    layers = read_layers(DESIGN.read_text())
    assert {"kgtp_sim", "kgtp_sim.tracing"} <= set(layers)
    assert all(units for lines in layers.values() for units in lines)


# ---- the checker itself ------------------------------------------------------------------------------------------


def test_the_checker_resolves_relative_imports():
    """A relative import two levels up is resolved to the package it names."""
    graph = module_graph()
    assert "kgtp_sim.agent.blocks" in graph["kgtp_sim.tracing.core.frames"]
    assert "kgtp_sim.tracing.core.model" in graph["kgtp_sim.tracing.engines.native"]  # `from ..core import model`


def test_the_checker_finds_a_circle_and_an_upward_import():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": set(), "p.x.y": {"p.d"}}
    assert circles(graph) == [["p.a", "p.b", "p.c"]]
    layers = {"p": [{"a"}, {"b", "c"}, {"d", "x"}]}
    bad = upward_imports(graph, layers)
    assert "p.c imports p.a: a layer above in p's layers" in bad
    assert "p.b imports p.c: a sibling in p's layers" in bad
    assert "p.x.y imports p.d: a sibling in p's layers" in bad
    assert not any(line.startswith("p.a imports") for line in bad)
    assert upward_imports({"p.a": set(), "p.new": set()}, {"p": [{"a"}]}) == ["p.new is in no layer of p (docs/DESIGN.md)"]


def test_the_checker_sees_lazy_and_type_checking_imports(tmp_path):
    package = tmp_path / "kgtp_sim"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "high.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "m.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..high import X\n"
        "def f():\n    from .. import high\n")
    assert module_graph(package)["kgtp_sim.low.m"] == {"kgtp_sim.high"}


@pytest.mark.parametrize("package", ["kgtp_sim.tracing.core", "kgtp_sim.tracing.patching",
                                     "kgtp_sim.tracing.engines", "kgtp_sim.tracing.kgtp"])
def test_each_tracing_layer_says_what_it_owns(package):
    path = PACKAGE.parent / Path(*package.split(".")) / "__init__.py"
    assert ast.get_docstring(ast.parse(path.read_text())), f"{package} says nothing of what it owns"


def test_every_module_is_tracked_by_git():
    """A module .gitignore hides is missing from every clone (a pattern for core dumps once hid tracing's `core`
    layer): none may be ignored."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    modules = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *modules], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    assert not ignored, f"ignored by .gitignore: {ignored}"


# ---- what each module says at its top ----------------------------------------------------------------------------

#: A module longer than this says at its top why it is long.
LONG_MODULE = 650
WHY_LONG = "Why this module is long"


def module_sources(package: Path = PACKAGE) -> dict[str, str]:
    """Module -> its source, for every module of the package but the packages' `__init__` files."""
    return {module_name(p, package): p.read_text() for p in sorted(package.rglob("*.py")) if p.name != "__init__.py"}


def silent_about_threads(sources: dict[str, str]) -> list[str]:
    """Modules whose docstring does not say which thread runs them (the guard of the convention: the word "thread"
    or "threads" in it)."""
    bad = []
    for name, text in sorted(sources.items()):
        doc = ast.get_docstring(ast.parse(text, name)) or ""
        if not re.search(r"\bthreads?\b", doc, re.I):
            bad.append(f"{name}: its docstring does not say which thread runs it" if doc else f"{name}: no docstring")
    return bad


def long_without_a_reason(sources: dict[str, str], limit: int = LONG_MODULE) -> list[str]:
    """Modules over `limit` lines whose docstring has no sentence beginning "Why this module is long"."""
    bad = []
    for name, text in sorted(sources.items()):
        lines = len(text.splitlines())
        if lines <= limit:
            continue
        doc = ast.get_docstring(ast.parse(text, name)) or ""
        if not re.search(rf"(?:\A|[.!?:]\s+|\n\s*){WHY_LONG}\b", doc):
            bad.append(f"{name}: {lines} lines, and its docstring does not say why ({WHY_LONG!r}...)")
    return bad


def test_every_module_says_which_thread_runs_it():
    bad = silent_about_threads(module_sources())
    assert not bad, "\n".join(bad)


def test_every_long_module_says_why_it_is_long():
    bad = long_without_a_reason(module_sources())
    assert not bad, "\n".join(bad)


def test_the_checker_finds_a_module_silent_about_its_thread():
    sources = {
        "p.quiet": '"""Owns the table."""\n',
        "p.bare": "X = 1\n",
        "p.told": '"""Owns the table.\n\nRuns on the server thread."""\n',
        "p.plural": '"""Owns the queue.\n\nThreads: the CPU thread writes it, the follow threads read it."""\n',
        "p.threaded": '"""Multithreaded, say, is not the word."""\n',
    }
    assert silent_about_threads(sources) == [
        "p.bare: no docstring",
        "p.quiet: its docstring does not say which thread runs it",
        "p.threaded: its docstring does not say which thread runs it",
    ]


def test_the_checker_finds_a_long_module_that_does_not_say_why():
    body = "x = 1\n" * LONG_MODULE
    quiet = '"""Owns the table. Runs on the server thread."""\n' + body
    told = ('"""Owns the table. Runs on the server thread.\n\nWhy this module is long: one state machine, whose '
            'states read best side by side."""\n' + body)
    mentioned = '"""Owns the table; nobody asked why this module is long."""\n' + body
    short = '"""Owns the table. Runs on the server thread."""\n' + "x = 1\n" * (LONG_MODULE - 1)
    bad = long_without_a_reason({"p.quiet": quiet, "p.told": told, "p.mentioned": mentioned, "p.short": short})
    assert bad == [f"p.mentioned: {LONG_MODULE + 1} lines, and its docstring does not say why ('{WHY_LONG}'...)",
                   f"p.quiet: {LONG_MODULE + 1} lines, and its docstring does not say why ('{WHY_LONG}'...)"]
