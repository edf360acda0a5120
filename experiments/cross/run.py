"""Run what is missing of the cross-paper grid: one Hydra multirun per task (``make reproduce-cross``).

    python -m experiments.cross.run                                   # quick profile, all tasks
    python -m experiments.cross.run --tasks usps lr --seeds 0 1 --trials t0 t1
    python -m experiments.cross.run --profile paper --dry-run          # the paper-like CPU profile's plan
    python -m experiments.cross.run --tasks lm -- trainer.max_algo_time_s=5   # extra overrides

For each task (experiments/cross/tasks.py) the driver builds the task's model, decides which methods
apply (:func:`experiments.cross.tasks.applicability`; the others get a row that says why), writes that
plan to ``results/cross_<task>/grid_<profile>.json`` (every method, and the seeds, trials and budget of
this call, which the report then judges) and starts ONE ``src/train.py -m`` over the
applicable methods x seeds x trials that have no finished record yet (``cross.trial`` selects the
tuned value, conf/experiment/cross_common.yaml). Run ids follow experiments/runs.py:
``<optimizer>_<profile>_s<seed>_<trial>``. A finished (completed or diverged) run is kept; an
unfinished one with a checkpoint is resumed on its own (``experiments.runs.ensure_run``); one without
is moved aside and run again. Every run times its steps in process CPU seconds with one torch thread
(``trainer.clock=process trainer.num_threads=1``) under the task's budget
(``trainer.max_algo_time_s``). Before paper-profile runs start, the plan is listed with its CPU cost
and confirmed (``--yes`` / ``YES=1``). docs/cross.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments.cross.tasks import METHODS, TASKS, Task, plan, task_facts
from experiments.runs import (
    FINAL_STATUSES,
    REPO_ROOT,
    confirm_start,
    ensure_run,
    experiment_config,
    results_arg,
    run_id_for,
    run_status,
    run_train,
)

# The profiles: seeds and trials every method gets, and the algorithm-time budget per run (CPU
# seconds, one thread) of each task. quick: minutes on a 2-core CPU (this session's records);
# paper: the papers' tuning protocol at CPU model sizes (hours; not run yet).
PROFILES: dict[str, dict] = {
    "quick": {
        "seeds": [0, 1],
        "trials": ["t0", "t1"],
        "budget_s": {"usps": 10, "lr": 10, "lm": 10, "llm": 10},
    },
    "paper": {
        "seeds": [0, 1, 2],
        "trials": ["t0", "t1"],
        "budget_s": {"usps": 240, "lr": 120, "lm": 240, "llm": 240},
    },
}
THREADS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def grid_path(results_dir: Path, task: Task, profile: str) -> Path:
    """Where the task's plan (applicability, seeds, trials, budget) is recorded."""
    return results_dir / task.experiment / f"grid_{profile}.json"


def task_plan(
    task: Task, profile: str, methods: list[str], seeds: list[int], trials: list[str], budget: float
) -> dict:
    """The task's plan: the model facts, per method whether it applies and why not, the trial values.

    Args:
        task: The task.
        profile: ``quick`` or ``paper``.
        methods: The methods asked for.
        seeds: Seeds.
        trials: Trial names (``t0``, ``t1``).
        budget: Algorithm seconds per run.

    Returns:
        A JSON-able dict (written to :func:`grid_path`).
    """
    from experiments.runs import compose_config

    facts = task_facts(task, profile)
    cfg = compose_config([f"experiment={experiment_config(task.experiment, profile)}", "logger=none"])
    grid = cfg.cross.grid
    methods_plan = plan(task, facts, tuple(methods))
    for m, entry in methods_plan.items():
        if entry["applies"] and m in grid:
            entry["trials"] = {t: grid[m][t] for t in trials if t in grid[m]}
    return {
        "task": task.key,
        "experiment": task.experiment,
        "title": task.title,
        "paper": task.paper,
        "profile": profile,
        "metric": task.metric,
        "mode": task.mode,
        "seeds": list(seeds),
        "trials": list(trials),
        "budget_s": float(budget),
        "clock": "process",
        "num_threads": 1,
        "facts": facts.to_dict(),
        "methods": methods_plan,
    }


def missing_jobs(
    results_dir: Path, task: Task, profile: str, methods: list[str], seeds: list[int], trials: list[str]
) -> tuple[list[tuple[str, int, str]], list[tuple[str, int, str]]]:
    """``(to_start, to_resume)``: the (method, seed, trial) runs without a finished record; those
    with a checkpoint are resumed one by one, the others go into the multirun (an unfinished run
    directory without checkpoint is moved aside first, never deleted)."""
    start, resume = [], []
    for m in methods:
        for s in seeds:
            for t in trials:
                run_dir = results_dir / task.experiment / run_id_for(m, profile, s, t)
                status = run_status(run_dir)
                if status in FINAL_STATUSES:
                    continue
                if status is not None and (run_dir / "checkpoint.pt").exists():
                    resume.append((m, s, t))
                    continue
                start.append((m, s, t))
    return start, resume


def move_aside(run_dir: Path) -> None:
    """Rename an unfinished run without checkpoint to ``<run_id>.<status>-<timestamp>``."""
    if run_dir.exists():
        status = run_status(run_dir)
        aside = run_dir.with_name(f"{run_dir.name}.{status}-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        print(f"moved incomplete run {run_dir} -> {aside}", flush=True)


def sweeps(jobs: list[tuple[str, int, str]]) -> list[tuple[list[str], list[int], list[str]]]:
    """Cover ``jobs`` with as few Cartesian sweeps (methods x seeds x trials) as possible: methods
    missing the same (seed, trial) set share a sweep; a set that is not a product is split by seed.

    Args:
        jobs: ``(method, seed, trial)`` triples.

    Returns:
        ``[(methods, seeds, trials), ...]`` covering exactly ``jobs``.
    """
    by_method: dict[str, set[tuple[int, str]]] = {}
    for m, s, t in jobs:
        by_method.setdefault(m, set()).add((s, t))
    groups: dict[frozenset, list[str]] = {}
    for m, pairs in by_method.items():
        groups.setdefault(frozenset(pairs), []).append(m)
    out = []
    for pairs, methods in groups.items():
        seeds = sorted({s for s, _ in pairs})
        trials = sorted({t for _, t in pairs})
        if len(pairs) == len(seeds) * len(trials):
            out.append((methods, seeds, trials))
        else:
            for s in seeds:
                out.append((methods, [s], sorted(t for ss, t in pairs if ss == s)))
    return out


def multirun_command(
    task: Task,
    profile: str,
    methods: list[str],
    seeds: list[int],
    trials: list[str],
    budget: float,
    results_dir: Path,
    overrides: list[str],
) -> list[str]:
    """The ``src/train.py -m`` command of one sweep."""
    return [
        sys.executable,
        "src/train.py",
        "-m",
        f"experiment={experiment_config(task.experiment, profile)}",
        f"optimizer={','.join(methods)}",
        f"seed={','.join(str(s) for s in seeds)}",
        f"cross.trial={','.join(trials)}",
        f"paths.results_dir={results_arg(results_dir)}",
        f"trainer.max_algo_time_s={budget:g}",
        "trainer.clock=process",
        "trainer.num_threads=1",
        "logger=none",
        "hydra.sweep.dir=outputs/hydra-multirun/" + task.experiment + "_${now:%Y-%m-%d_%H-%M-%S}",
        *overrides,
    ]


def run_task(task: Task, args: argparse.Namespace, overrides: list[str]) -> int:
    """Plan, record the plan, run what is missing of one task. Returns the exit code of its runs."""
    prof = PROFILES[args.profile]
    seeds = args.seeds if args.seeds is not None else prof["seeds"]
    trials = args.trials if args.trials is not None else prof["trials"]
    budget = args.budget if args.budget is not None else prof["budget_s"][task.key]
    results = Path(args.results_dir)
    # the plan records every method (a run of some methods only must not drop the others' rows)
    info = task_plan(task, args.profile, list(METHODS), seeds, trials, budget)
    applicable = [m for m in args.methods if info["methods"][m]["applies"]]
    for m in args.methods:
        if not info["methods"][m]["applies"]:
            print(f"[n/a] {task.key} {m}: {info['methods'][m]['reason']}", flush=True)
    start, resume = missing_jobs(results, task, args.profile, applicable, seeds, trials)
    n = len(applicable) * len(seeds) * len(trials)
    print(
        f"[{task.key}] {len(applicable)} methods x {len(seeds)} seeds x {len(trials)} trials = {n} runs "
        f"({n - len(start) - len(resume)} kept, {len(resume)} to resume, {len(start)} to start), "
        f"{budget:g} CPU-s each",
        flush=True,
    )
    if not args.dry_run:
        path = grid_path(results, task, args.profile)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    if args.no_run or not (start or resume):
        return 0
    lines = [
        f"{task.experiment}/{run_id_for(m, args.profile, s, t)}: <= {budget:g} CPU-s + evaluation"
        for m, s, t in start + resume
    ]
    footer = f"in all <= {len(lines) * budget / 3600:.1f} CPU-hours of algorithm time, plus evaluation"
    if not args.dry_run and not confirm_start(lines, args.profile, args.yes, footer):
        raise SystemExit(2)
    env = {**os.environ, **THREADS_ENV}
    worst = 0
    extra = [
        f"trainer.max_algo_time_s={budget:g}",
        "trainer.clock=process",
        "trainer.num_threads=1",
        "logger=none",
    ]
    for m, s, t in resume:
        old = {k: os.environ.get(k) for k in THREADS_ENV}
        os.environ.update(THREADS_ENV)
        try:
            action, run_dir = ensure_run(
                task.experiment,
                m,
                s,
                args.profile,
                [f"cross.trial={t}", *extra, *overrides],
                suffix=t,
                results_dir=results,
                dry_run=args.dry_run,
            )
            print(f"[{action}] {run_dir}", flush=True)
        except subprocess.CalledProcessError as err:
            print(f"[failed] {task.key} {m} s{s} {t}: exit {err.returncode}", flush=True)
            worst = max(worst, 1)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    for methods, ss, ts in sweeps(start):
        if not args.dry_run:
            for m in methods:
                for s in ss:
                    for t in ts:
                        move_aside(results / task.experiment / run_id_for(m, args.profile, s, t))
        cmd = multirun_command(task, args.profile, methods, ss, ts, budget, results, overrides)
        print(("would run: $ " if args.dry_run else "$ ") + " ".join(cmd[1:]), flush=True)
        if args.dry_run:
            continue
        try:
            run_train(cmd, env)
        except subprocess.CalledProcessError as err:  # some job failed: the others ran; say so, go on
            print(f"[failed] {task.key}: the sweep exited {err.returncode}; see its log", flush=True)
            worst = max(worst, 1)
    return worst


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="quick", choices=list(PROFILES))
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default: the profile's")
    p.add_argument("--trials", nargs="+", default=None, help="default: the profile's (t0 t1)")
    p.add_argument(
        "--budget", type=float, default=None, help="algorithm CPU-s per run (default: the profile's)"
    )
    p.add_argument("--results-dir", default=str(REPO_ROOT / "results"))
    p.add_argument("--no-run", action="store_true", help="only record the plan")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands; start nothing")
    p.add_argument("--yes", action="store_true", help="start paper-profile runs without asking (also YES=1)")
    args = p.parse_args(argv)
    worst = 0
    for key in args.tasks:
        worst = max(worst, run_task(TASKS[key], args, overrides))
    if worst:
        raise SystemExit(worst)


if __name__ == "__main__":
    main()
