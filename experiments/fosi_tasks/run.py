"""Run what is missing for the FOSI DNN tables and figures, then build them from the run records
(the ``make reproduce-fosi-*`` targets).

    python -m experiments.fosi_tasks.run table1 --profile paper --tasks lr      # runs + Table 1
    python -m experiments.fosi_tasks.run fig5 --profile quick                   # all tasks with data
    python -m experiments.fosi_tasks.run fig6 --profile quick --kfac-grid full
    python -m experiments.fosi_tasks.run table1 --no-run                        # only redraw
    python -m experiments.fosi_tasks.run table1 --dry-run                       # list the commands

Finished (or diverged) runs are kept (``experiments.runs.ensure_run``). A task whose data or weights
are missing is skipped with the loader's message (what to download, where to put it) and shows up
as "missing" in the tables. A run that fails is reported and does not stop the others. On the CPU
every run gets ``OMP_NUM_THREADS=1`` (``--threads``): on a shared 2-core machine, torch's spinning
intra-op threads otherwise make step times 50× noisier; without CUDA the runs time their steps in
process CPU seconds (``--timer``), which other jobs on the machine cannot inflate. Extra Hydra
overrides after ``--`` go to every run (e.g. ``-- trainer.device=cuda``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from experiments.fosi_tasks import analysis, figures
from experiments.runs import REPO_ROOT, action_label, ensure_run

WHAT = ("table1", "table2", "fig2", "fig5", "fig6", "all")


def data_problem(task: analysis.Task, data_dir: Path) -> str | None:
    """Cheap availability check (no decoding): None when the task can run, else the message."""
    from curvopt.errors import DataNotFoundError

    try:
        if task.key == "lr":
            from curvopt.data.mnist import read_mnist_idx

            read_mnist_idx(data_dir, verify=False)
        elif task.key in ("ae", "tl"):
            from curvopt.data import cifar10

            if cifar10._find_python_batches(data_dir) is None and cifar10._find_packed(data_dir) is None:
                return f"CIFAR-10 not found under {data_dir}. {cifar10.HOW_TO_GET}"
            if task.key == "tl":
                from curvopt.models.pretrained import resolve_weights

                resolve_weights(str(data_dir / "resnet18"))
        elif task.key == "lm":
            from curvopt.data.shakespeare import read_text

            read_text(data_dir, allow_download=False)
        elif task.key == "ac":
            base = data_dir / "audioset"
            if not (base / "class_labels_indices.csv").is_file() or not (base / "train_wav").is_dir():
                from curvopt.data.audioset import HOW_TO_GET

                return f"AudioSet not found under {base}. {HOW_TO_GET}"
    except DataNotFoundError as err:
        return str(err)
    return None


def planned_runs(
    what: str, task: analysis.Task, args: argparse.Namespace
) -> list[tuple[str, str | None, list[str]]]:
    """(optimizer, run-id suffix, overrides) of the runs a table/figure needs."""
    runs: list[tuple[str, str | None, list[str]]] = []
    if what in ("table1", "table2", "fig5", "fig2"):
        runs += [(opt, None, []) for opt in analysis.MAIN_OPTIMIZERS]
    if what == "fig6":
        runs.append(("fosi_heavy_ball", None, []))
        if task.key != "lm":  # the paper: K-FAC cannot handle the LSTM
            if args.kfac_grid == "full":
                for lr in analysis.KFAC_LRS:
                    for mom in analysis.KFAC_MOMENTA:
                        suffix = f"lr{lr}_m{mom}"
                        runs.append(
                            (
                                "kfac",
                                suffix,
                                [
                                    f"optimizer.lr={lr}",
                                    f"optimizer.momentum={mom}",
                                ],
                            )
                        )
            else:
                runs.append(("kfac", None, []))
        for hist in args.lbfgs_histories:
            runs.append(("lbfgs", f"L{hist}", [f"optimizer.history_size={hist}"]))
    return runs


def timer_overrides(args: argparse.Namespace) -> list[str]:
    """``--timer process``: the loop times steps in process CPU seconds with ``--threads`` torch
    threads (other jobs on a shared CPU cannot inflate them); ``wall``: the loop's default."""
    if args.timer == "process":
        return ["trainer.clock=process", f"trainer.num_threads={args.threads}"]
    return []


def ensure(
    what: str, tasks: list[analysis.Task], args: argparse.Namespace, overrides: list[str]
) -> dict[str, str]:
    skipped: dict[str, str] = {}
    data_dir = Path(os.environ.get("CURVOPT_DATA_DIR", REPO_ROOT / "data"))
    env_threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    for task in tasks:
        problem = data_problem(task, data_dir)
        if problem is not None:
            skipped[task.key] = problem
            print(f"[skip {task.key}] {problem.splitlines()[0]}\n  " + "\n  ".join(problem.splitlines()[1:]))
            continue
        if what == "fig2" and task.key != "ac":
            continue
        for optimizer, suffix, extra in planned_runs(what, task, args):
            old = {k: os.environ.get(k) for k in env_threads}
            os.environ.update(env_threads)
            try:
                action, run_dir = ensure_run(
                    task.experiment,
                    optimizer,
                    args.seed,
                    args.profile,
                    [
                        *extra,
                        *([f"logger={args.logger}"] if args.logger else []),
                        *timer_overrides(args),
                        *overrides,
                    ],
                    suffix=suffix,
                    results_dir=args.results_dir,
                    dry_run=args.dry_run,
                )
                print(f"[{action_label(action, args.dry_run)}] {run_dir}", flush=True)
            except subprocess.CalledProcessError as err:
                print(f"[failed] {task.key} {optimizer} {suffix or ''}: exit {err.returncode}", flush=True)
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
    return skipped


def draw(what: str, tasks: list[analysis.Task], args: argparse.Namespace) -> None:
    results = Path(args.results_dir)
    runs = {t.key: analysis.load_task(results, t, args.profile, args.seed) for t in tasks}
    tables_dir, figs_dir = results / "tables", results / "figures"
    if what in ("table1", "table2"):
        which = "val" if what == "table1" else "train"
        table = analysis.with_paper(analysis.time_table(runs, which, args.clock), which)
        table = table[table["task"].isin([t.key for t in tasks])]
        md = analysis.markdown_table(table, which, args.profile, args.clock)
        tables_dir.mkdir(parents=True, exist_ok=True)
        stem = f"fosi_{what}_{args.profile}"
        (tables_dir / f"{stem}.md").write_text(md)
        table.to_csv(tables_dir / f"{stem}.csv", index=False)
        print(md)
        print(f"wrote {tables_dir / stem}.md/.csv")
    elif what == "fig5":
        for t in tasks:
            if runs.get(t.key):
                out = figures.figure5(
                    t,
                    runs[t.key],
                    args.profile,
                    args.clock,
                    figs_dir / f"fosi_fig5_{t.key}_{args.profile}.png",
                )
                print(f"wrote {out}")
    elif what == "fig2":
        t = analysis.TASKS["ac"]
        if runs.get("ac"):
            print(
                f"wrote {figures.figure2(t, runs['ac'], args.profile, args.clock, figs_dir / f'fosi_fig2_{args.profile}.png')}"
            )
        else:
            print("Figure 2 needs AC runs (AudioSet); none found.")
    elif what == "fig6":
        for t in tasks:
            if runs.get(t.key):
                out, notes = figures.figure6(
                    t,
                    runs[t.key],
                    args.profile,
                    args.clock,
                    figs_dir / f"fosi_fig6_{t.key}_{args.profile}.png",
                    paper_omissions=not args.show_omitted,
                )
                print(f"wrote {out}" + (f" ({'; '.join(notes)})" if notes else ""))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=WHAT)
    p.add_argument("--profile", default="quick", choices=["quick", "paper"])
    p.add_argument("--tasks", nargs="+", default=list(analysis.TASKS), choices=list(analysis.TASKS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=str(REPO_ROOT / "results"))
    p.add_argument("--clock", default="algo", choices=["algo", "wall"])
    p.add_argument(
        "--kfac-grid",
        default="selected",
        choices=["selected", "full"],
        help="selected: the authors' chosen K-FAC lr/momentum per task; full: the 4x4 grid",
    )
    p.add_argument(
        "--lbfgs-histories",
        nargs="+",
        type=int,
        default=None,
        help="L-BFGS history sizes (default: the paper's 10 20 40 80 100; quick profile: 10 40)",
    )
    p.add_argument("--show-omitted", action="store_true", help="Figure 6: draw what the paper omits")
    p.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per CPU run")
    p.add_argument(
        "--timer",
        choices=["auto", "wall", "process"],
        default="auto",
        help="step clock of the runs: process CPU seconds (shared CPUs) or wall (GPU; the paper's); "
        "auto = wall when CUDA is available, else process",
    )
    p.add_argument("--logger", default="none", help="logger config for the runs ('' keeps the default)")
    p.add_argument("--no-run", action="store_true", help="only build tables/figures from existing records")
    p.add_argument("--dry-run", action="store_true", help="print the commands of missing runs")
    args = p.parse_args(argv)
    if args.lbfgs_histories is None:
        args.lbfgs_histories = list(analysis.LBFGS_HISTORIES) if args.profile == "paper" else [10, 40]
    if args.timer == "auto":
        import torch

        args.timer = "wall" if torch.cuda.is_available() else "process"
    tasks = [analysis.TASKS[k] for k in args.tasks]
    todo = ["table1", "table2", "fig5", "fig6", "fig2"] if args.what == "all" else [args.what]
    for what in todo:
        if not args.no_run:
            ensure(what, tasks, args, overrides)
        if not args.dry_run:
            draw(what, tasks, args)


if __name__ == "__main__":
    main()
