"""SHF-LSMR items of the reproduction report (``make report``): Figures 2, 3 and Table 2 per dataset.

One item per dataset and figure/table, each judged on that dataset's own records: a dataset with
finished paper-profile runs (USPS and CURVES-like run at the paper's settings on the CPU) is judged
at the paper profile, the others at the quick profile until their paper runs exist (for the items
that compare SHF-LSMR with Martens' HF-CG, until both methods have one). Table 2 reuses
the driver's own table (:func:`experiments.shf.figures.table2`); tolerances come from
``experiments/report/tolerances.yaml`` (``shf:``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from curvopt.analysis.curves import mean_curve_on_grid
from curvopt.analysis.records import load_runs, load_summaries
from experiments.report.core import (
    Context,
    Item,
    ItemResult,
    NotRun,
    existing_figures,
    finished_summaries,
    finite,
    judge,
    pick_profile,
    provenance,
    rel_gap,
)
from experiments.shf.readings import (
    GROWTH_EARLY_SHARE,
    GROWTH_MEAN_SHARE,
    GROWTH_MIN_FACTOR,
    NETWORKS,
    batch_at_shares,
    gradual_growth,
    network_of,
)
from experiments.shf.work import work_comparison

SHF_DATASETS = ("mnist", "usps", "curves")
SHF_NAMES = {"mnist": "MNIST", "usps": "USPS", "curves": "CURVES-like"}


METHODS = ("shf_lsmr", "hf_cg")
FINISHED = ("completed", "diverged")  # as experiments.shf.figures.FINISHED


def _shf_runs(
    ctx: Context, dataset: str, both_methods: bool = False, method: str | None = None
) -> tuple[str, pd.DataFrame]:
    """The profile one dataset is judged at, and its finished runs at that profile.

    Args:
        ctx: The report context (results folder, tolerances).
        dataset: ``mnist``, ``usps`` or ``curves``.
        both_methods: For items that compare SHF-LSMR with Martens' HF-CG: judge at the paper
            profile only once both have a finished paper-profile run (until then, at the quick
            profile, with the paper runs in progress named in a note).
        method: For items about one method (Figure 3: SHF's batch): pick the profile from that
            method's finished runs only.

    Returns:
        ``(profile, summaries)``: ``paper`` when a finished paper-profile run exists (of both
        methods, with ``both_methods``), else ``quick``; the summaries of the finished runs at that
        profile.

    Raises:
        NotRun: No finished run under ``results/shf_fig2_<dataset>/``.
    """
    sums = finished_summaries(ctx.results, f"shf_fig2_{dataset}")
    if method is not None and not sums.empty and "optimizer" in sums:
        sums = sums[sums["optimizer"] == method].reset_index(drop=True)
    if sums.empty:
        what = f"{method} " if method else ""
        raise NotRun(f"no finished {what}runs under results/shf_fig2_{dataset}/")
    profiles = sums.get("cfg.profile", pd.Series(dtype=object)).dropna()
    if both_methods and "optimizer" in sums:
        paper_methods = set(sums.loc[sums["cfg.profile"] == "paper", "optimizer"])
        if not set(METHODS) <= paper_methods and (profiles != "paper").any():
            profiles = profiles[profiles != "paper"]
    profile = pick_profile(profiles)
    if profile is None:
        raise NotRun(f"no finished runs under results/shf_fig2_{dataset}/")
    return profile, sums[sums["cfg.profile"] == profile].reset_index(drop=True)


def _in_progress_note(ctx: Context, dataset: str, profile: str) -> list[str]:
    """A note naming the dataset's paper-profile runs that are still in progress (not judged yet).

    Args:
        ctx: The report context.
        dataset: ``mnist``, ``usps`` or ``curves``.
        profile: The profile the item is judged at (at ``quick``, only paper-profile runs are named).

    Returns:
        One note, or none when no run is open.
    """
    sums = load_summaries(ctx.results, f"shf_fig2_{dataset}")
    if sums.empty or "status" not in sums:
        return []
    open_runs = sums[~sums["status"].isin(FINISHED)]
    if "cfg.profile" in open_runs:
        open_runs = open_runs[open_runs["cfg.profile"] == "paper"] if profile != "paper" else open_runs
    names = sorted(open_runs["run_id"])
    notes = [f"paper-profile runs still in progress (not judged yet): {', '.join(names)}"] if names else []
    if profile != "paper" and "cfg.profile" in sums:
        done = sums[sums["status"].isin(FINISHED) & (sums["cfg.profile"] == "paper")]
        if not done.empty:
            notes.append(
                f"finished paper-profile runs of {', '.join(sorted(set(done['optimizer'])))} only: this "
                "comparison is judged at the quick profile until both methods have one"
            )
    return notes


def shf_table2(dataset: str) -> Callable[[Context], ItemResult]:
    """The evaluator of Table 2's row for one dataset.

    Ours against the paper's errors at the paper's selected iterates (SHF at the best-validation
    iterate, Martens at the best-test iterate), in the error measure ``tolerances.yaml`` names, plus the
    SHF-vs-Martens claim.

    Args:
        dataset: ``mnist``, ``usps`` or ``curves``.

    Returns:
        ``evaluate(ctx) -> ItemResult``; it raises :class:`NotRun` when the records hold no evaluations.
    """

    def evaluate(ctx: Context) -> ItemResult:
        tol = ctx.tol("shf", "table2")
        profile, sums = _shf_runs(ctx, dataset, both_methods=True)
        # imported here, not at the top: a broken driver is this item's "error", not a crashed report
        from experiments.shf import figures

        with tempfile.TemporaryDirectory() as tmp:
            table = figures.table2(ctx.results, [dataset], profile, Path(tmp))
        if "selection" not in table:
            raise NotRun(f"no evaluations in the {dataset} SHF records")
        # the paper's protocols: SHF at the best-validation iterate, Martens at the best-test iterate
        keep = ((table["method"] == "shf_lsmr") & (table["selection"] == "best_val")) | (
            (table["method"] == "hf_cg") & (table["selection"] == "best_test")
        )
        t = table[keep].copy()
        if t.empty:
            raise NotRun(f"no evaluations in the {dataset} SHF records")
        # which of our two error measures is compared with the paper's numbers (tolerances.yaml)
        metric = str(tol.get("metric", "E_sq"))
        if metric not in ("E_sq", "f"):
            raise ValueError(f"shf.table2.metric must be 'E_sq' or 'f', got {metric!r}")
        scale = 0.5 if metric == "f" else 1.0
        t["ours_train_m"] = t["ours_train_E_sq"] * scale
        t["ours_test_m"] = t["ours_test_E_sq"] * scale
        t["gap_test_rel"] = [rel_gap(o, p) for o, p in zip(t["ours_test_m"], t["paper_test"])]
        # our CURVES-like generator is not Martens' file: its errors are not the paper's to compare with
        different_data = t["data"].astype(str).str.contains("CURVES-like")
        rows = pd.DataFrame(
            {
                "dataset": t["data"],
                "method": t["method"],
                "selection": t["selection"],
                "paper train": t["paper_train"],
                f"ours train ({metric})": t["ours_train_m"],
                "train std": t["ours_train_std"] * scale,
                "paper test": t["paper_test"],
                f"ours test ({metric})": t["ours_test_m"],
                "test std": t["ours_test_std"] * scale,
                "ours test E_sq": t["ours_test_E_sq"],
                "test gap (rel.)": [
                    "– (different data)" if other else (f"{g:+.1%}" if finite(g) else "–")
                    for other, g in zip(different_data, t["gap_test_rel"])
                ],
                "seeds": t["seeds"],
            }
        )
        within = bool((t["gap_test_rel"].abs() <= tol["rel_tol"]).all())
        qual, notes = _shf_claim(t, tol)
        synthetic = bool(different_data.any())
        if synthetic:
            within = None
            notes.append(
                "CURVES-like data (our generator; Martens' digs3pts_1.mat is not in the data directory): "
                "the errors are not comparable with the paper's, so only the claim (SHF worse than "
                "Martens on CURVES) is judged"
            )
        # "reproduced" needs the numbers within tolerance AND the paper's SHF-vs-Martens claim where
        # both methods have finished runs (numbers within tolerance with the ordering reversed is a
        # difference, and says so)
        quantitative = None if within is None else (within and qual is not False)
        if within and qual is False:
            notes.append(
                f"both methods' test errors are within {tol['rel_tol']:.0%} of the paper's, but the paper's "
                "SHF-vs-Martens claim does not hold in our runs"
            )
        if not {"shf_lsmr", "hf_cg"} <= set(t["method"]):
            notes.append(
                "only one method has finished paper-profile runs: the SHF-vs-Martens claim is not checked yet"
            )
        if "cfg.model.loss" in sums and "optimizer" in sums:
            losses = sums.loc[sums["optimizer"] == "hf_cg", "cfg.model.loss"].dropna()
            nets = sorted({network_of(loss) for loss in losses})
            if nets:
                trains = " and ".join(NETWORKS[n] for n in nets)
                notes.append(f"{dataset}: HF-CG trains {trains} (docs/decisions.md SHF-16)")
        notes += [
            "Errors: E_sq = mean over examples of the summed squared pixel error, f = E_sq/2 (the paper's "
            "objective, mean ½‖x̂ − x‖²); the paper does not say which its 'error' is. Compared with the "
            f"paper: {metric} (experiments/report/tolerances.yaml says why). Ours = mean over seeds, "
            "std over seeds beside it.",
            *_in_progress_note(ctx, dataset, profile),
        ]
        worst = t["gap_test_rel"].abs().max()
        return ItemResult(
            judge(profile, quantitative if profile == "paper" else None, qual),
            rows=rows,
            notes=notes,
            gap="– (different data)" if synthetic else f"largest |test gap| vs paper {worst:.1%}",
            provenance=provenance(sums),
        )

    return evaluate


def _shf_claim(t: pd.DataFrame, tol: dict[str, Any]) -> tuple[bool | None, list[str]]:
    """Spec §5: SHF test within ``claim_rel`` of our Martens on MNIST/USPS; worse on CURVES.

    Args:
        t: Table 2 rows (one per dataset and method) with ``ours_test_E_sq``.
        tol: The ``shf.table2`` tolerances (``claim_rel``).

    Returns:
        ``(holds, notes)``: whether the claim holds on every dataset with both methods (``None`` when
        no dataset has both), and one note per dataset checked.
    """
    oks, notes = [], []
    for dataset, part in t.groupby("dataset"):
        by = part.set_index("method")["ours_test_E_sq"]
        if not {"shf_lsmr", "hf_cg"} <= set(by.index):
            continue
        ratio = by["shf_lsmr"] / by["hf_cg"]
        ok = ratio > 1.0 if dataset == "curves" else abs(ratio - 1.0) <= tol["claim_rel"]
        oks.append(ok)
        want = "> 1 (SHF worse on CURVES)" if dataset == "curves" else f"within ±{tol['claim_rel']:.0%} of 1"
        notes.append(
            f"{dataset}: ours SHF/Martens test error = {ratio:.3f} (paper claim: {want}) -> {'ok' if ok else 'no'}"
        )
    return (all(oks) if oks else None), notes


def shf_fig2(dataset: str) -> Callable[[Context], ItemResult]:
    """The evaluator of Figure 2 for one dataset: both methods' mean test curves read at their common time.

    Args:
        dataset: ``mnist``, ``usps`` or ``curves``.

    Returns:
        ``evaluate(ctx) -> ItemResult`` (the paper prints no numbers for Figure 2: claim check only).
    """

    def evaluate(ctx: Context) -> ItemResult:
        tol = ctx.tol("shf", "fig2")
        profile, sums = _shf_runs(ctx, dataset, both_methods=True)
        runs = load_runs(ctx.results, f"shf_fig2_{dataset}", status="completed")
        runs = runs[runs["profile"] == profile] if not runs.empty else runs
        ends, finals, rows = {}, {}, []
        for method, part in runs.groupby("optimizer") if not runs.empty else []:
            grid, mean, _ = mean_curve_on_grid(part, "algo_time_s", "test/E_sq")
            if grid.size:
                ends[method] = (grid, mean)
        ok = None
        if {"shf_lsmr", "hf_cg"} <= set(ends):
            t_common = min(ends["shf_lsmr"][0][-1], ends["hf_cg"][0][-1])
            for m in ("shf_lsmr", "hf_cg"):
                finals[m] = float(np.interp(t_common, *ends[m]))
            ratio = finals["shf_lsmr"] / finals["hf_cg"]
            ok = ratio <= 1.0 + tol["claim_rel"] if dataset != "curves" else True
            rows.append(
                {
                    "dataset": SHF_NAMES[dataset],
                    "common time (s)": t_common,
                    "SHF test E_sq": finals["shf_lsmr"],
                    "Martens test E_sq": finals["hf_cg"],
                    "SHF / Martens": ratio,
                    "claim": "similar path (ratio ≤ 1 + tol)" if dataset != "curves" else "SHF worse allowed",
                    "holds": ok,
                }
            )
        figs = existing_figures(ctx.results, [f"figures/shf_fig2_{profile}.png"])
        notes = [
            "Paper gives no numbers for Figure 2; the check reads both mean test curves at the common time.",
            *_in_progress_note(ctx, dataset, profile),
        ]
        work = work_comparison(runs, profile)  # no ratio without both methods' completed records
        if work["ratio"] is not None:
            notes.append(
                f"Machine-independent check (not judged): at equal curvature work, {work['common_work'] / 1e6:.1f} M "
                f"example-products (Σ inner iterations × batch), SHF / Martens test E_sq = {work['ratio']:.3f}; "
                "CPU seconds per operation differ between the machines that ran the seeds "
                "(`python -m experiments.shf.audit --work`)."
            )
        return ItemResult(
            judge(profile, None, ok),
            rows=pd.DataFrame(rows),
            figures=figs,
            notes=notes,
            provenance=provenance(sums),
        )

    return evaluate


def shf_fig3(dataset: str) -> Callable[[Context], ItemResult]:
    """The evaluator of Figure 3 for one dataset: SHF's mini-batch grows *gradually* over the run.

    Judged on :func:`experiments.shf.readings.gradual_growth` (docs/decisions.md SHF-28): the batch
    never shrinks, grows to at least 1.5·n₁, has made less than half of its growth by 25 % of the
    run time, and its time average is at most half of n_max. A jump to n_max at t ≈ 0 reads
    ``different``.

    Args:
        dataset: ``mnist``, ``usps`` or ``curves``.

    Returns:
        ``evaluate(ctx) -> ItemResult``.
    """

    def evaluate(ctx: Context) -> ItemResult:
        profile, sums = _shf_runs(ctx, dataset, method="shf_lsmr")
        runs = load_runs(ctx.results, f"shf_fig2_{dataset}", status="completed")
        n_max = {}
        if not sums.empty and "cfg.optimizer.max_batch_size" in sums:
            for _, s in sums.iterrows():
                cap = s.get("cfg.optimizer.max_batch_size")
                if finite(cap):
                    n_max[s["run_id"]] = min(float(cap), float(s.get("cfg.dataset.num_train", cap)))
        rows, oks = [], []
        if not runs.empty and "batch_size" in runs:
            runs = runs[(runs["profile"] == profile) & (runs["optimizer"] == "shf_lsmr")]
            for run_id, part in runs.groupby("run_id"):
                part = part.sort_values("step").dropna(subset=["batch_size"])
                b = part["batch_size"].to_numpy(dtype=float)
                if b.size < 2 or run_id not in n_max:
                    continue
                t = part["algo_time_s"].to_numpy(dtype=float)
                t_max = t[int(np.argmax(b >= b.max()))]
                monotone = bool(np.all(np.diff(b) >= 0))
                growth = gradual_growth(t, b, n_max[run_id])
                n25, n50, n75 = batch_at_shares(t, b)
                oks.append(monotone and growth["ok"])
                rows.append(
                    {
                        "dataset": SHF_NAMES[dataset],
                        "run": run_id,
                        "first batch": b[0],
                        "last batch": b[-1],
                        "n_max": n_max[run_id],
                        "non-decreasing": monotone,
                        "largest batch reached at (share of run time)": (
                            f"{t_max / t[-1]:.1%}" if t[-1] > 0 else "–"
                        ),
                        "n at 25/50/75 % of time": f"{n25:.0f} / {n50:.0f} / {n75:.0f}",
                        "time-averaged batch / n_max": f"{growth['time_mean_batch'] / n_max[run_id]:.2f}",
                        "gradual": growth["ok"],
                    }
                )
        figs = existing_figures(ctx.results, [f"figures/shf_fig3_{profile}.png"])
        return ItemResult(
            judge(profile, None, all(oks) if oks else None),
            rows=pd.DataFrame(rows),
            figures=figs,
            notes=[
                "Claim (paper Section 4.3 and Section 6, Figure 3): the mini-batch starts small and grows "
                "gradually 'throughout the progression of the algorithm', so that SHF 'uses significantly "
                "less memory' than Martens' fixed batch.",
                f"Judged on (docs/decisions.md SHF-28): never shrinks; grows to ≥ {GROWTH_MIN_FACTOR}·n_1; "
                f"less than half of the growth done by {GROWTH_EARLY_SHARE:.0%} of the run time; time-averaged "
                f"batch ≤ {GROWTH_MEAN_SHARE}·n_max. A jump to n_max at t ≈ 0 fails the last two.",
                *_in_progress_note(ctx, dataset, profile),
            ],
            provenance=provenance(sums),
        )

    return evaluate


def _shf_items() -> list[Item]:
    """The SHF-LSMR items: Figure 2, Figure 3 and Table 2 for each dataset, in that order.

    Returns:
        The items, in the report's order.
    """
    items = []
    for d in SHF_DATASETS:
        name = SHF_NAMES[d]
        make = f"make reproduce-shf SHF_DATASETS={d}"
        items += [
            Item("shf", f"fig2_{d}", f"Figure 2 ({name}): training/test error vs time", make, shf_fig2(d)),
            Item("shf", f"fig3_{d}", f"Figure 3 ({name}): mini-batch size vs time", make, shf_fig3(d)),
            Item(
                "shf",
                f"table2_{d}",
                f"Table 2 ({name} row): train/test error at the selected iterate",
                make,
                shf_table2(d),
            ),
        ]
    return items


ITEMS: list[Item] = _shf_items()
