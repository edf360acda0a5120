"""Pack, park, unpack or move run records from the command line (the library: :mod:`curvopt.analysis.pack`).

    python -m experiments.pack results/fosi_quadratics         # every experiment below it
    python -m experiments.pack results/fgn_fig2 --keep          # write the pack, keep the run dirs
    python -m experiments.pack --move results/a/run_x results/b/run_y   # move one run's records
    python -m experiments.pack --park results/fosi_ae/heavy_ball_paper_s0  # a paused run, for git
    python -m experiments.pack --unpack results/fosi_lr/adam_paper_s0  # its rows back, to extend it

The packed layout, what is left unpacked and why a packed run must be unpacked before it is
extended: :mod:`curvopt.analysis.pack`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from curvopt.analysis.pack import (
    PACKED_METRICS,
    PACKED_RUNS,
    RecordError,
    experiments_under,
    move_run,
    pack_experiment,
    unpack_run,
)
from curvopt.errors import RunInUseError
from curvopt.training.records import park_metrics


def main(argv: list[str] | None = None) -> int:
    """Command line of ``python -m experiments.pack`` (module docstring).

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0, or 1 when no run records were found.
    """
    parser = argparse.ArgumentParser(
        prog="python -m experiments.pack",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", nargs="*", type=Path, help="an experiment directory, or a folder of them")
    parser.add_argument(
        "--move",
        nargs=2,
        action="append",
        type=Path,
        default=[],
        metavar=("SRC", "DST"),
        help="move the run SRC (<experiment dir>/<run_id>, loose or packed) to DST under a new experiment "
        "and/or run id (see move_run); repeatable; done before packing PATHS",
    )
    parser.add_argument(
        "--park",
        nargs="+",
        type=Path,
        default=[],
        metavar="RUN_DIR",
        help="gzip a paused run's metrics.jsonl into metrics.jsonl.gz (about 4.5x smaller, for committing "
        "it beside its checkpoint); still readable, and a resume unparks it",
    )
    parser.add_argument(
        "--unpack",
        nargs="+",
        type=Path,
        default=[],
        metavar="RUN_DIR",
        help="put a packed run's records back into RUN_DIR (<experiment dir>/<run_id>) and take it out of "
        "the pack, so that trainer.resume=true can extend it",
    )
    parser.add_argument("--keep", action="store_true", help="write the pack but keep the run directories")
    parser.add_argument("--compression", default="zstd", choices=["zstd", "snappy", "gzip", "none"])
    args = parser.parse_args(argv)
    if not args.paths and not args.move and not args.park and not args.unpack:
        parser.error(
            "give an experiment directory to pack, --move SRC DST, --park RUN_DIR or --unpack RUN_DIR"
        )
    for run_dir in args.unpack:
        try:
            rows = unpack_run(run_dir)
        except (FileNotFoundError, FileExistsError, RunInUseError, RecordError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"unpacked {run_dir}: {rows} rows, config.yaml and summary.json; it is out of the pack")
    for run_dir in args.park:
        try:
            before = (run_dir / "metrics.jsonl").stat().st_size if (run_dir / "metrics.jsonl").exists() else 0
            parked = park_metrics(run_dir)
        except (FileNotFoundError, RunInUseError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(
            f"parked {run_dir}: {before / 1e6:.2f} MB -> {parked.stat().st_size / 1e6:.2f} MB ({parked.name})"
        )
    for src, dst in args.move:
        try:
            print(f"moved {src} -> {move_run(src, dst)}")
        except (FileNotFoundError, FileExistsError, RunInUseError, RecordError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if not args.paths:
        return 0
    found = False
    for path in args.paths:
        for exp in experiments_under(path):
            found = True
            try:
                res = pack_experiment(exp, remove=not args.keep, compression=args.compression)
            except RecordError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            skipped = (
                f"; left unpacked (running, interrupted or killed): {', '.join(res.skipped)}"
                if res.skipped
                else ""
            )
            print(
                f"{exp}: {res.runs} runs, {res.rows} rows -> {PACKED_METRICS} + {PACKED_RUNS} "
                f"({res.bytes_after / 1e6:.2f} MB; the packed run files held {res.bytes_before / 1e6:.2f} MB), "
                f"{res.removed_files} files removed{skipped}"
            )
    if not found:
        print(f"no run records under {' '.join(map(str, args.paths))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
