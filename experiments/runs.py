"""Run what is missing: the drivers behind the `make reproduce-*` targets.

Runs get deterministic ids ``<optimizer>_<profile>_s<seed>[_<suffix>]`` so a driver can tell
which of its runs exist. A completed or diverged run is kept (divergence is a result); an
unfinished run (interrupted, or killed: no summary, or a summary still saying ``running``) that
has a checkpoint is resumed from it, so a long run whose directory was committed with its
periodic checkpoint continues on another machine; an unfinished run without a checkpoint is
moved aside (never deleted) and started again.

Before a paper-profile run starts (``--profile paper``, ``make ... SCALE=paper``), the driver lists
the runs it will start with a time estimate read from the committed records of the same optimizer
and profile (:func:`estimate`), and asks for confirmation; ``--yes`` or ``YES=1`` in the environment
answers it for scripts, and without a terminal and without either nothing is started. A dry run
(``--dry-run``) lists the same plan, each run marked ``would run`` / ``would resume``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from curvopt.errors import EXIT_COMPLETED, EXIT_DIVERGED, EXIT_SIGINT, EXIT_SIGTERM

REPO_ROOT = Path(__file__).resolve().parents[1]
FINAL_STATUSES = ("completed", "diverged")
# set once the user agreed to start this process's paper-profile runs (or --yes / YES=1)
_confirmed = False


def yes_from_env() -> bool:
    """Whether ``YES`` in the environment answers the confirmation (``YES=1``, ``true``, ``yes``)."""
    return os.environ.get("YES", "").strip().lower() in ("1", "true", "yes", "y")


def action_label(action: str, dry_run: bool) -> str:
    """What a driver prints for a run: ``kept``, ``ran``, ``resumed``; in a dry run ``would run`` /
    ``would resume`` (nothing was started).

    Args:
        action: :func:`ensure_run`'s action.
        dry_run: Whether nothing was started.

    Returns:
        The label.
    """
    if dry_run and action in ("ran", "resumed"):
        return "would run" if action == "ran" else "would resume"
    return action


def estimate(results_dir: str | Path, experiment: str, optimizer: str, profile: str) -> str:
    """:func:`estimate_seconds`'s text.

    Args:
        results_dir: The results directory.
        experiment: The experiment (its folder under ``results_dir``).
        optimizer: The optimizer config name.
        profile: The profile.

    Returns:
        ``~1.2 h wall, 1.0 h algorithm time on cpu (median of 5 committed runs)``, or a line
        saying there is no record to estimate from.
    """
    return estimate_seconds(results_dir, experiment, optimizer, profile)[1]


def estimate_seconds(
    results_dir: str | Path, experiment: str, optimizer: str, profile: str
) -> tuple[float | None, str]:
    """A run's cost, from the committed records of the same optimizer at the same profile.

    The records of ``experiment`` first; without any, those of its sibling experiments (the same
    name up to the last ``_``: ``shf_fig2_usps`` for ``shf_fig2_mnist``), named in the text.

    Args:
        results_dir: The results directory.
        experiment: The experiment (its folder under ``results_dir``).
        optimizer: The optimizer config name.
        profile: The profile.

    Returns:
        ``(wall seconds, text)``: the median wall time (``None`` without a record) and
        ``~1.2 h wall, 1.0 h algorithm time on cpu (median of 5 committed runs)``, or a line
        saying there is no record to estimate from.
    """
    from curvopt.analysis.records import load_summaries

    root = Path(results_dir)
    stem = experiment.rsplit("_", 1)[0]
    candidates = [experiment] + sorted(
        p.name for p in root.glob(f"{stem}_*") if p.is_dir() and p.name != experiment
    )
    for name in candidates:
        try:
            sums = load_summaries(root, name)
        except Exception:  # an unreadable record: no estimate from it
            continue
        if sums.empty or not {"optimizer", "profile", "status", "wall_time_s"} <= set(sums):
            continue
        same = sums[
            (sums["optimizer"] == optimizer)
            & (sums["profile"] == profile)
            & sums["status"].isin(FINAL_STATUSES)
        ]
        if same.empty:
            continue
        wall = float(same["wall_time_s"].median())
        algo = float(same["algo_time_s"].median()) if "algo_time_s" in same else float("nan")
        column = "device_name" if "device_name" in same else "device" if "device" in same else None
        device = ", ".join(sorted({str(d) for d in same[column].dropna()})) if column else "?"
        where = "" if name == experiment else f" of {name}"
        return wall, (
            f"~{_hours(wall)} wall, {_hours(algo)} algorithm time on {device or '?'} "
            f"(median of {len(same)} committed run{'s' if len(same) != 1 else ''}{where})"
        )
    return None, f"no committed {profile}-profile record of {optimizer} to estimate from"


def _hours(seconds: float) -> str:
    if seconds != seconds:  # NaN
        return "?"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def confirm_start(lines: Sequence[str], profile: str, yes: bool = False, footer: str = "") -> bool:
    """Ask once per process before paper-profile runs start.

    Args:
        lines: One line per run to start (its id and :func:`estimate`).
        profile: The profile; only ``paper`` asks.
        yes: Answered already (``--yes``); ``YES=1`` in the environment counts too.
        footer: A last line (the total).

    Returns:
        Whether to start them: ``True`` for other profiles, once confirmed, or with ``yes``;
        ``False`` when refused, or without a terminal to ask on.
    """
    global _confirmed
    if not lines or profile != "paper" or _confirmed:
        return True
    print(
        f"{len(lines)} paper-profile run(s) to start (the papers' settings; hours each on a CPU):", flush=True
    )
    for line in [*lines, *([footer] if footer else [])]:
        print(f"  {line}", flush=True)
    if yes or yes_from_env():
        _confirmed = True
        return True
    if not sys.stdin.isatty():
        print(
            "not started: confirm with YES=1 (make ... SCALE=paper YES=1) or --yes; "
            "--dry-run lists them without starting anything",
            flush=True,
        )
        return False
    answer = input("Start them? [y/N] ").strip().lower()
    _confirmed = answer in ("y", "yes")
    return _confirmed


def compose_config(overrides: Sequence[str] = ()) -> Any:
    """Compose ``conf/config.yaml`` as ``src/train.py`` would, without running anything.

    Registers the structured-config schemas first (:mod:`curvopt.training.schema`), so scripts and
    tests that compose the configs themselves check keys and types as the entrypoint does.

    Args:
        overrides: Hydra command-line overrides (``experiment=shf_fig2_usps``, ``optimizer.lr=0.1``).

    Returns:
        The composed ``DictConfig``, with the experiment's per-optimizer file applied.
    """
    from hydra import compose, initialize_config_dir

    from curvopt.training.schema import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def run_id_for(optimizer: str, profile: str, seed: int, suffix: str | None = None) -> str:
    """The deterministic run id of a driver's run.

    Args:
        optimizer: The optimizer config name (``shf_lsmr``).
        profile: ``quick`` or ``paper``.
        seed: The run's seed.
        suffix: Distinguishes runs that differ otherwise (a dataset, an ablation); ``None``: none.

    Returns:
        ``<optimizer>_<profile>_s<seed>[_<suffix>]``, e.g. ``shf_lsmr_paper_s0``.
    """
    return f"{optimizer}_{profile}_s{seed}" + (f"_{suffix}" if suffix else "")


def experiment_config(experiment: str, profile: str) -> str:
    """The config name of an experiment at a profile.

    Args:
        experiment: The experiment's base config name (``shf_fig2_usps``), which is the quick
            profile.
        profile: ``quick``, or another profile such as ``paper`` whose config
            ``<experiment>_<profile>`` includes the base one and overrides the paper's settings.

    Returns:
        ``experiment`` for ``quick``, else ``<experiment>_<profile>``.
    """
    return experiment if profile == "quick" else f"{experiment}_{profile}"


def results_arg(results_dir: str | Path) -> str:
    """``paths.results_dir`` for a run started from the repository root.

    Relative to the repository when inside it (``results``), so the command a driver prints and
    the records it leaves name no folder of this machine; absolute otherwise.

    Args:
        results_dir: The results directory (relative to the current directory, or absolute).

    Returns:
        The value to pass.
    """
    path = Path(results_dir).resolve()
    try:
        return str(path.relative_to(REPO_ROOT)) or "."
    except ValueError:
        return str(path)


def run_status(run_dir: Path) -> str | None:
    """The status of a run directory.

    Args:
        run_dir: ``<results_dir>/<experiment>/<run_id>``.

    Returns:
        The ``status`` of its ``summary.json`` (``completed``, ``diverged``, ``running``,
        ``interrupted``, ...); else the status a pack of the experiment (``runs.jsonl`` beside
        it, :mod:`curvopt.analysis.pack`) records for the run; else ``killed`` when the directory
        exists, ``None`` when it does not.
    """
    summary = run_dir / "summary.json"
    if summary.exists():
        return json.loads(summary.read_text()).get("status")
    from curvopt.analysis.pack import read_packed_runs  # pandas/pyarrow: only for this fallback

    for record in read_packed_runs(run_dir.parent):
        if record.get("run_id") == run_dir.name and (record.get("summary") or {}).get("status"):
            return record["summary"]["status"]
    return "killed" if run_dir.exists() else None


def ensure_run(
    experiment: str,
    optimizer: str,
    seed: int,
    profile: str = "quick",
    overrides: Sequence[str] = (),
    suffix: str | None = None,
    results_dir: str | Path = "results",
    dry_run: bool = False,
) -> tuple[str, Path]:
    """Make sure one run exists, running or resuming it through ``src/train.py`` if needed.

    A completed or diverged run is kept. An unfinished run with a ``checkpoint.pt`` is resumed
    (``trainer.resume=true``). An unfinished run without one is renamed to
    ``<run_id>.<status>-<timestamp>`` (never deleted) and started again.

    Args:
        experiment: The experiment's base config name, also its folder under ``results_dir``.
        optimizer: The optimizer config name.
        seed: The run's seed.
        profile: ``quick`` or ``paper`` (see :func:`experiment_config`).
        overrides: Extra Hydra overrides for the run.
        suffix: Run-id suffix (see :func:`run_id_for`).
        results_dir: The results directory (passed on as ``paths.results_dir``).
        dry_run: Print the command without running it (an unfinished run without checkpoint is
            still moved aside).

    A paper-profile run asks first (:func:`confirm_start`, once per process) unless the process
    has confirmed already.

    Returns:
        ``(action, run_dir)``: ``action`` is ``kept``, ``ran`` or ``resumed``.

    Raises:
        SystemExit: The run was interrupted (see :func:`run_train`), or not confirmed (code 2).
        subprocess.CalledProcessError: The run failed.
    """
    run_id = run_id_for(optimizer, profile, seed, suffix)
    run_dir = Path(results_dir) / experiment / run_id
    status = run_status(run_dir)
    if status in FINAL_STATUSES:
        return "kept", run_dir
    cmd = [
        sys.executable,
        "src/train.py",  # run_train runs it from the repository root
        f"experiment={experiment_config(experiment, profile)}",
        f"optimizer={optimizer}",
        f"seed={seed}",
        f"run_id={run_id}",
        f"paths.results_dir={results_arg(results_dir)}",
        *overrides,
    ]
    action = "ran"
    if status is not None and (run_dir / "checkpoint.pt").exists():
        cmd.append("trainer.resume=true")
        action = "resumed"
    elif status is not None:  # killed mid-run, or interrupted without checkpoint: keep it aside
        aside = run_dir.with_name(f"{run_id}.{status}-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        print(f"moved incomplete run {run_dir} -> {aside}", flush=True)
    if dry_run:
        print("would run: $ " + " ".join(cmd[1:]), flush=True)
    else:
        line = f"{run_id} ({experiment}): {estimate(results_dir, experiment, optimizer, profile)}"
        if not confirm_start([line], profile):
            raise SystemExit(2)
        print("$ " + " ".join(cmd[1:]), flush=True)
        env = dict(os.environ)
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        run_train(cmd, env)
    return action, run_dir


def run_train(cmd: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run one ``src/train.py`` command from the repository root and return its exit code.

    A diverged run (exit 3) is a result: the driver goes on. An interrupted one (130 / 143)
    stops the driver with the same code; any other failure raises ``CalledProcessError``
    (docs/resume.md).

    Ctrl-C reaches the run too (same process group): the driver then *waits* for it to finish its
    step and write its checkpoint, where ``subprocess.run`` would SIGKILL it after 0.25 s. A
    SIGTERM sent to the driver alone is passed on to the run, with the same wait.

    Args:
        cmd: The command (``[python, src/train.py, overrides...]``).
        env: The run's environment; ``None``: this process's.

    Returns:
        The exit code: completed (0) or diverged (3).

    Raises:
        SystemExit: The run was interrupted (SIGINT or SIGTERM); the code is 130 or 143.
        subprocess.CalledProcessError: Any other non-zero exit.
    """
    proc = subprocess.Popen(list(cmd), cwd=REPO_ROOT, env=env)

    def forward(signum: int, frame: object) -> None:
        del frame
        proc.send_signal(signum)

    try:
        previous = signal.signal(signal.SIGTERM, forward)
    except ValueError:  # not the main thread: no handler
        previous = None
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # the run got the same Ctrl-C: let it checkpoint
                print("waiting for the run to stop at its step boundary and write its checkpoint", flush=True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if code in (EXIT_SIGINT, EXIT_SIGTERM, -signal.SIGINT, -signal.SIGTERM):
        raise SystemExit(code if code > 0 else 128 - code)
    if code not in (EXIT_COMPLETED, EXIT_DIVERGED):
        raise subprocess.CalledProcessError(code, list(cmd))
    return code


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: run the missing runs of experiments (experiments × optimizers × seeds).

    Arguments containing ``=`` (and not starting with ``-``) are Hydra overrides for every run,
    wherever they appear. The runs to start are listed first, each with :func:`estimate`; at the
    paper profile they start only once confirmed (:func:`confirm_start`; ``--yes`` or ``YES=1``).

    Args:
        argv: ``--experiment`` (one or more), ``--optimizers``, ``--seeds``, ``--profile``,
            ``--results-dir``, ``--dry-run``, ``--yes`` and Hydra overrides; ``None``:
            ``sys.argv[1:]``.
    """
    import argparse

    parser = argparse.ArgumentParser(description="Run the missing runs of experiments.")
    parser.add_argument("--experiment", nargs="+", required=True, help="one or more experiments")
    parser.add_argument("--optimizers", nargs="+", required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--dry-run", action="store_true", help="list what would run; start nothing")
    parser.add_argument(
        "--yes", action="store_true", help="start paper-profile runs without asking (also YES=1)"
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (key=value) for every run")
    # Hydra overrides are the key=value words; take them out first so they may follow a
    # multi-valued option (`--seeds 0 1 trainer.device=cpu`) without being read as its values
    argv = list(sys.argv[1:] if argv is None else argv)
    hydra_overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = parser.parse_args([a for a in argv if a not in hydra_overrides])
    args.overrides = list(args.overrides) + hydra_overrides
    jobs = [(e, o, s) for e in args.experiment for o in args.optimizers for s in args.seeds]
    to_start, costs, total, unknown = [], {}, 0.0, 0
    for experiment, optimizer, seed in jobs:
        run_id = run_id_for(optimizer, args.profile, seed)
        status = run_status(Path(args.results_dir) / experiment / run_id)
        if status not in FINAL_STATUSES:
            seconds, costs[(experiment, run_id)] = estimate_seconds(
                args.results_dir, experiment, optimizer, args.profile
            )
            total, unknown = total + (seconds or 0.0), unknown + (seconds is None)
            verb = "resume" if status is not None else "start"
            to_start.append(f"{verb} {experiment}/{run_id}: {costs[(experiment, run_id)]}")
    footer = (
        f"in all ~{_hours(total)} wall one after the other"
        + (f", plus {unknown} run(s) without an estimate" if unknown else "")
        if len(to_start) > 1
        else ""
    )
    if not args.dry_run and args.profile != "paper" and to_start:
        print(f"{len(to_start)} run(s) to start:", flush=True)
        for line in [*to_start, *([footer] if footer else [])]:
            print(f"  {line}", flush=True)
    if not args.dry_run and not confirm_start(to_start, args.profile, args.yes, footer):
        raise SystemExit(2)
    for experiment, optimizer, seed in jobs:
        action, run_dir = ensure_run(
            experiment,
            optimizer,
            seed,
            args.profile,
            list(args.overrides),
            results_dir=args.results_dir,
            dry_run=args.dry_run,
        )
        cost = costs.get((experiment, run_dir.name)) if args.dry_run and action != "kept" else None
        print(
            f"[{action_label(action, args.dry_run)}] {run_dir}" + (f" ({cost})" if cost else ""), flush=True
        )
    if args.dry_run:
        print(
            f"[dry run] {len(to_start)} run(s) would start{'; ' + footer if footer else ''}; nothing was started"
        )


if __name__ == "__main__":
    main()
