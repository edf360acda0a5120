"""FOSI items of the reproduction report (``make report``), the five DNN tasks: Tables 1-2,
Figures 2, 5, 6 and the overhead ρ(T = 800).

Each task is judged at the best profile it has runs for (paper if any, else quick), through the
driver's own record readers (:mod:`experiments.fosi_tasks.analysis`); the overhead item reads the
JSON of ``experiments/fosi_tasks/overhead.py``. Tolerances come from
``experiments/report/tolerances.yaml`` (``fosi:``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pandas as pd

from curvopt.analysis.pack import UNFINISHED
from curvopt.analysis.records import load_summaries
from experiments.report.core import (
    NOT_PAPER_SCALE,
    QUALITATIVE,
    REPRODUCED,
    Context,
    Item,
    ItemResult,
    NotRun,
    existing_figures,
    finished_summaries,
    finite,
    fmt,
    judge,
    pick_profile,
    provenance,
)


def _fosi_tasks(ctx: Context) -> tuple[Any, dict[str, dict[str, pd.DataFrame]], dict[str, str], pd.DataFrame]:
    """Per task: its runs at the best profile available (paper if any, else quick).

    Args:
        ctx: The report context (results folder, tolerances).

    Returns:
        ``(analysis, runs, profiles, summaries)``: the analysis module, per task key its runs by
        optimizer, per task key its profile, and the summaries of every run used.

    Raises:
        NotRun: No task has finished runs.
    """
    # imported here, not at the top: a broken driver is this item's "error", not a crashed report
    from experiments.fosi_tasks import analysis

    runs, profiles, all_sums = {}, {}, []
    for key, task in analysis.TASKS.items():
        sums = finished_summaries(ctx.results, task.experiment)
        if sums.empty:
            continue
        profile = pick_profile(sums["cfg.profile"].dropna())
        loaded = analysis.load_task(ctx.results, task, profile)
        if loaded:
            runs[key], profiles[key] = loaded, profile
            all_sums.append(sums[sums["cfg.profile"] == profile])
    if not runs:
        raise NotRun("no finished runs under results/fosi_<task>/")
    return analysis, runs, profiles, pd.concat(all_sums, ignore_index=True)


# summary statuses of a run not finished: those packing leaves alone, and a run without a summary
NOT_OVER = (*UNFINISHED, "running_or_killed")


def claim_holds(ours: float, paper: float, tol: float) -> bool:
    """Whether our FOSI/base time ratio makes the paper's claim for the row.

    The paper's ratio says FOSI is faster (< 1) or slower (> 1) than its base, or, at exactly 1
    (LR FOSI-Adam, Table 2), no faster. Ours must say the same: below 1 where the paper is below 1,
    above 1 where it is above, and not below ``1 - tol`` where the paper has parity. A ratio within
    the tolerance of the paper's but on the other side of 1 (1.0 or 1.2 where the paper has 0.754)
    does not make the claim.

    Args:
        ours: Our ratio (``inf`` when FOSI never reached the base's best).
        paper: The paper's ratio.
        tol: The table's ``ratio_abs`` tolerance.

    Returns:
        True when the claim holds.

    Example:
        >>> claim_holds(0.82, 0.754, 0.25), claim_holds(1.0, 0.754, 0.25), claim_holds(1.4, 1.0, 0.25)
        (True, False, True)
    """
    if paper == 1.0:
        return ours >= 1.0 - tol
    return (ours < 1.0) == (paper < 1.0) and ours != 1.0


def machine_of(sums: pd.DataFrame, experiment: str, optimizers: Collection[str]) -> str:
    """Which machine type and clock timed a table row: ``cpu, 1 thread, process clock``.

    Args:
        sums: Run summaries (``run_dir``, ``cfg.optimizer.name``, ``device_name``,
            ``num_threads``, ``cfg.trainer.clock``).
        experiment: The task's experiment (``fosi_ae``).
        optimizers: The row's optimizers (base and FOSI).

    Returns:
        One description per distinct (device, threads, clock), joined by `` / ``; ``?`` when no
        summary matches.
    """
    if sums.empty:
        return "?"
    exp = sums["run_dir"].map(lambda d: Path(str(d)).parent.name) if "run_dir" in sums else None
    opt = sums["cfg.optimizer.name"] if "cfg.optimizer.name" in sums else sums.get("optimizer")
    if exp is None or opt is None:
        return "?"
    rows = sums[(exp == experiment) & opt.isin(list(optimizers))]
    seen = []
    for _, r in rows.iterrows():
        device = next((v for v in (r.get("device_name"), r.get("device")) if isinstance(v, str) and v), "?")
        parts = [device]
        if device == "cpu" and finite(r.get("num_threads")):
            parts.append(f"{int(r['num_threads'])} thread{'s' if int(r['num_threads']) != 1 else ''}")
        clock = r.get("cfg.trainer.clock")
        if isinstance(clock, str):
            parts.append(f"{clock} clock")
        text = ", ".join(parts)
        if text not in seen:
            seen.append(text)
    return " / ".join(seen) or "?"


def _fosi_time_table(ctx: Context, which: str, key: str) -> ItemResult:
    """Table 1 or 2: FOSI/base time ratios to the base optimizer's best metric, next to the paper's.

    Args:
        ctx: The report context.
        which: ``val`` (Table 1: best validation metric) or ``train`` (Table 2: best training loss).
        key: The tolerance key, ``table1`` or ``table2``.

    Returns:
        The item's result (not ``reproduced`` while rows are missing).

    Raises:
        NotRun: No task has both a base and a FOSI run.
    """
    tol = ctx.tol("fosi", key)
    analysis, runs, profiles, sums = _fosi_tasks(ctx)
    table = analysis.with_paper(analysis.time_table(runs, which), which)
    table = table[table["task"].isin(list(runs))]
    fosi_rows = table[table["optimizer"].str.startswith("fosi_")]
    rows, quant, qual = [], [], []
    skipped, in_progress = [], []
    for _, r in fosi_rows.iterrows():
        base = r["optimizer"].removeprefix("fosi_")
        b = table[(table["task"] == r["task"]) & (table["optimizer"] == base)]
        if r["status"] == "missing" or b.empty or b["status"].iloc[0] == "missing":
            skipped.append(f"{r['task']} FOSI-{base}/{base}")
            continue
        ours = r["ratio"]
        # a run not over yet: the base's best may still improve, and FOSI may still reach it
        # (a FOSI time already reached is final)
        if b["status"].iloc[0] in NOT_OVER or (r["status"] in NOT_OVER and not finite(ours)):
            in_progress.append(f"{r['task']} FOSI-{base}/{base}")
            continue
        paper = r["paper_ratio"]
        reached = finite(ours)
        ours_eff = float(ours) if reached else math.inf  # FOSI never reached the base's best
        same_side = claim_holds(ours_eff, paper, tol["ratio_abs"]) if finite(paper) else None
        # within tolerance of the paper's number, and making the paper's claim (a ratio of 1.0 is
        # within 0.25 of the paper's 0.754 but says FOSI is no faster)
        within = bool(same_side) and reached and abs(ours_eff - paper) <= tol["ratio_abs"]
        if same_side is not None:
            qual.append(same_side)
        if profiles[r["task"]] == "paper":
            quant.append(within)
        rows.append(
            {
                "task": r["task"],
                "pair": f"FOSI-{base} / {base}",
                "paper s (base, FOSI)": f"{fmt(b['paper_seconds'].iloc[0] if len(b) else math.nan)}, {fmt(r['paper_seconds'])}",
                "ours s (base, FOSI)": f"{fmt(b['seconds'].iloc[0] if len(b) else math.nan)}, {fmt(r['seconds'])}",
                "paper ratio": paper,
                "ours ratio": ours_eff,
                "ours ratio in steps": float(r["step_ratio"]) if finite(r["step_ratio"]) else math.inf,
                "profile": profiles[r["task"]],
                "machine": machine_of(sums, analysis.TASKS[r["task"]].experiment, (base, r["optimizer"])),
                "paper's claim holds": same_side,
            }
        )
    if not rows:
        raise NotRun(
            "no task has both a base and a FOSI run"
            + (f" finished (in progress: {', '.join(in_progress)})" if in_progress else "")
        )
    run_profiles = {r["profile"] for r in rows}
    profile = "paper" if run_profiles == {"paper"} else "quick"
    missing = [k for k in analysis.TASKS if k not in runs]
    notes = [
        "Ratio = FOSI time / base time to the base optimizer's best "
        + ("validation metric" if which == "val" else "training loss")
        + "; 'never' = FOSI did not reach it. Paper: A40/JAX seconds; compare ratios only.",
        "Ratio in steps: the same first hits counted in optimizer steps (equal work per step between "
        "ESEs). Where it is below the time ratio, the difference is what FOSI's ESEs and its extra "
        "cost per step take on this machine.",
    ]
    if missing:
        notes.append(
            "tasks not run: " + ", ".join(missing) + f" (`make reproduce-fosi-{key}`; AC/TL need data)"
        )
    if skipped:
        notes.append("pairs not run: " + ", ".join(skipped))
    if in_progress:
        notes.append("pairs in progress (a run paused or running; not judged yet): " + ", ".join(in_progress))
    paper_rows = [r for r in rows if r["profile"] == "paper"]
    if paper_rows:
        notes.append(
            f"paper-profile rows within ±{tol['ratio_abs']} of the paper ratio: {sum(quant)}/{len(quant)}"
        )
    status = judge(profile, all(quant) if quant and profile == "paper" else None, all(qual) if qual else None)
    if status == REPRODUCED and (
        missing or skipped or in_progress
    ):  # a table is not reproduced by a few of its rows
        status = QUALITATIVE
        notes.append("within tolerance for the rows run; the missing rows keep it below 'reproduced'")
    return ItemResult(
        status,
        rows=pd.DataFrame(rows),
        notes=notes,
        gap="; ".join(
            f"{r['task']} {r['pair'].split(' ')[0]}: {fmt(r['ours ratio'], 3)} vs {fmt(r['paper ratio'], 3)}"
            for r in rows
        ),
        provenance=provenance(sums),
    )


def fosi_table1(ctx: Context) -> ItemResult:
    """Table 1: time to the base optimizer's best validation metric.

    Args:
        ctx: The report context.

    Returns:
        The item's result.
    """
    return _fosi_time_table(ctx, "val", "table1")


def fosi_table2(ctx: Context) -> ItemResult:
    """Table 2: time to the base optimizer's best training loss.

    Args:
        ctx: The report context.

    Returns:
        The item's result.
    """
    return _fosi_time_table(ctx, "train", "table2")


def fosi_fig5(ctx: Context) -> ItemResult:
    """Figure 5: FOSI reaches its base's best training loss (within ``train_loss_rel``) on every task.

    Args:
        ctx: The report context.

    Returns:
        The item's result.
    """
    tol = ctx.tol("fosi", "fig5")
    analysis, runs, profiles, sums = _fosi_tasks(ctx)
    rows, oks = [], []
    for key, task_runs in runs.items():
        for base, fosi in analysis.PAIRS:
            if base not in task_runs or fosi not in task_runs:
                continue
            lb = analysis.best_point(
                analysis.train_curve(task_runs[base], analysis.TASKS[key]).rename(columns={"loss": "value"}),
                "min",
            )[0]
            lf = analysis.best_point(
                analysis.train_curve(task_runs[fosi], analysis.TASKS[key]).rename(columns={"loss": "value"}),
                "min",
            )[0]
            ok = finite(lf) and lf <= lb * (1.0 + tol["train_loss_rel"])
            oks.append(ok)
            rows.append(
                {
                    "task": key,
                    "profile": profiles[key],
                    "base": base,
                    "best train loss base": lb,
                    "best train loss FOSI": lf,
                    "FOSI ≤ base": ok,
                }
            )
    figs = existing_figures(ctx.results, [f"figures/fosi_fig5_{k}_{p}.png" for k, p in profiles.items()])
    profile = "paper" if profiles and all(p == "paper" for p in profiles.values()) else "quick"
    return ItemResult(
        judge(profile, None, all(oks) if oks else None),
        rows=pd.DataFrame(rows),
        figures=figs,
        notes=[
            f"Claim: FOSI reaches its base's training loss or lower (within {tol['train_loss_rel']:.0%}; curves vs epoch and time)."
        ],
        provenance=provenance(sums),
    )


def fosi_fig6(ctx: Context) -> ItemResult:
    """Figure 6: FOSI-HB converges faster and to a lower validation loss than K-FAC and L-BFGS.

    The paper's claim has two parts ("FOSI converges faster and to a lower validation loss"), so a
    task passes only when both hold against every competitor: FOSI-HB's best validation loss is
    the lowest, and FOSI-HB reaches each competitor's best validation loss no later (on the same
    clock) than that competitor first reaches it. A competitor that never gets a finite value
    (diverged) counts as beaten.

    Args:
        ctx: The report context.

    Returns:
        The item's result.

    Raises:
        NotRun: No K-FAC or L-BFGS runs next to FOSI-HB.
    """
    analysis, runs, profiles, sums = _fosi_tasks(ctx)
    rows, oks, alone, budget_notes, in_progress = [], [], [], [], []
    for key, task_runs in runs.items():
        task = analysis.TASKS[key]
        cands = {"FOSI-HB": "fosi_heavy_ball"}
        lb = analysis.best_lbfgs(task_runs, task)
        kf = analysis.best_kfac(task_runs, task)
        if lb:
            cands["L-BFGS"] = lb
        if kf:
            cands["K-FAC"] = kf
        if "fosi_heavy_ball" not in task_runs or len(cands) < 2:
            if "fosi_heavy_ball" in task_runs:
                alone.append(f"{key} ({profiles[key]})")
            continue
        stops = competitor_stops(ctx.results, task.experiment, profiles[key], cands)
        waiting = [f"{label} ({text})" for label, (kind, text) in stops.items() if kind == "in progress"]
        if waiting:
            in_progress.append(f"{key} ({profiles[key]}): " + ", ".join(waiting))
            continue
        budget_notes += [
            f"{key} {label}: {text}" for label, (kind, text) in stops.items() if kind == "budget"
        ]
        curves = {
            label: analysis.eval_curve(task_runs[run], task.val_loss, scale=task.val_loss_scale)
            for label, run in cands.items()
        }
        best = {
            label: analysis.best_point(c, "min") if not c.empty else (math.nan, math.nan)
            for label, c in curves.items()
        }
        lower = all(best["FOSI-HB"][0] <= v for k, (v, _) in best.items() if k != "FOSI-HB" and finite(v))
        speedups = {}
        for label, (value, at) in best.items():
            if label == "FOSI-HB" or not finite(value):
                continue
            fosi_at = analysis.first_time_reaching(curves["FOSI-HB"], value, "min")
            speedups[label] = at / fosi_at if fosi_at > 0 else math.inf
        faster = all(v >= 1.0 for v in speedups.values())
        ok = lower and faster
        oks.append(ok)
        rows.append(
            {
                "task": key,
                "profile": profiles[key],
                **{f"best val loss {k}": v for k, (v, _) in best.items()},
                **{f"speed-up to {k}'s best": v for k, v in speedups.items()},
                "FOSI-HB lower": lower,
                "FOSI-HB faster": faster,
            }
        )
    if not rows:
        if in_progress:
            raise NotRun("competitors not finished (paused or running): " + "; ".join(in_progress))
        raise NotRun("no K-FAC / L-BFGS runs next to FOSI-HB")
    profile = "paper" if all(p == "paper" for p in profiles.values()) else "quick"
    frame = pd.DataFrame(rows)
    last = ["FOSI-HB lower", "FOSI-HB faster"]
    frame = frame[[c for c in frame.columns if c not in last] + last]
    return ItemResult(
        judge(profile, None, all(oks)),
        rows=frame,
        figures=existing_figures(
            ctx.results, [f"figures/fosi_fig6_{k}_{p}.png" for k, p in profiles.items()]
        ),
        notes=[
            "Claim: FOSI-HB converges faster and to a lower validation loss than K-FAC and L-BFGS on "
            "every task. Speed-up to X's best = the time X first reaches its best validation loss / "
            "the time FOSI-HB first reaches that value (≥ 1: FOSI-HB gets there first; inf: at once).",
            *(
                [
                    "not judged: FOSI-HB without a K-FAC or L-BFGS run at the same profile: "
                    + ", ".join(alone)
                    + " (docs/fosi_tasks.md: their cost at the paper's settings)"
                ]
                if alone
                else []
            ),
            *(
                [
                    "not judged yet, a competitor has not finished (paused or running): "
                    + "; ".join(in_progress)
                ]
                if in_progress
                else []
            ),
            *(
                [
                    "compared at equal time, not equal work (the competitor stopped at its time budget): "
                    + "; ".join(budget_notes)
                ]
                if budget_notes
                else []
            ),
        ],
        provenance=provenance(sums),
    )


def competitor_stops(
    results: Path, experiment: str, profile: str, cands: dict[str, str]
) -> dict[str, tuple[str, str]]:
    """How Figure 6's competitors stopped, where it matters for the judgement.

    A competitor run that is not over (paused, or running) cannot be judged yet: its best so far
    is not its best. One that stopped at ``trainer.max_algo_time_s`` before its ``max_steps`` was
    run for a time budget (equal time with FOSI-HB, not equal work), which the report must say.

    Args:
        results: The results directory.
        experiment: The task's experiment directory (``fosi_ae``).
        profile: The task's profile.
        cands: Figure 6's runs, label to run key (``{"K-FAC": "kfac", ...}``).

    Returns:
        Per competitor label with something to say: ``("in progress", text)`` or ``("budget", text)``.
    """
    from experiments.fosi_tasks import analysis

    sums = load_summaries(results, experiment)
    if sums.empty or "run_id" not in sums:
        return {}
    keys = sums["run_id"].map(lambda r: analysis.run_key(str(r), profile))
    out: dict[str, tuple[str, str]] = {}
    for label, key in cands.items():
        if label == "FOSI-HB":
            continue
        match = sums[keys == key]
        if match.empty:
            continue
        r = match.iloc[0]
        steps = r.get("steps")
        steps_text = f"step {int(steps):,}" if finite(steps) else "step ?"
        max_steps = r.get("cfg.trainer.max_steps")
        of = f" of {int(max_steps):,}" if finite(max_steps) else ""
        if r.get("status") in NOT_OVER:
            out[label] = ("in progress", f"{r.get('status')} at {steps_text}{of}")
        elif r.get("stop_reason") == "max_algo_time":
            out[label] = (
                "budget",
                f"{label} stopped at its {fmt(r.get('algo_time_s'))} s time budget, {steps_text}{of}",
            )
    return out


def fosi_fig2(ctx: Context) -> ItemResult:
    """Figure 2 (AC, AudioSet): FOSI-HB reaches HB's best validation hit rate.

    Args:
        ctx: The report context.

    Returns:
        The item's result.

    Raises:
        NotRun: No AC runs (they need the user's AudioSet files).
    """
    from experiments.fosi_tasks import analysis

    task = analysis.TASKS["ac"]
    sums = finished_summaries(ctx.results, task.experiment)
    if sums.empty:
        raise NotRun("AC (AudioSet) runs absent; needs the user's AudioSet files")
    profile = pick_profile(sums["cfg.profile"].dropna())
    runs = analysis.load_task(ctx.results, task, profile)
    best = {}
    for opt in ("heavy_ball", "fosi_heavy_ball"):
        if opt in runs:
            curve = analysis.eval_curve(runs[opt], task.val_metric)
            best[opt] = analysis.best_point(curve, "max")[0] if not curve.empty else math.nan
    ok = None
    if len(best) == 2 and all(finite(v) for v in best.values()):
        ok = bool(best["fosi_heavy_ball"] >= best["heavy_ball"])
    return ItemResult(
        judge(profile, None, ok),
        rows=pd.DataFrame([{"optimizer": k, "best val hit rate": v} for k, v in best.items()]),
        figures=existing_figures(ctx.results, [f"figures/fosi_fig2_{profile}.png"]),
        notes=["Claim: FOSI-HB reaches HB's best validation accuracy (≈0.40), Adam stays ≈0.29."],
        provenance=provenance(sums[sums["cfg.profile"] == profile]),
    )


def fosi_overhead(ctx: Context) -> ItemResult:
    """Overhead: ρ(T = 800) of the large-model tasks within ``rho_abs`` of the paper's 1.1.

    Args:
        ctx: The report context.

    Returns:
        The item's result (``not yet run at paper scale`` while only small-model tasks are measured).

    Raises:
        NotRun: No ``results/tables/fosi_overhead_<profile>.json``.
    """
    tol = ctx.tol("fosi", "overhead")
    paths = {p: ctx.results / "tables" / f"fosi_overhead_{p}.json" for p in ("paper", "quick")}
    found = {p: path for p, path in paths.items() if path.exists()}
    if not found:
        raise NotRun("no results/tables/fosi_overhead_<profile>.json")
    profile = pick_profile(found)
    recs = json.loads(found[profile].read_text())
    rows, oks = [], []
    for r in recs:
        rho = r.get("rho_T800")
        large = r["task"] not in tol["small_tasks"]
        ok = finite(rho) and float(rho) <= tol["rho_target"] + tol["rho_abs"] if large else None
        if ok is not None:
            oks.append(ok)
        rows.append(
            {
                "task": r["task"],
                "base": r["base"],
                "params": r.get("num_params"),
                "paper ρ(T=800)": "≈1.1 (large models)",
                "ours ρ(T=800)": rho,
                "device": r.get("device"),
                "clock": r.get("clock"),
            }
        )
    notes = [
        f"Small models ({', '.join(tol['small_tasks'])}) are expected above 1.1 (paper Appendix A.8); not judged."
    ]
    if not oks:  # only small-model tasks measured: the 1.1 target is not tested yet
        return ItemResult(
            NOT_PAPER_SCALE,
            rows=pd.DataFrame(rows),
            notes=[
                *notes,
                "no large-model task (AE/LM/AC) measured yet",
            ],
            provenance=f"profile {profile}; {found[profile].relative_to(ctx.results)}",
        )
    return ItemResult(
        judge(profile, all(oks) if profile == "paper" else None, all(oks)),
        rows=pd.DataFrame(rows),
        notes=notes,
        provenance=f"profile {profile}; {found[profile].relative_to(ctx.results)}",
    )


ITEMS: list[Item] = [
    Item(
        "fosi",
        "table1",
        "Table 1: time to the base optimizer's best validation metric",
        "make reproduce-fosi-table1",
        fosi_table1,
    ),
    Item(
        "fosi",
        "table2",
        "Table 2: time to the base optimizer's best training loss",
        "make reproduce-fosi-table2",
        fosi_table2,
    ),
    Item("fosi", "fig2", "Figure 2: AC (AudioSet) curves", "make reproduce-fosi-fig2", fosi_fig2),
    Item("fosi", "fig5", "Figure 5: per-task learning curves", "make reproduce-fosi-fig5", fosi_fig5),
    Item("fosi", "fig6", "Figure 6: FOSI-HB vs K-FAC vs L-BFGS", "make reproduce-fosi-fig6", fosi_fig6),
    Item("fosi", "overhead", "Overhead: ρ(T=800) per task", "make bench-fosi-overhead", fosi_overhead),
]
