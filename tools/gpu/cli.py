"""GPU slices: the repository's GPU work in pieces that each fit one device call (docs/cluster.md, 5).

A lent GPU machine runs ONE bash command per call (at most 10 minutes), sees only the working tree plus
up to 8 carried ignored paths (64 MiB in all), keeps nothing afterwards, and returns at most 8 files
(16 MiB each, 64 MiB together) through ``$OUT``. So the work is a queue of slices
(``tools/gpu/gpu_queue.yaml``), each one call:

    python -m tools.gpu list                        # the queue, each slice's GPU minutes and ledger status
    python -m tools.gpu carry [ITEM]                # here: gpu_carry/ (wheels, data, checkpoints) + the call
    bash tools/gpu_slice.sh [ITEM]                  # there: the one command (python -m tools.gpu run)
    python -m tools.gpu unpack FROM                 # here: verify, extract into results/, ledger, figures

(``make gpu-queue``, ``make gpu-carry ITEM=...``, ``make gpu-slice ITEM=...``, ``make gpu-unpack
FROM=...``.) Without ITEM the first slice (by ``order``) with no ``done`` row in ``docs/gpu_ledger.md``.

``run`` installs the slice's wheels that are not importable (``pip install --no-index --no-deps
--target``), decompresses the carried data, puts carried checkpoints in place, runs the slice's
phases (``parallel`` processes at once) until the work deadline (``--work-s``, default 480 s, env
``GPU_SLICE_WORK_S``), then sends SIGTERM: ``src/train.py`` finishes its step, writes its checkpoint
and exits 143; after ``grace_s`` what is left is killed. Then it packs into ``$OUT``: ``manifest.json``
(sha256 of every file and of every archive member; device, driver, torch, CUDA, cuDNN; each run's
status), ``slice.log``, ``results.tar.gz`` (every file the slice wrote under results/, checkpoints
excepted), ``checkpoints.tar`` (gzip'd ``checkpoint.pt`` of unfinished runs, in priority order while
the limits allow) and ``logs.tar.gz``; an archive over 15 MiB is split into ``.partNN`` files.

``unpack`` accepts only a manifest whose ``slice`` is a slice id of the queue (and whose ``stamp`` is a
time stamp), refusing (exit 2, nothing written) a damaged or malformed output; a run whose records
here have gone further than the output's is left as it is, the output's copy of it set aside in
``outputs/gpu_slices/<slice>/<stamp>/stale/``; the same output unpacked again adds no ledger row.
``run`` deletes its scratch folder (``GPU_SLICE_TMP``) only when it created it (it holds
``.gpu_slice_work``); another non-empty folder there is refused.

Every train run is started through ``exec`` (:mod:`tools.gpu.facts`), which sets TF32 as the queue asks and
records what the process saw (device, torch, CUDA, cuDNN, TF32 and float32 matmul precision); the
run directory gets ``gpu_slice.json``, one segment per slice that ran it.

The code follows the slice's path, one module per step: :mod:`tools.gpu.slices` (the queue),
:mod:`tools.gpu.carry`, :mod:`tools.gpu.run` (with :mod:`tools.gpu.facts` and :mod:`tools.gpu.report`),
:mod:`tools.gpu.pack`, :mod:`tools.gpu.unpack` and :mod:`tools.gpu.ledger`; this module is the
command line. Standard library only, PyYAML to read the queue, torch where a run needs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tools.gpu import slices as gpu_queue
from tools.gpu.carry import TREE_LIMIT_MIB, WHEEL_DIRS, cmd_carry
from tools.gpu.common import CARRY, REPO
from tools.gpu.facts import cmd_exec
from tools.gpu.ledger import LEDGER, next_slice, read_ledger
from tools.gpu.run import cmd_run
from tools.gpu.slices import load_queue
from tools.gpu.unpack import cmd_unpack


def cmd_list(args: argparse.Namespace) -> int:
    slices = load_queue()
    rows = read_ledger(Path(args.ledger))
    nxt = next_slice(slices, Path(args.ledger))
    for s in slices:
        mine = [r for r in rows if r["slice"] == s.id]
        state = mine[-1]["status"] if mine else "-"
        mark = "->" if nxt is not None and s.id == nxt.id else "  "
        runs = ", ".join(r.id for r in s.runs)
        print(
            f"{mark} {s.order:>4g} {s.id:16s} {s.gpu_minutes:5.1f} min  {state:8s} {s.title}\n{'':29s}runs: {runs}"
        )
    print(f"\nnext: {nxt.id if nxt else 'nothing'}; total estimate of the auto slices: "
          f"{sum(s.gpu_minutes for s in slices if s.auto):g} GPU min (one call each)")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["exec"]:
        cmd_exec(argv[1:])
        return 0
    p = argparse.ArgumentParser(
        prog="python -m tools.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ledger", default=os.environ.get("GPU_SLICE_LEDGER", str(LEDGER)))
    p.add_argument("--queue", default=os.environ.get("GPU_SLICE_QUEUE", str(gpu_queue.QUEUE)))
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("list", help="the queue with the ledger's status")
    sp.set_defaults(fn=cmd_list)
    sp = sub.add_parser("carry", help="prepare gpu_carry/ for a slice and print the device call")
    sp.add_argument("item", nargs="?")
    sp.add_argument("--dest", default=str(CARRY))
    sp.add_argument("--results", default=str(REPO / "results"))
    sp.add_argument("--data-dir", default=os.environ.get("CURVOPT_DATA_DIR", str(REPO / "data")))
    sp.add_argument("--wheels-from", nargs="+", default=[str(d) for d in WHEEL_DIRS])
    sp.add_argument("--no-fetch", dest="fetch", action="store_false", help="never download missing wheels")
    sp.add_argument("--limit-mib", type=float, default=TREE_LIMIT_MIB)
    sp.add_argument(
        "--leave-behind", action="store_true", help="carry the checkpoints that fit; skip the others' runs"
    )
    sp.add_argument(
        "--restart-unfit", action="store_true", help="runs whose checkpoint does not fit start again"
    )
    sp.set_defaults(fn=cmd_carry)
    sp = sub.add_parser("run", help="run a slice (the device call's command)")
    sp.add_argument("item", nargs="?")
    sp.add_argument("--out", default=None, help="default $OUT")
    sp.add_argument("--out-overwrite", action="store_true")
    sp.add_argument("--carry", default=os.environ.get("GPU_SLICE_CARRY", str(CARRY)))
    sp.add_argument("--results", default=os.environ.get("GPU_SLICE_RESULTS", str(REPO / "results")))
    sp.add_argument("--work", default=os.environ.get("GPU_SLICE_TMP", "/tmp/gpu_slice"))
    sp.add_argument("--work-s", type=float, default=None, help="seconds of work (default: the queue's, 480)")
    sp.add_argument("--force", action="store_true", help="run module runs even when their done_if exists")
    sp.add_argument("--allow-cpu", action="store_true", help="run a GPU slice without CUDA (tests)")
    sp.set_defaults(fn=cmd_run)
    sp = sub.add_parser("unpack", help="verify a slice's $OUT, extract it into results/, ledger, figures")
    sp.add_argument("src")
    sp.add_argument("--root", default=str(REPO), help="repository root to extract into")
    sp.add_argument("--gpu-minutes", type=float, default=None, help="the call's device minutes (lease)")
    sp.add_argument("--no-after", action="store_true", help="no figure/report regeneration")
    sp.add_argument("--python", default=None)
    sp.set_defaults(fn=cmd_unpack)
    args = p.parse_args(argv)
    saved, gpu_queue.QUEUE = gpu_queue.QUEUE, Path(args.queue)
    try:
        return int(args.fn(args) or 0)
    finally:
        gpu_queue.QUEUE = saved


if __name__ == "__main__":
    sys.exit(main())
