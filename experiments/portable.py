"""Rewrite the absolute folders in tracked run records as portable names (the library: :mod:`curvopt.analysis.portable`).

    python -m experiments.portable results            # rewrite in place, list the files changed
    python -m experiments.portable results --check    # list them, change nothing (exit 1 if any)

Which folders and why: :mod:`curvopt.analysis.portable`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from curvopt.analysis.portable import roots, tracked_records
from curvopt.training.records import portable_paths


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
