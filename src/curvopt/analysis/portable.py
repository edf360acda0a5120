"""Rewrite the absolute folders in tracked run records as portable names (once, then checked).

    python -m curvopt.analysis.portable results            # rewrite in place, list the files changed
    python -m curvopt.analysis.portable results --check    # list them, change nothing (exit 1 if any)

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

import argparse
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from curvopt.training.records import path_roots, portable_paths

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


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: rewrite (or ``--check``) the tracked records under a folder.

    Args:
        argv: The folder (``results``) and ``--check``; ``None``: ``sys.argv[1:]``.

    Returns:
        0, or 1 with ``--check`` when a file would change.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="results")
    parser.add_argument(
        "--check", action="store_true", help="list the files that would change; change nothing"
    )
    args = parser.parse_args(argv)
    known = roots()
    changed = []
    for path in tracked_records(Path(args.root)):
        if not path.exists():
            continue
        text = path.read_text()
        new = portable_paths(text, known)
        if new != text:
            changed.append(path)
            if not args.check:
                path.write_text(new)
    for path in changed:
        print(path)
    print(f"{len(changed)} file(s) {'would change' if args.check else 'rewritten'}", file=sys.stderr)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
