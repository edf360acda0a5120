"""SHF-LSMR vs HF-CG at equal curvature work: a comparison that does not depend on the machine.

Kept apart from ``report.py`` (which the report package imports) so that the audit CLI and the tests can
import it on its own.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def work_comparison(runs: pd.DataFrame, profile: str = "paper") -> dict:
    """Compare the two methods on a machine-independent axis: curvature work, not CPU seconds.

    CPU seconds per operation differ between the machines (and the contention) that the runs had, so
    a time axis that mixes runs from several sessions also mixes machine speeds. Each LSMR iteration
    and each CG iteration costs one J-product and one Jᵀ-product on the outer iteration's curvature
    batch, so ``work = Σ inner_iters × batch_size`` (example-products) counts the same thing for both.
    Returns, per completed run, its CPU seconds per million example-products (the machine's speed as
    the run saw it), and the mean test ``E_sq`` of each method at the largest work every completed
    run reached, with their ratio (SHF / HF-CG).

    Args:
        runs: Per-step records of one experiment (``curvopt.analysis.records.load_runs``).
        profile: Which profile's completed runs to use.

    Returns:
        ``{"per_run": {run_id: {...}}, "common_work": W, "test_E_sq_at_common_work": {...}, "ratio": r}``.
    """
    need = {
        "optimizer",
        "run_id",
        "profile",
        "status",
        "step",
        "inner_iters",
        "batch_size",
        "test/E_sq",
        "algo_time_s",
    }
    none = {"per_run": {}, "common_work": None, "test_E_sq_at_common_work": {}, "ratio": None}
    if not need <= set(runs.columns):  # records without per-step work counts (older or hand-made)
        return none
    done = runs[(runs["profile"] == profile) & (runs["status"] == "completed")]
    per_run, curves = {}, {}
    for (method, run_id), run in done.groupby(["optimizer", "run_id"]):
        run = run[run["step"] > 0].sort_values("step")
        work = (run["inner_iters"].fillna(0) * run["batch_size"].fillna(0)).cumsum().to_numpy(float)
        ev = run["test/E_sq"].notna().to_numpy()
        if not ev.any() or work[-1] <= 0:
            continue
        cpu = float(run["algo_time_s"].max())
        per_run[run_id] = {
            "method": method,
            "work_example_products": float(work[-1]),
            "algo_time_s": cpu,
            "cpu_s_per_million_products": 1e6 * cpu / float(work[-1]),
        }
        curves.setdefault(method, []).append((work[ev], run["test/E_sq"].to_numpy(float)[ev]))
    if set(curves) != {"shf_lsmr", "hf_cg"}:
        return {**none, "per_run": per_run}
    common = min(w[-1] for cs in curves.values() for w, _ in cs)
    at = {m: float(np.mean([np.interp(common, w, e) for w, e in cs])) for m, cs in curves.items()}
    return {
        "per_run": per_run,
        "common_work": float(common),
        "test_E_sq_at_common_work": at,
        "ratio": at["shf_lsmr"] / at["hf_cg"],
    }
