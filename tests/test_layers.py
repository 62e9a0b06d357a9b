"""The import rule: dependencies point down (wire -> translation -> tracing -> agent / machine / arch).

Read from the source with `ast`, so a violation fails here even if no test happens to import the module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kgtp_sim"

#: layer -> the layers above it, which it must never import
FORBIDDEN = {
    "tracing": ("rsp", "stub"),
    "agent": ("rsp", "stub", "tracing", "machine"),
    "machine": ("rsp", "stub", "tracing", "agent"),
    "arch": ("rsp", "stub", "tracing", "agent", "machine"),
    "rsp": ("stub",),
}


def _imports(path: Path) -> list[str]:
    """Absolute `kgtp_sim.X...` names a module imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), str(path))
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ((node.module,) if node.module else ()))
                names += [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            elif node.module:
                names.append(node.module)
    return names


def _modules(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_nothing_above_it(layer):
    modules = _modules(layer)
    assert modules, f"no modules under kgtp_sim/{layer}"
    bad = []
    for path in modules:
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "kgtp_sim" and len(parts) > 1 and parts[1] in FORBIDDEN[layer]:
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_rule_sees_relative_imports(tmp_path):
    """The checker itself: a relative import two levels up is resolved to the package it names."""
    module = PACKAGE / "tracing" / "model.py"
    assert "kgtp_sim.agent.blocks" in _imports(PACKAGE / "tracing" / "frames.py")
    assert all(name.startswith(("kgtp_sim", "__future__", "enum", "dataclasses")) for name in _imports(module))
