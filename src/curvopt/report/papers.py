"""The items of the reproduction report: one evaluator per figure/table of each paper.

Evaluators read run records (shared readers, or the drivers' own record-reading functions, imported
from ``experiments/``) and compare with the paper numbers that sit next to the drivers
(``experiments/*/paper_*.csv``). Tolerances come from ``experiments/report/tolerances.yaml``.
Each raises :class:`NotRun` when its records are absent.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from curvopt.analysis.curves import mean_curve_on_grid
from curvopt.analysis.records import load_runs, load_summaries
from curvopt.report.core import (
    NOT_PAPER_SCALE,
    QUALITATIVE,
    REPRODUCED,
    Context,
    Item,
    ItemResult,
    NotRun,
    existing_figures,
    finished_summaries,
    fmt,
    judge,
    load_driver,
    pick_profile,
    provenance,
    rel_gap,
)

PAPERS = {
    "shf": "SHF-LSMR (Emirahmetoglu & Stewart): stochastic Hessian-free with LSMR",
    "fgn": "FGN: fast Gauss-Newton for multiclass cross-entropy",
    "fosi": "FOSI (Sivan, Gabel, Schuster, ICLR 2024)",
    "alice": "RACS / Alice (Gong et al., arXiv 2502.07752)",
}


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


# =========================================================================================== SHF-LSMR
# One item per dataset and figure/table, each judged on that dataset's own records: a dataset with
# finished paper-profile runs (USPS and CURVES-like run at the paper's settings on the CPU) is judged
# at the paper profile, the others at the quick profile until their paper runs exist.
SHF_DATASETS = ("mnist", "usps", "curves")
SHF_NAMES = {"mnist": "MNIST", "usps": "USPS", "curves": "CURVES-like"}


def _shf_runs(ctx: Context, dataset: str) -> tuple[str, pd.DataFrame]:
    """(profile, summaries of the finished runs at that profile) for one dataset."""
    sums = finished_summaries(ctx.results, f"shf_fig2_{dataset}")
    if sums.empty:
        raise NotRun(f"no finished runs under results/shf_fig2_{dataset}/")
    profile = pick_profile(sums.get("cfg.profile", pd.Series(dtype=object)).dropna())
    if profile is None:
        raise NotRun(f"no finished runs under results/shf_fig2_{dataset}/")
    return profile, sums[sums["cfg.profile"] == profile].reset_index(drop=True)


def _in_progress_note(ctx: Context, dataset: str, profile: str) -> list[str]:
    sums = load_summaries(ctx.results, f"shf_fig2_{dataset}")
    if sums.empty or "status" not in sums:
        return []
    open_runs = sums[~sums["status"].isin(["completed", "diverged"])]
    if "cfg.profile" in open_runs:
        open_runs = open_runs[open_runs["cfg.profile"] == "paper"] if profile != "paper" else open_runs
    names = sorted(open_runs["run_id"])
    return [f"paper-profile runs still in progress (not judged yet): {', '.join(names)}"] if names else []


def shf_table2(dataset: str) -> Callable[[Context], ItemResult]:
    def evaluate(ctx: Context) -> ItemResult:
        tol = ctx.tol("shf", "table2")
        profile, sums = _shf_runs(ctx, dataset)
        figures = load_driver("experiments/shf/figures.py")
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
                "test gap (rel.)": [f"{g:+.1%}" if _finite(g) else "–" for g in t["gap_test_rel"]],
                "seeds": t["seeds"],
            }
        )
        within = bool((t["gap_test_rel"].abs() <= tol["rel_tol"]).all())
        qual, notes = _shf_claim(t, tol)
        # "reproduced" needs the numbers within tolerance AND the paper's SHF-vs-Martens claim where
        # both methods have finished runs (numbers within tolerance with the ordering reversed is a
        # difference, and says so)
        quantitative = within and qual is not False
        if within and qual is False:
            notes.append(
                f"both methods' test errors are within {tol['rel_tol']:.0%} of the paper's, but the paper's "
                "SHF-vs-Martens claim does not hold in our runs"
            )
        if not {"shf_lsmr", "hf_cg"} <= set(t["method"]):
            notes.append(
                "only one method has finished paper-profile runs: the SHF-vs-Martens claim is not checked yet"
            )
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
            gap=f"largest |test gap| vs paper {worst:.1%}",
            provenance=provenance(sums),
        )

    return evaluate


def _shf_claim(t: pd.DataFrame, tol: dict[str, Any]) -> tuple[bool | None, list[str]]:
    """Spec §5: SHF test within ``claim_rel`` of our Martens on MNIST/USPS; worse on CURVES."""
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
    def evaluate(ctx: Context) -> ItemResult:
        tol = ctx.tol("shf", "fig2")
        profile, sums = _shf_runs(ctx, dataset)
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
        return ItemResult(
            judge(profile, None, ok),
            rows=pd.DataFrame(rows),
            figures=figs,
            notes=notes,
            provenance=provenance(sums),
        )

    return evaluate


def shf_fig3(dataset: str) -> Callable[[Context], ItemResult]:
    def evaluate(ctx: Context) -> ItemResult:
        profile, sums = _shf_runs(ctx, dataset)
        runs = load_runs(ctx.results, f"shf_fig2_{dataset}", status="completed")
        rows, oks = [], []
        if not runs.empty and "batch_size" in runs:
            runs = runs[(runs["profile"] == profile) & (runs["optimizer"] == "shf_lsmr")]
            for run_id, part in runs.groupby("run_id"):
                b = part.sort_values("step")["batch_size"].dropna().to_numpy(dtype=float)
                if b.size < 2:
                    continue
                monotone = bool(np.all(np.diff(b) >= 0))
                grew = bool(b[-1] > b[0])
                oks.append(monotone and grew)
                rows.append(
                    {
                        "dataset": SHF_NAMES[dataset],
                        "run": run_id,
                        "first batch": b[0],
                        "last batch": b[-1],
                        "non-decreasing": monotone,
                        "grows": grew,
                    }
                )
        figs = existing_figures(ctx.results, [f"figures/shf_fig3_{profile}.png"])
        return ItemResult(
            judge(profile, None, all(oks) if oks else None),
            rows=pd.DataFrame(rows),
            figures=figs,
            notes=["Claim (spec §5.4): SHF mini-batches grow monotonically from n_1 and stay small."],
            provenance=provenance(sums),
        )

    return evaluate


def _shf_items() -> list[Item]:
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


# ================================================================================================ FGN
def fgn_fig2(ctx: Context) -> ItemResult:
    tol = ctx.tol("fgn", "fig2")
    root = ctx.results / "fgn_fig2"
    profiles = [p.name for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    profile = pick_profile(
        [p for p in profiles if any((root / p).glob("*.csv")) or (root / p / "timing.jsonl").exists()]
    )
    if profile is None:
        raise NotRun("no records under results/fgn_fig2/<profile>/")
    folder = root / profile
    checks, notes, rows = {}, [], []
    timing = folder / "timing.jsonl"
    device = "?"
    if timing.exists():
        t = pd.DataFrame([json.loads(line) for line in timing.read_text().splitlines() if line.strip()])
        t = t[t["status"] == "ok"]
        if not t.empty:
            device = ", ".join(sorted(set(t.get("device", t.get("device_kind")).astype(str))))
            cell = t.groupby(["method", "C"])["ms_mean"].median().unstack("method")
            c_max = cell.index.max()
            at = cell.loc[c_max]
            fgn = min(at.get("fgn_affine", np.inf), at.get("fgn_generic", np.inf))
            checks["a"] = bool(at.get("adam", np.nan) < fgn < at.get("sgn", np.nan))
            rows += [
                {
                    "panel": "(a)",
                    "quantity": f"ms/update at C={c_max}: {m}",
                    "paper": "Adam < FGN < SGN",
                    "ours": v,
                }
                for m, v in at.items()
            ]
    traces = folder / "traces.csv"
    if traces.exists():
        tr = pd.read_csv(traces)
        err = float(
            max(
                (tr["tau_full_matrix"] - (tr["tau_ret_matrix"] + tr["tau_drop_matrix"])).abs().max(),
                (tr["tau_full_matrix"] - tr["tau_full"]).abs().max(),
                (tr["tau_drop_matrix"] - tr["tau_drop"]).abs().max(),
            )
        )
        checks["b"] = err <= tol["trace_abs_tol"]
        rows.append(
            {"panel": "(b)", "quantity": "max |trace identity error|", "paper": "0 (exact)", "ours": err}
        )
    quality = folder / "quality.csv"
    if quality.exists():
        q = pd.read_csv(quality)
        ycol = next((c for c in ("R", "ratio", "r") if c in q), None)
        if ycol and "xi" in q:
            group = [c for c in q.columns if "damp" in c or c == "scale"][:1]
            ok = True
            for _, part in q.groupby(group) if group else [(None, q)]:
                part = part.sort_values("xi")
                ok &= bool(part[ycol].iloc[0] >= part[ycol].iloc[-1])
            checks["c"] = ok
            rows.append(
                {"panel": "(c)", "quantity": "R decreases with ξ (every damping)", "paper": "yes", "ours": ok}
            )
        else:
            notes.append("(c) quality.csv has no R/xi columns the report knows; not checked")
    if not checks:
        raise NotRun(f"results/fgn_fig2/{profile}/ holds no timing/trace/quality records")
    figs = existing_figures(ctx.results, [f"figures/fgn/fig2_{profile}.png"])
    notes.append("checks: " + ", ".join(f"{k}: {'ok' if v else 'no'}" for k, v in checks.items()))
    quantitative = checks.get("b") if profile == "paper" else None
    return ItemResult(
        judge(profile, quantitative, all(checks.values())),
        rows=pd.DataFrame(rows),
        figures=figs,
        notes=notes,
        provenance=f"profile {profile}; device {device}",
    )


def _fgn_cars(ctx: Context) -> tuple[str, str, pd.DataFrame, Any]:
    cars = load_driver("experiments/fgn/cars196.py")
    sums = finished_summaries(ctx.results, cars.EXPERIMENT)
    if sums.empty:
        raise NotRun(f"no finished runs under results/{cars.EXPERIMENT}/")
    profile = pick_profile(sums["cfg.profile"].dropna())
    sel = sums[sums["cfg.profile"] == profile]
    datasets = list(sel["cfg.dataset.name"].dropna().unique())
    real = [d for d in datasets if d == "cars196"]
    dataset = real[0] if real else (datasets[0] if datasets else cars.DEFAULT_DATASET[profile])
    runs = cars.select_runs(ctx.results, profile, dataset)
    if runs.empty:
        raise NotRun(f"no finished {profile} runs on {dataset}")
    return profile, dataset, sel[sel["cfg.dataset.name"] == dataset], (cars, runs)


def fgn_table1(ctx: Context) -> ItemResult:
    tol = ctx.tol("fgn", "table1")
    profile, dataset, sums, (cars, runs) = _fgn_cars(ctx)
    synthetic = (
        bool(runs["synthetic_data"].fillna(False).astype(bool).any()) if "synthetic_data" in runs else False
    )
    table, notes_d = cars.table1(runs, synthetic)
    ours = table.set_index("method")
    paper = {"adam": (42.24, 2.8449), "sgn": (44.16, 2.3603), "fgn": (44.29, 2.3519)}
    paper_speed = [1.38, 1.41, 1.37]
    labels = {"adam": "Adam", "sgn": "SGN", "fgn": "FGN"}
    rows = []
    for m, (p_acc, p_ce) in paper.items():
        if m not in ours.index:
            continue
        n = ours.loc[m, "seeds"]
        rows.append({"quantity": f"{labels[m]} acc. at horizon (%)", "paper": p_acc,
                     "ours": ours.loc[m, "acc_at_horizon"], "seeds": n})  # fmt: skip
        rows.append({"quantity": f"{labels[m]} test CE at horizon", "paper": p_ce,
                     "ours": ours.loc[m, "ce_at_horizon"], "seeds": n})  # fmt: skip
    # SGN/FGN time-to-threshold ratios: over whole runs when the driver offers it (a slow SGN may
    # reach the thresholds only after the shared horizon), else within the horizon
    speed_src = "within the shared horizon"
    speed = cars.speedups(table)
    if hasattr(cars, "whole_run_times"):
        whole, whole_notes = cars.whole_run_times(runs, synthetic)
        if cars.speedups(whole):
            speed, speed_src = (
                cars.speedups(whole),
                f"over whole runs, thresholds {whole_notes['thresholds']}",
            )
    for (col, s), p in zip(sorted(speed.items()), paper_speed):
        rows.append(
            {"quantity": f"SGN/FGN time ratio, {col.removeprefix('time_to_')}", "paper": p, "ours": s}
        )
    acc = ours["acc_at_horizon"]
    qual_parts = []
    if {"fgn", "sgn"} <= set(acc.index):
        qual_parts.append(acc["fgn"] >= acc["sgn"] - tol["acc_match_pp"])
    if {"sgn", "adam"} <= set(acc.index):
        qual_parts.append(acc["sgn"] > acc["adam"])
    finite_speed = [v for v in speed.values() if _finite(v)]
    if finite_speed:
        qual_parts.append(all(v > 1.0 for v in finite_speed))
    qualitative = all(qual_parts) if qual_parts else None
    absent = [m for m in ("adam", "sgn", "fgn") if m not in acc.index]
    quantitative = None
    if profile == "paper" and not synthetic and not absent:
        quantitative = all(abs(acc[m] - paper[m][0]) <= tol["acc_abs_pp"] for m in paper) and all(
            _finite(v) and abs(v / p - 1) <= tol["speedup_rel"]
            for v, p in zip([speed[k] for k in sorted(speed)], paper_speed)
        )
    notes = [
        "Claim: FGN ≳ SGN > Adam at the horizon, and FGN reaches each threshold before SGN (ratio > 1).",
        f"horizon {notes_d['horizon_s']:.3g} s ({notes_d['horizon_rule']}); accuracy thresholds for the "
        f"time ratios: {speed_src}",
        "checks: "
        + ", ".join(
            f"{name}: {'ok' if ok else 'no'}"
            for name, ok in zip(("FGN ≥ SGN − tol", "SGN > Adam", "SGN/FGN > 1"), qual_parts)
        ),
    ]
    if synthetic:
        notes.append(
            "**synthetic Cars196 stand-in**: absolute accuracies are not comparable with the paper's."
        )
    if absent:
        notes.append(f"methods not run yet: {', '.join(absent)} (`make reproduce-fgn-table1`)")
        qualitative = None if qualitative else qualitative  # a claim about three methods needs all three
    gap = f"FGN acc. {acc['fgn'] - paper['fgn'][0]:+.2f} pp vs paper" if "fgn" in acc else ""
    return ItemResult(
        judge(profile if not synthetic else "quick", quantitative, qualitative),
        rows=pd.DataFrame(rows),
        notes=notes,
        gap=gap,
        provenance=provenance(sums, extra=f"data {dataset}"),
    )


def fgn_fig3(ctx: Context) -> ItemResult:
    res = fgn_table1(ctx)
    profile, dataset, _, _ = _fgn_cars(ctx)
    cars = load_driver("experiments/fgn/cars196.py")
    tag = profile if dataset == cars.DEFAULT_DATASET[profile] else f"{profile}_{dataset}"
    res.figures = existing_figures(ctx.results, [f"figures/fgn/fig3_{tag}.png"])
    if res.rows is not None:
        res.rows = res.rows[res.rows["quantity"].str.contains("acc. at horizon")]
    return res


# =============================================================================================== FOSI
FOSI_Q = "fosi_quadratics"


def _fq(ctx: Context) -> Any:
    figs = load_driver("experiments/fosi_quadratics/figures.py")
    if not (ctx.results / FOSI_Q).is_dir():
        raise NotRun(f"no records under results/{FOSI_Q}/")
    return figs


def _fq_summaries(ctx: Context, experiment: str) -> list[dict[str, Any]]:
    figs = _fq(ctx)
    try:
        sums = figs.load_summaries(ctx.results / FOSI_Q, experiment)
    except FileNotFoundError as err:
        raise NotRun(str(err)) from None
    if not sums:
        raise NotRun(f"no {experiment} runs")
    return sums


def _f(s: dict[str, Any]) -> float:
    v = s.get("f_final")
    try:
        x = float(v)
    except (TypeError, ValueError):
        return math.inf
    return x if math.isfinite(x) else math.inf


def fosi_fig3(ctx: Context) -> ItemResult:
    figs = _fq(ctx)
    sums = _fq_summaries(ctx, "q1_fig3")
    rows, oks = [], []
    for n in sorted({s["setting"]["n"] for s in sums}):
        for lam in sorted({s["setting"]["lambda1"] for s in sums}):
            by = {
                s["setting"]["optimizer"]: s
                for s in sums
                if s["setting"]["n"] == n and s["setting"]["lambda1"] == lam
            }
            for base in ("adam", "hb", "gd"):
                if base in by and f"fosi_{base}" in by:
                    fb = float(figs.curve(by[base])[200])
                    ff = float(figs.curve(by[f"fosi_{base}"])[200])
                    ok = ff < fb
                    oks.append(ok)
                    rows.append(
                        {
                            "n": n,
                            "λ1": lam,
                            "base": base,
                            "base f(θ200)": fb,
                            "FOSI f(θ200)": ff,
                            "FOSI lower": ok,
                        }
                    )
    return ItemResult(
        judge("paper", None, all(oks) if oks else None),
        rows=pd.DataFrame(rows),
        figures=existing_figures(ctx.results, ["figures/fosi/fig3_*.png"]),
        notes=["Paper: FOSI converges orders of magnitude faster than its base; no numbers are printed."],
        provenance="paper settings (float64 on the CPU, deterministic; n, λ1 as in the paper)",
    )


def fosi_fig4(ctx: Context) -> ItemResult:
    figs = _fq(ctx)
    sums = {s["setting"]["optimizer"]: s for s in _fq_summaries(ctx, "q2_fig4")}
    if not {"gd", "fosi_gd"} <= set(sums):
        raise NotRun("q2_fig4 lacks gd/fosi_gd")
    rows = []
    for it in (0, 200, 250):
        rows.append(
            {
                "iteration": it,
                "GD f": float(figs.curve(sums["gd"])[it]),
                "FOSI-GD f": float(figs.curve(sums["fosi_gd"])[it]),
            }
        )
    ok = rows[1]["FOSI-GD f"] < rows[1]["GD f"]
    st = sums["fosi_gd"]["setting"]
    return ItemResult(
        judge("paper", None, ok),
        rows=pd.DataFrame(rows),
        figures=existing_figures(ctx.results, ["figures/fosi/fig4_*.png"]),
        notes=[
            f"κ = {fmt(st.get('condition_number'))}, FOSI-GD effective κ̃ = {fmt(st.get('effective_condition_number'))}"
        ],
        provenance="paper settings (float64, CPU)",
    )


def fosi_fig7_8(ctx: Context) -> ItemResult:
    figs = _fq(ctx)
    if not (ctx.results / FOSI_Q / "q3_fig7_fig8").is_dir():
        raise NotRun("no q3_fig7_fig8 records")
    table = figs._q3_table(ctx.results / FOSI_Q)
    rows = []
    for base in ("adam", "hb", "gd"):
        if base not in table or f"fosi_{base}" not in table:
            continue
        cells = set(table[base]) & set(table[f"fosi_{base}"])
        better = sum(_f(table[f"fosi_{base}"][c]) <= _f(table[base][c]) for c in cells)
        worst = max(
            (
                _f(table[f"fosi_{base}"][c]) / _f(table[base][c])
                for c in cells
                if 0 < _f(table[base][c]) < math.inf
            ),
            default=math.nan,
        )
        rows.append(
            {
                "base": base,
                "(b, ζ) cells": len(cells),
                "FOSI ≤ base": better,
                "worst FOSI/base f": worst,
                "all": better == len(cells),
            }
        )
    if not rows:
        raise NotRun("q3 records incomplete")
    frame = pd.DataFrame(rows)
    misses = frame[~frame["all"]]
    return ItemResult(
        judge("paper", None, bool(frame["all"].all())),
        gap="; ".join(
            f"FOSI-{r['base']} worse than {r['base']} in {r['(b, ζ) cells'] - r['FOSI ≤ base']}/{r['(b, ζ) cells']} "
            f"cells (worst f ratio {r['worst FOSI/base f']:.2f})"
            for _, r in misses.iterrows()
        ),
        rows=frame,
        figures=existing_figures(ctx.results, ["figures/fosi/fig7_*.png", "figures/fosi/fig8_*.png"]),
        notes=[
            "Paper claim: FOSI improves on its base optimizer for every (b, ζ); f(θ200) compared per cell."
        ],
        provenance="paper settings (float64, CPU)",
    )


def fosi_fig9(ctx: Context) -> ItemResult:
    _fq(ctx)
    rows, oks = [], []
    for exp in ("q4_fig9_lr", "q4_fig9_momentum"):
        sums = _fq_summaries(ctx, exp)
        best: dict[str, float] = {}
        for s in sums:
            name = s["setting"]["optimizer"]
            best[name] = min(best.get(name, math.inf), _f(s))
        for base in ("adam", "hb", "gd"):
            fosis = {k: v for k, v in best.items() if k.startswith(f"fosi_{base}")}
            if base in best and fosis:
                ok = min(fosis.values()) <= best[base]
                oks.append(ok)
                rows.append(
                    {
                        "sweep": exp.split("_")[-1],
                        "base": base,
                        "best base f": best[base],
                        "best FOSI f": min(fosis.values()),
                        "FOSI ≤ base": ok,
                    }
                )
    return ItemResult(
        judge("paper", None, all(oks) if oks else None),
        rows=pd.DataFrame(rows),
        figures=existing_figures(ctx.results, ["figures/fosi/fig9_*.png"]),
        notes=[
            "Claim: FOSI's gain holds over the learning-rate sweep and at tuned momentum (best over the sweep)."
        ],
        provenance="paper settings (float64, CPU)",
    )


def _fosi_tasks(ctx: Context) -> tuple[Any, dict[str, dict[str, pd.DataFrame]], dict[str, str], pd.DataFrame]:
    """Per task: its runs at the best profile available (paper if any, else quick)."""
    analysis = load_driver("experiments/fosi_tasks/analysis.py")
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


def _fosi_time_table(ctx: Context, which: str, key: str) -> ItemResult:
    tol = ctx.tol("fosi", key)
    analysis, runs, profiles, sums = _fosi_tasks(ctx)
    table = analysis.with_paper(analysis.time_table(runs, which), which)
    table = table[table["task"].isin(list(runs))]
    fosi_rows = table[table["optimizer"].str.startswith("fosi_")]
    rows, quant, qual = [], [], []
    skipped = []
    for _, r in fosi_rows.iterrows():
        base = r["optimizer"].removeprefix("fosi_")
        b = table[(table["task"] == r["task"]) & (table["optimizer"] == base)]
        if r["status"] == "missing" or b.empty or b["status"].iloc[0] == "missing":
            skipped.append(f"{r['task']} FOSI-{base}/{base}")
            continue
        ours = r["ratio"]
        paper = r["paper_ratio"]
        reached = _finite(ours)
        ours_eff = float(ours) if reached else math.inf  # FOSI never reached the base's best
        same_side = (ours_eff < 1.0) == (paper < 1.0) if _finite(paper) else None
        within = abs(ours_eff - paper) <= tol["ratio_abs"] if _finite(paper) and reached else False
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
                "profile": profiles[r["task"]],
                "same side of 1": same_side,
            }
        )
    if not rows:
        raise NotRun("no task has both a base and a FOSI run")
    run_profiles = {r["profile"] for r in rows}
    profile = "paper" if run_profiles == {"paper"} else "quick"
    missing = [k for k in analysis.TASKS if k not in runs]
    notes = [
        "Ratio = FOSI time / base time to the base optimizer's best "
        + ("validation metric" if which == "val" else "training loss")
        + "; 'never' = FOSI did not reach it. Paper: A40/JAX seconds; compare ratios only.",
    ]
    if missing:
        notes.append(
            "tasks not run: " + ", ".join(missing) + f" (`make reproduce-fosi-{key}`; AC/TL need data)"
        )
    if skipped:
        notes.append("pairs not run: " + ", ".join(skipped))
    paper_rows = [r for r in rows if r["profile"] == "paper"]
    if paper_rows:
        notes.append(
            f"paper-profile rows within ±{tol['ratio_abs']} of the paper ratio: {sum(quant)}/{len(quant)}"
        )
    status = judge(profile, all(quant) if quant and profile == "paper" else None, all(qual) if qual else None)
    if status == REPRODUCED and (missing or skipped):  # a table is not reproduced by a few of its rows
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
    return _fosi_time_table(ctx, "val", "table1")


def fosi_table2(ctx: Context) -> ItemResult:
    return _fosi_time_table(ctx, "train", "table2")


def fosi_fig5(ctx: Context) -> ItemResult:
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
            ok = _finite(lf) and lf <= lb * (1.0 + tol["train_loss_rel"])
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
    analysis, runs, profiles, sums = _fosi_tasks(ctx)
    rows, oks = [], []
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
            continue
        best = {}
        for label, run in cands.items():
            curve = analysis.eval_curve(task_runs[run], task.val_loss, scale=task.val_loss_scale)
            best[label] = analysis.best_point(curve, "min")[0] if not curve.empty else math.nan
        ok = all(best["FOSI-HB"] <= v or not _finite(v) for k, v in best.items() if k != "FOSI-HB")
        oks.append(ok)
        rows.append(
            {
                "task": key,
                "profile": profiles[key],
                **{f"best val loss {k}": v for k, v in best.items()},
                "FOSI-HB lowest": ok,
            }
        )
    if not rows:
        raise NotRun("no K-FAC / L-BFGS runs next to FOSI-HB")
    profile = "paper" if all(p == "paper" for p in profiles.values()) else "quick"
    frame = pd.DataFrame(rows)
    frame = frame[[c for c in frame.columns if c != "FOSI-HB lowest"] + ["FOSI-HB lowest"]]
    return ItemResult(
        judge(profile, None, all(oks)),
        rows=frame,
        figures=existing_figures(
            ctx.results, [f"figures/fosi_fig6_{k}_{p}.png" for k, p in profiles.items()]
        ),
        notes=["Claim: FOSI-HB reaches a lower validation loss than K-FAC and L-BFGS on every task."],
        provenance=provenance(sums),
    )


def fosi_fig2(ctx: Context) -> ItemResult:
    analysis = load_driver("experiments/fosi_tasks/analysis.py")
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
    if len(best) == 2 and all(_finite(v) for v in best.values()):
        ok = bool(best["fosi_heavy_ball"] >= best["heavy_ball"])
    return ItemResult(
        judge(profile, None, ok),
        rows=pd.DataFrame([{"optimizer": k, "best val hit rate": v} for k, v in best.items()]),
        figures=existing_figures(ctx.results, [f"figures/fosi_fig2_{profile}.png"]),
        notes=["Claim: FOSI-HB reaches HB's best validation accuracy (≈0.40), Adam stays ≈0.29."],
        provenance=provenance(sums[sums["cfg.profile"] == profile]),
    )


def fosi_overhead(ctx: Context) -> ItemResult:
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
        ok = _finite(rho) and float(rho) <= tol["rho_target"] + tol["rho_abs"] if large else None
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
        f"Small models ({', '.join(tol['small_tasks'])}) are expected above 1.1 (spec §6.6); not judged."
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


# ========================================================================================== RACS/Alice
def _alice(ctx: Context) -> Any:
    return load_driver("experiments/alice_llm/figures.py")


def _alice_profile(ctx: Context, experiments: list[str]) -> tuple[str, pd.DataFrame]:
    sums = [finished_summaries(ctx.results, e) for e in experiments]
    sums = (
        pd.concat([s for s in sums if not s.empty], ignore_index=True)
        if any(not s.empty for s in sums)
        else pd.DataFrame()
    )
    if sums.empty:
        raise NotRun("no finished runs under results/" + " or results/".join(experiments) + "/")
    profile = pick_profile(sums["cfg.profile"].dropna())
    return profile, sums[sums["cfg.profile"] == profile]


def _alice_table2(ctx: Context) -> tuple[str, pd.DataFrame, pd.DataFrame]:
    fig = _alice(ctx)
    specs = sys.modules[_alice(ctx).experiment_for.__module__]  # the specs module figures.py imported
    exps = sorted(
        {specs.experiment_for(specs.QUICK_SIZE), *[specs.experiment_for(s) for s in specs.PAPER_SIZES]}
    )
    profile, sums = _alice_profile(ctx, exps)
    df = fig.table2_frame(ctx.results, profile)
    df = df[df["status"] != "missing"]
    if df.empty:
        raise NotRun(f"no tagged {profile} runs")
    return profile, df, sums


def alice_table2(ctx: Context) -> ItemResult:
    tol = ctx.tol("alice", "table2")
    profile, df, sums = _alice_table2(ctx)
    rows = pd.DataFrame(
        {
            "size": df["size"],
            "method": df["label"],
            "paper ppl": df["paper_ppl"],
            "ours ppl": df["ppl"],
            "paper speed-up": df["paper_speedup"],
            "ours speed-up": df["speedup"],
            "steps": df["steps"],
        }
    )
    qual, notes = _alice_order(df)
    quant = None
    if profile == "paper":
        own = df[np.isfinite(df["paper_ppl"].astype(float))]
        quant = bool(((own["ppl"] - own["paper_ppl"]).abs() <= tol["ppl_abs"]).all())
    gaps = (df["ppl"] - df["paper_ppl"]).abs()
    return ItemResult(
        judge(profile, quant, qual),
        rows=rows,
        notes=notes
        + (
            [f"quick profile: a {df['size'].iloc[0]} LLaMA on the C4 sample; paper ppl are for 60M–1B."]
            if profile != "paper"
            else []
        ),
        gap=f"largest |ppl gap| {gaps.max():.2f}" if gaps.notna().any() else "",
        provenance=provenance(sums),
    )


def _alice_order(df: pd.DataFrame) -> tuple[bool | None, list[str]]:
    """Spec §9.8, per size: Alice, Alice-0 and RACS below Adam; Alice below GaLore (both on Ppl.)."""
    oks, notes = [], []
    for size, part in df.groupby("size"):
        ppl = part.set_index("method")["ppl"].astype(float)
        pairs = [(m, "adam") for m in ("alice", "alice+head", "alice0", "alice0+head", "racs")]
        pairs += [("alice", "galore"), ("alice+head", "galore+head")]
        for m, ref in pairs:
            if m in ppl and ref in ppl and _finite(ppl[m]) and _finite(ppl[ref]):
                ok = bool(ppl[m] < ppl[ref])
                oks.append(ok)
                notes.append(
                    f"{size}: {m} ppl {ppl[m]:.2f} vs {ref} {ppl[ref]:.2f} -> {'lower' if ok else 'NOT lower'}"
                )
        missing = [m for m in ("adam", "galore", "racs", "alice0", "alice") if m not in ppl]
        if missing:
            notes.append(f"{size}: not run yet: {', '.join(missing)}")
        if "alice" not in ppl or "adam" not in ppl:  # the claim is about Alice: no verdict without it
            oks.append(None)
    if any(ok is False for ok in oks):
        return False, notes
    return (all(oks) if oks and None not in oks else None), notes


def alice_fig_curves(name: str) -> Any:
    def evaluate(ctx: Context) -> ItemResult:
        profile, df, sums = _alice_table2(ctx)
        qual, notes = _alice_order(df)
        return ItemResult(
            judge(profile, None, qual),
            figures=existing_figures(ctx.results, [f"figures/alice_{name}_{profile}.png"]),
            notes=notes,
            provenance=provenance(sums),
        )

    return evaluate


def alice_fig3(ctx: Context) -> ItemResult:
    tol = ctx.tol("alice", "fig3")
    profile, df, sums = _alice_table2(ctx)
    rows = df[
        ["size", "label", "tokens_per_s", "tp_vs_adam", "paper_tp", "effective_tp", "paper_effective_tp"]
    ]
    alice = df[df["method"] == "alice"]
    ok = None
    if not alice.empty and _finite(alice["tp_vs_adam"].iloc[0]):
        ok = bool(alice["tp_vs_adam"].iloc[0] >= 1.0 - tol["tp_drop_max"])
    return ItemResult(
        judge(profile, None, ok),
        rows=rows.rename(columns={"label": "method"}),
        figures=existing_figures(ctx.results, [f"figures/alice_fig3_{profile}.png"]),
        notes=[
            f"Claim: Alice's throughput drop vs Adam ≤ {tol['tp_drop_max']:.0%} (paper 1B: 15%); timings on a shared CPU are contended."
        ],
        provenance=provenance(sums),
    )


def alice_fig4(ctx: Context) -> ItemResult:
    recs = [json.loads(p.read_text()) for p in sorted((ctx.results / "alice_memory").glob("*.json"))]
    if not recs:
        raise NotRun("no results/alice_memory/*.json")
    df = pd.DataFrame(recs)
    profile = pick_profile(df["profile"])
    df = df[df["profile"] == profile]
    rows = df[["size", "method", "layerwise", "peak_bytes", "memory_kind", "device", "dtype"]].copy()
    rows["peak MiB"] = rows.pop("peak_bytes") / 2**20
    ok = []
    for _, part in df.groupby(["size", "layerwise"]):
        peak = part.set_index("method")["peak_bytes"]
        if "adam" in peak and "alice" in peak:
            ok.append(peak["alice"] < peak["adam"])
    return ItemResult(
        judge(profile, None, all(ok) if ok else None),
        rows=rows,
        figures=existing_figures(ctx.results, [f"figures/alice_fig4_{profile}.png"]),
        notes=["Claim: Alice's peak memory is below Adam's (with and without layer-wise updates)."],
        provenance=f"profile {profile}; device {', '.join(sorted(set(df['device'].astype(str))))}",
    )


def alice_table5(ctx: Context) -> ItemResult:
    fig = _alice(ctx)
    specs = sys.modules[_alice(ctx).experiment_for.__module__]  # the specs module figures.py imported
    exps = sorted({specs.ablation_experiment_for(specs.QUICK_SIZE), specs.ablation_experiment_for("130m")})
    profile, sums = _alice_profile(ctx, exps)
    size = specs.QUICK_SIZE if profile == "quick" else "130m"
    with tempfile.TemporaryDirectory() as tmp:
        fig.table5(ctx.results, profile, size, Path(tmp))
        t = pd.read_csv(Path(tmp) / f"alice_table5_{profile}.csv")
    t = t[np.isfinite(t["ppl"].astype(float))]
    if t.empty:
        raise NotRun(f"no ablation evaluations at profile {profile}")
    ours = t.set_index("method")["ppl"]
    ok = bool(ours.idxmin() == "alice") if "alice" in ours else None
    return ItemResult(
        judge(profile, None, ok),
        rows=t.rename(columns={"ppl": "ours ppl", "paper_ppl_130m": "paper ppl (130M)"}),
        figures=[],
        notes=[
            "Claim: the full Alice (tracking + switch + compensation) is best; paper 26.96 → 27.35 → 25.11 → 21.95."
        ],
        provenance=provenance(sums),
    )


def alice_fig5(ctx: Context) -> ItemResult:
    res = alice_table5(ctx)
    profile = "paper" if "profile paper" in res.provenance else "quick"
    res.figures = existing_figures(ctx.results, [f"figures/alice_fig5_{profile}.png"])
    res.rows = None
    return res


def alice_fig6(ctx: Context) -> ItemResult:
    files = sorted((ctx.results / "alice_basis").glob("*.csv"))
    if not files:
        raise NotRun("no results/alice_basis/<profile>_*.csv")
    profile = pick_profile([f.name.split("_")[0] for f in files])
    df = pd.concat([pd.read_csv(f) for f in files if f.name.startswith(profile + "_")], ignore_index=True)
    rows = df.groupby(["variant", "index"])["abs_cos"].agg(["mean", "min", "count"]).reset_index()
    means = df.groupby("variant")["abs_cos"].mean()
    untracked = [v for v in means.index if "no" in str(v).lower()]
    tracked = [v for v in means.index if v not in untracked]
    ok = None
    if len(untracked) == 1 and len(tracked) == 1:
        ok = bool(means[tracked[0]] >= means[untracked[0]])
    return ItemResult(
        judge(profile, None, ok),
        rows=rows,
        figures=existing_figures(ctx.results, [f"figures/alice_fig6_{profile}.png"]),
        notes=["Claim: tracking keeps the leading basis more stable (mean |cos| with tracking ≥ without)."],
        provenance=f"profile {profile}",
    )


def alice_table3(ctx: Context) -> ItemResult:
    tol = ctx.tol("alice", "table3")
    path = ctx.results / "tables" / "alice_table3.csv"
    if not path.exists():
        raise NotRun("results/tables/alice_table3.csv absent")
    t = pd.read_csv(path)
    t = t[t["paper_gib"].notna()]
    t["gap"] = t["estimate_gib"] - t["paper_gib"]
    within = t["gap"].abs() <= tol["gib_abs"]
    rows = t[["method", "size", "column", "paper_gib", "estimate_gib", "gap", "measured_gib"]].rename(
        columns={"paper_gib": "paper GiB", "estimate_gib": "ours GiB", "measured_gib": "measured GiB (60M)"}
    )
    status = REPRODUCED if within.all() else (QUALITATIVE if within.mean() >= 0.8 else "different")
    return ItemResult(
        status,
        rows=rows,
        notes=[
            f"{int(within.sum())}/{len(t)} cells within ±{tol['gib_abs']} GiB; estimates are analytic (model shapes at paper sizes)."
        ],
        gap=f"largest |gap| {t['gap'].abs().max():.3f} GiB",
        provenance="analytic estimate at the paper's sizes (+ a measured 60M model on the CPU)",
    )


# ============================================================================================== items
ITEMS: list[Item] = [
    *_shf_items(),
    Item(
        "fgn",
        "fig2",
        "Figure 2: update time vs C, trace split, step quality",
        "make reproduce-fgn-fig2",
        fgn_fig2,
    ),
    Item("fgn", "fig3", "Figure 3: Cars196 head, accuracy vs time", "make reproduce-fgn-fig3", fgn_fig3),
    Item(
        "fgn",
        "table1",
        "Table 1: accuracy/CE at the shared horizon, time to thresholds",
        "make reproduce-fgn-table1",
        fgn_table1,
    ),
    Item("fosi", "fig3", "Figure 3: quadratics, n × λ1", "make reproduce-fosi-fig3", fosi_fig3),
    Item("fosi", "fig4", "Figure 4: GD vs FOSI-GD", "make reproduce-fosi-fig4", fosi_fig4),
    Item("fosi", "fig7_8", "Figures 7-8: the (b, ζ) grid", "make reproduce-fosi-fig7-fig8", fosi_fig7_8),
    Item(
        "fosi", "fig9", "Figure 9: learning-rate and momentum sweeps", "make reproduce-fosi-fig9", fosi_fig9
    ),
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
    Item(
        "alice",
        "table2",
        "Table 2: eval perplexity and speed-up",
        "make reproduce-alice-table2",
        alice_table2,
    ),
    Item(
        "alice",
        "fig1",
        "Figure 1: 1B eval-perplexity curves",
        "make reproduce-alice-fig1",
        alice_fig_curves("fig1"),
    ),
    Item(
        "alice",
        "fig2",
        "Figure 2: 60M/130M/350M eval-perplexity curves",
        "make reproduce-alice-fig2",
        alice_fig_curves("fig2"),
    ),
    Item(
        "alice",
        "fig3",
        "Figure 3: throughput and effective throughput",
        "make reproduce-alice-fig3",
        alice_fig3,
    ),
    Item("alice", "fig4", "Figure 4: measured memory", "make reproduce-alice-fig4", alice_fig4),
    Item("alice", "table3", "Table 3: estimated memory", "make reproduce-alice-table3", alice_table3),
    Item("alice", "fig5", "Figure 5: ablations", "make reproduce-alice-fig5", alice_fig5),
    Item("alice", "table5", "Table 5: component ablation", "make reproduce-alice-table5", alice_table5),
    Item(
        "alice", "fig6", "Figure 6: basis stability across refreshes", "make reproduce-alice-fig6", alice_fig6
    ),
]
