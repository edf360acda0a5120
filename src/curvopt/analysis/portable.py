"""Rewrite the absolute folders in tracked run records as portable names (once, then checked).

The command line is ``python -m experiments.portable`` (:mod:`experiments.portable`); this module
holds what it and the record test use: :data:`KNOWN_ROOTS`, :func:`roots`, :func:`tracked_records`
and :data:`ABSOLUTE_PATH`.

Run records used to name the folders of the machine that wrote them (``paths.data_dir:
/work/shared/data``, ``paths.results_dir=/work/main/results`` in ``overrides.yaml``, a data
file in an error message). The writers now store them relative to the data directory
(``$CURVOPT_DATA_DIR``) and the repository (:func:`curvopt.training.records.portable_paths`);
this rewrites records written before, with the folders of the machines that wrote them
(:data:`KNOWN_ROOTS`) as well as this one's. Only those path strings change; every other byte of
a file stays as it was. ``tests/analysis/test_records_portable.py`` fails when a tracked record under
``results/`` holds an absolute machine path.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from curvopt.training.records import path_roots

# folders of the machines that wrote the committed records: the working checkout and its data
# folder, the GPU machine's checkout, virtual environment, temporary and home folders
KNOWN_ROOTS: list[tuple[str, str]] = [
    ("/work/shared/data", "$CURVOPT_DATA_DIR"),
    ("/work/main", ""),
    ("/opt/torch/.venv", "$PYTHON_PREFIX"),
    ("/tmp", "$TMPDIR"),
    ("/root", "~"),
]
TEXT_SUFFIXES = (".json", ".jsonl", ".yaml", ".yml", ".md", ".csv", ".txt", ".log")
# what an absolute machine folder looks like in a record (tests/analysis/test_records_portable.py)
ABSOLUTE_PATH = re.compile(
    r"(?<![\w.$~])/(?:work|root|home|tmp|opt|Users|scratch|mnt|data|private|var)/[\w.+-]"
)


def tracked_records(root: Path) -> list[Path]:
    """The text files git tracks under ``root``.

    Args:
        root: A folder inside the repository (``results``).

    Returns:
        Their paths, relative to the current directory.
    """
    out = subprocess.run(
        ["git", "ls-files", "-z", "--", str(root)], capture_output=True, text=True, check=True
    )
    return [Path(name) for name in out.stdout.split("\0") if name.endswith(TEXT_SUFFIXES)]


def roots() -> list[tuple[str, str]]:
    """:data:`KNOWN_ROOTS` and this machine's, longest first (a longer folder is replaced first)."""
    merged = dict(KNOWN_ROOTS)
    for folder, name in path_roots():
        merged.setdefault(folder, name)
    return sorted(merged.items(), key=lambda item: -len(item[0]))
