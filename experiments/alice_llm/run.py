"""Run what is missing for a RACS/Alice LLM table or figure, then draw it (the ``make
reproduce-alice-*`` targets).

    python -m experiments.alice_llm.run table2 --profile quick
    python -m experiments.alice_llm.run fig2 --profile paper --sizes 60m 130m
    python -m experiments.alice_llm.run table2 --profile quick --dry-run   # list the commands

Finished runs are kept (``experiments.runs.ensure_run``): a second call only redraws. Extra Hydra
overrides after ``--`` go to every run (e.g. ``-- trainer.device=cuda``). For a multi-GPU node
set ``--nproc N``: each run is started with ``torchrun --standalone --nproc_per_node N``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from experiments.alice_llm import figures
from experiments.alice_llm.specs import (
    ABLATION_METHODS,
    TABLE2_METHODS,
    Method,
    ablation_experiment_for,
    experiment_for,
    sizes_for,
)
from experiments.runs import action_label, confirm_start, ensure_run, estimate

MAIN_KEYS = {m.key for m in TABLE2_METHODS}


def ensure_methods(
    experiment: str,
    methods: list[Method],
    profile: str,
    seeds: list[int],
    overrides: list[str],
    results: Path,
    dry_run: bool,
    ablation: bool = False,
) -> None:
    nproc = int(os.environ.get("CURVOPT_TORCHRUN_NPROC", "1"))
    for m in methods:
        suffix = (m.key.replace("+", "_") if m.key != m.optimizer else None) if ablation else m.suffix
        for seed in seeds:
            run_overrides = [*m.run_overrides(), *overrides]
            action, run_dir = ensure_run(
                experiment,
                m.optimizer,
                seed,
                profile,
                run_overrides,
                suffix=suffix,
                results_dir=results,
                dry_run=dry_run or nproc > 1,
            )
            if nproc > 1 and action != "kept" and not dry_run:
                # ensure_run only listed it (dry_run): ask here as it would have (SCALE=paper)
                line = f"{run_dir.name} ({experiment}, torchrun x{nproc}): " + estimate(
                    results, experiment, m.optimizer, profile
                )
                if not confirm_start([line], profile):
                    raise SystemExit(2)
                _torchrun(
                    experiment, m.optimizer, seed, profile, run_overrides, suffix, results, nproc, action
                )
            print(f"[{action_label(action, dry_run)}] {run_dir}", flush=True)


def _torchrun(
    experiment: str,
    optimizer: str,
    seed: int,
    profile: str,
    overrides: list[str],
    suffix: str | None,
    results: Path,
    nproc: int,
    action: str,
) -> None:
    """The same run as ``ensure_run`` would start, under ``torchrun`` (one process per GPU)."""
    import subprocess

    from experiments.runs import REPO_ROOT, experiment_config, run_id_for

    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(REPO_ROOT / "src" / "train.py"),
        f"experiment={experiment_config(experiment, profile)}", f"optimizer={optimizer}", f"seed={seed}",
        f"run_id={run_id_for(optimizer, profile, seed, suffix)}", f"paths.results_dir={Path(results).resolve()}",
        *overrides,
    ]  # fmt: skip
    if action == "resumed":
        cmd.append("trainer.resume=true")
    print("$ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["table2", "fig1", "fig2", "fig3", "fig5", "table5", "all"])
    parser.add_argument("--profile", default=os.environ.get("SCALE", "quick"), choices=["quick", "paper"])
    parser.add_argument("--sizes", nargs="*", default=None)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--out", type=Path, default=Path("results/figures"))
    parser.add_argument("--nproc", type=int, default=1, help="GPUs per run (torchrun)")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_intermixed_args(argv)
    if args.nproc > 1:
        os.environ["CURVOPT_TORCHRUN_NPROC"] = str(args.nproc)

    what = args.what
    default_sizes = {"fig1": ["1b"], "fig2": ["60m", "130m", "350m"]}.get(what)
    sizes = sizes_for(args.profile, args.sizes or default_sizes)
    for size in sizes:
        ensure_methods(
            experiment_for(size),
            TABLE2_METHODS,
            args.profile,
            args.seeds,
            args.overrides,
            args.results,
            args.dry_run,
        )
    if what in ("fig5", "table5", "all"):
        size = "tiny" if args.profile == "quick" else "130m"
        extra = [m for m in ABLATION_METHODS if m.key not in MAIN_KEYS]
        ensure_methods(
            ablation_experiment_for(size), extra, args.profile, args.seeds, args.overrides, args.results,
            args.dry_run, ablation=True,
        )  # fmt: skip
    if args.dry_run:
        return
    draw = {"all": ["table2", "fig2", "fig3", "fig5", "table5"]}.get(what, [what])
    for item in draw:
        figures.main([item, "--profile", args.profile, "--results", str(args.results), "--out", str(args.out)]
                     + (["--sizes", *args.sizes] if args.sizes else []))  # fmt: skip


if __name__ == "__main__":
    main()
