"""The library's import graph: the library below, the paper drivers above, arrows one way, no circles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "src" / "curvopt"
# (importer package, forbidden target): optimizers take parameters and closures, not models; models
# do not read data, nor data models (weights are resolved where models are built); the library never
# imports the paper drivers
FORBIDDEN = [
    ("curvopt", "experiments"),
    ("curvopt.optim", "curvopt.models"),
    ("curvopt.models", "curvopt.data"),
    ("curvopt.data", "curvopt.models"),
    ("curvopt.curvature", "curvopt.models"),
    ("curvopt.curvature", "curvopt.data"),
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(LIB.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Every import (module level or inside a function) of every module under src/curvopt."""
    modules = {_module_name(p): p for p in LIB.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative import
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets.add(mod)
                targets.update(f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules)
        graph[name] = {t for t in targets if t.split(".")[0] in ("curvopt", "experiments")}
    return graph


def test_no_forbidden_arrows() -> None:
    bad = [
        f"{src} -> {dst}"
        for src, dsts in import_graph().items()
        for dst in dsts
        for pkg, forbidden in FORBIDDEN
        if (src == pkg or src.startswith(pkg + ".")) and (dst == forbidden or dst.startswith(forbidden + "."))
    ]
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circles() -> None:
    graph = import_graph()
    known = set(graph)
    edges = {m: {t for t in ts if t in known and t != m} for m, ts in graph.items()}
    # a package's __init__ importing its own submodules is not a circle back into the package
    for m in edges:
        edges[m] = {t for t in edges[m] if not t.startswith(m + ".")}
    cycles, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_library_does_not_know_the_checkout_layout() -> None:
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in LIB.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "parents[" in line and not line.lstrip().startswith("#")
    ]
    assert not hits, hits


# Test files that check the repository as a whole, or a module at the package top, stay in tests/.
TOP_LEVEL_TESTS = {
    "test_api.py",  # curvopt/api.py
    "test_objective.py",  # curvopt/objective.py
    "test_architecture.py",
    "test_configs.py",
    "test_packaging.py",
    "test_readme_examples.py",
}


def test_the_test_tree_mirrors_the_code() -> None:
    """tests/<folder>/ is a curvopt subpackage, experiments/ or tools/, so a newcomer finds a module's
    tests where the module is (issue 29, item 6)."""
    tests = ROOT / "tests"
    allowed = {p.name for p in (ROOT / "src" / "curvopt").iterdir() if (p / "__init__.py").exists()}
    allowed |= {"experiments", "tools"}
    misplaced = []
    for path in sorted(tests.rglob("test_*.py")):
        rel = path.relative_to(tests)
        if len(rel.parts) == 1:
            if rel.name not in TOP_LEVEL_TESTS:
                misplaced.append(f"{rel}: move it under tests/<the package it tests>/")
        elif rel.parts[0] not in allowed:
            misplaced.append(f"{rel}: tests/{rel.parts[0]}/ mirrors no curvopt package")
        elif not (tests / rel.parts[0] / "__init__.py").exists():
            misplaced.append(f"{rel}: tests/{rel.parts[0]}/ needs an __init__.py (unique module names)")
    assert not misplaced, "\n".join(misplaced)


def test_the_training_loop_imports_without_the_config_stack() -> None:
    """A library user's own script runs curvopt.training.loop without Hydra or omegaconf (issue 45)."""
    import subprocess
    import sys

    code = (
        "import sys, curvopt.training.loop; "
        "print(sorted(m for m in ('omegaconf', 'hydra') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
