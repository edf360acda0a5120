"""The library installs and imports without the reproduction stack (pyproject: dependencies vs the `repro` extra)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("hydra", "omegaconf", "wandb", "datasets", "transformers")


def test_optimizers_import_without_the_reproduction_stack() -> None:
    code = (
        "import sys; import curvopt.api, curvopt.optim, curvopt.curvature; "
        f"print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_pyproject_declares_the_library_and_the_repro_extra() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {d.split(">")[0].split("=")[0] for d in meta["dependencies"]}
    assert deps == {"torch", "numpy"}
    extra = {d.split(">")[0].split("=")[0].split("<")[0] for d in meta["optional-dependencies"]["repro"]}
    # every runtime requirement other than the library's own is in the extra
    reqs = [
        line.split("#")[0].strip()
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if line.split("#")[0].strip()
    ]
    names = {r.split(">")[0].split("=")[0].split("<")[0] for r in reqs}
    assert names - {"torch", "numpy"} <= extra, sorted(names - {"torch", "numpy"} - extra)
