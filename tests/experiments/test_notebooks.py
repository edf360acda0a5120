"""Execute the paper notebooks top to bottom (nbclient): on the committed run records, and on an
empty results folder, where every figure must degrade to a printed ``not run: make ...``.

The executions are marked slow (about 8 s each on 2 shared cores, ~70 s for all eight):
``.ci/run`` must call ``pytest -m slow tests/experiments/test_notebooks.py`` (or ``make test-report``)."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def execute(path: Path, results: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    env = {"CURVOPT_RESULTS": str(results), "MPLBACKEND": "Agg", "OPENBLAS_NUM_THREADS": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        client = nbclient.NotebookClient(
            nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
        )
        client.execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def outputs(nb: nbformat.NotebookNode) -> str:
    return "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )


def test_four_notebooks_exist() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"shf.ipynb", "fgn.ipynb", "fosi.ipynb", "alice.ipynb"}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_without_records(path: Path, tmp_path: Path) -> None:
    text = outputs(execute(path, tmp_path))
    assert "not run: make " in text


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_committed_records(path: Path) -> None:
    execute(path, Path(__file__).resolve().parents[2] / "results")


@pytest.mark.slow
def test_a_truncated_pack_reads_as_not_run(tmp_path: Path) -> None:
    """A truncated metrics.parquet (an interrupted copy, a bad checkout) must not fail a cell: the
    notebook says which records are unreadable and goes on."""
    import shutil

    src = Path(__file__).resolve().parents[2] / "results" / "fosi_quadratics"
    shutil.copytree(src, tmp_path / "fosi_quadratics")
    packs = sorted((tmp_path / "fosi_quadratics").rglob("metrics.parquet"))
    assert packs
    for pack in packs:
        data = pack.read_bytes()
        pack.write_bytes(data[: len(data) // 2])
    nb = execute(next(p for p in NOTEBOOKS if p.stem == "fosi"), tmp_path)
    assert "not run: records unreadable" in outputs(nb)
