"""The contract is a leaf: ``curvopt.api`` imports only torch and the standard library, and the
methods (``curvopt.optim``) and data loaders (``curvopt.data``) never import the training loop."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import curvopt

PKG = Path(curvopt.__file__).parent


def imported_modules(path: Path) -> list[str]:
    """Every module a file imports, at any depth (lazy imports in functions included)."""
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out.append("." * node.level + (node.module or ""))
            else:
                out.append(node.module or "")
    return out


def test_api_is_a_leaf() -> None:
    mods = imported_modules(PKG / "api.py")
    assert mods, "api.py should import something (torch, typing)"
    allowed_roots = {"torch", "__future__"} | set(sys.stdlib_module_names)
    bad = [m for m in mods if m.startswith(".") or m.split(".")[0] not in allowed_roots]
    assert not bad, f"curvopt/api.py must import only torch and the stdlib, found {bad}"


@pytest.mark.parametrize("package", ["optim", "data"])
def test_methods_and_data_do_not_import_training(package: str) -> None:
    offenders = {}
    for path in sorted((PKG / package).glob("*.py")):
        bad = [
            m for m in imported_modules(path) if m == "curvopt.training" or m.startswith("curvopt.training.")
        ]
        bad += [m for m in imported_modules(path) if m.startswith("..training")]
        if bad:
            offenders[path.name] = bad
    assert not offenders, f"curvopt/{package} must depend on curvopt.api, not the loop: {offenders}"


def test_the_contract_has_one_home() -> None:
    """The contract types live in curvopt.api only; training.algorithm no longer re-exports them
    (issue 45: the compatibility shim is gone, every caller imports curvopt.api)."""
    from curvopt.training import algorithm

    assert not set(algorithm.__all__) & {"Algorithm", "AlgorithmBase", "Batch", "DataBundle"}
    assert not hasattr(algorithm, "Algorithm") and not hasattr(algorithm, "DataBundle")


def test_optim_all_resolves() -> None:
    import curvopt.optim as optim

    assert optim.__all__ == sorted(optim._EXPORTS)
    assert len(set(optim.__all__)) == len(optim.__all__)
    for name in optim.__all__:
        obj = getattr(optim, name)
        assert callable(obj), name
        home = importlib.import_module(f"curvopt.optim.{optim._EXPORTS[name]}")
        assert getattr(home, name) is obj
    with pytest.raises(AttributeError):
        optim.NoSuchOptimizer  # noqa: B018


def test_optim_import_is_light() -> None:
    """Importing the package (or all its names) pulls in neither the loop nor the optional
    low-rank packages."""
    code = (
        "import sys, curvopt.optim as o\n"
        "[getattr(o, n) for n in o.__all__]\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('galore_torch', 'fira', 'apollo_torch', 'bitsandbytes', 'hydra', 'omegaconf') "
        "or m.startswith('curvopt.training'))\n"
        "print(bad)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PKG.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
