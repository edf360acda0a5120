"""The report's "Cross-paper grid" section: every method on every task of experiments/cross, judged as the
papers judge (docs/cross.md), from the run records only.

Per task (``results/cross_<task>/``): the plan the driver recorded (``grid_<profile>.json``: which
methods apply and why the others do not, seeds, trials, budget) and the runs
``<method>_<profile>_s<seed>_<trial>``. Per method the trial is chosen on validation (the best
seed-mean of the best validation metric within the budget); its seeds then give:

* the best validation metric within the budget (mean over seeds, and the spread), the test metric at
  that evaluation where the task has a test split;
* the algorithm CPU time and the work to reach the task's shared target, the worst of the methods'
  best values among the methods that made at least half of the largest improvement over the initial
  value (:func:`shared_target`);
  ``not reached`` counts the seeds that did not;
* the work done within the budget; peak process memory. Work is counted in gradient-equivalent
  example evaluations (:func:`step_work`); peak process memory and the optimizer-state bytes the run
  recorded.

A method that does not apply to the task gets a row with the reason; a ranking per task orders the
methods by their best validation metric. ``python -m experiments.cross.report`` writes the table
(``results/tables/cross_grid_<profile>.md/.csv``) and one figure per task
(``results/figures/cross_<task>_<profile>.png``: validation metric vs CPU time and vs work);
``make report`` appends the section (:func:`append_section`).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

RUN_ID = re.compile(r"^(?P<method>[a-z0-9_]+?)_(?P<profile>quick|paper)_s(?P<seed>\d+)_(?P<trial>t\d+)$")
TITLE = "Cross-paper grid"
MAKE = "make reproduce-cross"
# inner curvature products per step: the column that counts them, per method
INNER = {"shf_lsmr": "inner_iters", "hf_cg": "inner_iters", "fgn": "cg_iters", "sgn": "cg_iters"}
FOSI = ("fosi_adam", "fosi_heavy_ball", "fosi_gd")


def _num(row: pd.Series | dict, key: str) -> float:
    value = row.get(key) if hasattr(row, "get") else None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0
    return 0.0 if math.isnan(value) else value


def step_work(row: pd.Series | dict, method: str, num_train: float = 0.0) -> float:
    """Work of one logged step, in gradient-equivalent example evaluations.

    One unit is one example through one gradient (forward and backward); a curvature-vector
    product on one example (an LSMR or CG iteration's J and Jᵀ products, a Lanczos iteration's
    Hessian-vector product, an FGN/SGN CG iteration) counts one unit too, as SHF's example-products
    do (experiments/shf/work.py). So: the step's gradient (``batch_size`` examples; HF-CG's is the
    full training set), plus inner iterations x curvature batch, plus FOSI's Lanczos iterations x
    batch on the steps that ran an ESE, plus K-FAC's sampled-target backward. Forward-only
    evaluations (line searches, SHF's merit and validation checks, L-BFGS's strong-Wolfe evaluations,
    which the records do not count) are left out: L-BFGS's work is a lower bound.

    Args:
        row: One metrics row (``batch_size``, ``inner_iters``, ``cg_iters``, ``lanczos_iters``,
            ``ese_ran``).
        method: The method's config name.
        num_train: The training-set size (HF-CG's gradient).

    Returns:
        The step's work (0 for an evaluation-only row).
    """
    batch = _num(row, "batch_size")
    if batch <= 0:
        return 0.0
    grad = num_train if method == "hf_cg" and num_train > 0 else batch
    work = grad
    if method in INNER:
        work += _num(row, INNER[method]) * batch
    if method in FOSI and _num(row, "ese_ran") > 0:
        work += _num(row, "lanczos_iters") * batch
    if method == "kfac":
        work += batch
    return work


def run_curve(frame: pd.DataFrame, method: str, metric: str, num_train: float = 0.0) -> pd.DataFrame:
    """One run's evaluations: ``step, time, work, value`` (and ``test`` when logged).

    Args:
        frame: The run's metrics rows (any order).
        method: Its method.
        metric: The validation metric (``val/loss``).
        num_train: The training-set size.

    Returns:
        One row per evaluation of ``metric``, in step order, with the cumulative algorithm time and
        work at that step.
    """
    if frame.empty or metric not in frame:
        return pd.DataFrame(columns=["step", "time", "work", "value", "test"])
    f = frame.sort_values("step", kind="stable").reset_index(drop=True)
    work = np.cumsum([step_work(r, method, num_train) for r in f.to_dict("records")])
    f = f.assign(_work=work)
    ev = f[f[metric].notna()]
    test_key = "test/" + metric.split("/", 1)[1]
    out = pd.DataFrame(
        {
            "step": ev["step"].to_numpy(int),
            "time": ev["algo_time_s"].astype(float).to_numpy() if "algo_time_s" in ev else np.nan,
            "work": ev["_work"].to_numpy(float),
            "value": pd.to_numeric(ev[metric], errors="coerce").to_numpy(float),
            "test": pd.to_numeric(ev[test_key], errors="coerce").to_numpy(float)
            if test_key in ev
            else np.nan,
        }
    )
    return out.groupby("step", as_index=False).last()


def _better(a: float, b: float, mode: str) -> bool:
    return a < b if mode == "min" else a > b


def within_budget(curve: pd.DataFrame, budget: float | None) -> pd.DataFrame:
    """The evaluations up to the first one at or past ``budget`` seconds, as the loop stops: after the
    step that reaches the budget (a run given a longer budget is so judged at the task's)."""
    if budget is None or curve.empty or not np.isfinite(budget):
        return curve
    past = np.flatnonzero(curve["time"].to_numpy(float) >= budget - 1e-9)
    return curve if not past.size else curve.iloc[: past[0] + 1]


def best_within(curve: pd.DataFrame, mode: str, budget: float | None = None) -> tuple[float, float]:
    """``(best value, test at that evaluation)`` among the evaluations within ``budget`` seconds
    (:func:`within_budget`).

    Non-finite values (a diverged run) never count as best; without any finite value: NaN.
    """
    c = within_budget(curve, budget)
    c = c[np.isfinite(c["value"].to_numpy(float))]
    if c.empty:
        return math.nan, math.nan
    i = c["value"].idxmin() if mode == "min" else c["value"].idxmax()
    return float(c.loc[i, "value"]), float(c.loc[i, "test"])


def first_reach(x: np.ndarray, values: np.ndarray, target: float, mode: str) -> float:
    """The first ``x`` (time or work) at which ``values`` reach ``target`` (``<=`` for min, ``>=``
    for max); NaN if never."""
    x, values = np.asarray(x, float), np.asarray(values, float)
    with np.errstate(invalid="ignore"):
        hit = values <= target if mode == "min" else values >= target
    idx = np.flatnonzero(hit & np.isfinite(values))
    return float(x[idx[0]]) if idx.size else math.nan


def shared_target(best: dict[str, float], initial: dict[str, float], mode: str, share: float = 0.5) -> float:
    """The task's target: the worst best value among the methods that made at least ``share`` of the
    largest improvement over the initial value (a method that hardly moved would make the target
    trivial for every other method; so the target is "the slowest method's best" among the methods
    that trained).

    Args:
        best: ``{method: seed-mean best value}``.
        initial: ``{method: seed-mean value at step 0}``.
        mode: ``min`` or ``max``.
        share: The fraction of the best method's improvement a method must reach to set the target.

    Returns:
        The target, NaN without any improving method.
    """
    gains = {}
    for m, v in best.items():
        v0 = initial.get(m, math.nan)
        if np.isfinite(v) and np.isfinite(v0):
            gains[m] = (v0 - v) if mode == "min" else (v - v0)
    top = max(gains.values(), default=math.nan)
    if not np.isfinite(top) or top <= 0:
        return math.nan
    kept = [best[m] for m, g in gains.items() if g > 0 and g >= share * top]
    return max(kept) if mode == "min" else min(kept)


def select_trial(per_trial: dict[str, list[float]], mode: str) -> str | None:
    """The trial with the best seed-mean best validation value (a trial with a non-finite seed
    counts as worse than any finite one)."""
    scored = []
    for trial, values in per_trial.items():
        vals = np.asarray(values, float)
        score = float(vals.mean()) if vals.size and np.isfinite(vals).all() else math.nan
        scored.append((trial, score))
    finite = [(t, s) for t, s in scored if np.isfinite(s)]
    if not finite:
        return sorted(per_trial)[0] if per_trial else None
    return (min if mode == "min" else max)(finite, key=lambda ts: ts[1])[0]


def load_plans(results: Path, profile: str) -> dict[str, dict]:
    """``{task: plan}`` from ``results/cross_*/grid_<profile>.json``, in the drivers' task order."""
    order = ["usps", "lr", "lm", "llm"]
    plans = {}
    for path in sorted(Path(results).glob(f"cross_*/grid_{profile}.json")):
        plan = json.loads(path.read_text())
        plans[plan["task"]] = plan
    return dict(sorted(plans.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99))


def load_task_runs(results: Path, plan: dict) -> list[dict]:
    """Every run of the plan's experiment at its profile: method, seed, trial, status, its curve and
    summary numbers."""
    from curvopt.analysis.records import load_runs, load_summaries

    exp = plan["experiment"]
    sums = load_summaries(results, exp)
    if sums.empty:
        return []
    frames = load_runs(results, exp)
    out = []
    for _, s in sums.iterrows():
        m = RUN_ID.match(str(s["run_id"]))
        if not m or m["profile"] != plan["profile"]:
            continue
        method = m["method"]
        if s.get("status") not in ("completed", "diverged"):
            continue  # running, killed or failed: no finished record to judge
        if int(m["seed"]) not in plan.get("seeds", [int(m["seed"])]) or m["trial"] not in plan.get(
            "trials", [m["trial"]]
        ):
            continue  # outside the plan (a trial or seed another profile setting ran): not judged
        frame = frames[frames["run_id"] == s["run_id"]] if not frames.empty else pd.DataFrame()
        num_train = _num(s, "cfg.dataset.num_train")
        curve = within_budget(run_curve(frame, method, plan["metric"], num_train), plan.get("budget_s"))
        out.append(
            {
                "run_id": s["run_id"],
                "method": method,
                "seed": int(m["seed"]),
                "trial": m["trial"],
                "status": s.get("status"),
                "curve": curve,
                "steps": float(curve["step"].max()) if not curve.empty else _num(s, "steps"),
                "algo_time_s": _num(s, "algo_time_s"),
                "peak_mem_bytes": _num(s, "peak_mem_bytes"),
                "state_bytes": s.get("optimizer_state_bytes"),  # None: not recorded
            }
        )
    return out


def _fmt(x: float, digits: int = 4) -> str:
    if x is None or not np.isfinite(x):
        return "–"
    if abs(x) >= 1e5 or (0 < abs(x) < 1e-3):
        return f"{x:.2e}"
    return f"{x:.{digits}g}"


def task_table(plan: dict, runs: list[dict]) -> tuple[pd.DataFrame, dict]:
    """The task's rows (one per method of the plan, applicable or not) and its summary.

    Args:
        plan: The driver's plan for the task.
        runs: :func:`load_task_runs`'s records (hand-made ones in the tests).

    Returns:
        ``(rows, info)``: ``rows`` has the report's columns; ``info`` holds ``target``, the chosen
        trial per method, the seeds seen and whether every planned run finished.
    """
    mode, budget = plan["mode"], float(plan.get("budget_s") or math.inf)
    by_method: dict[str, list[dict]] = {}
    for r in runs:
        by_method.setdefault(r["method"], []).append(r)
    chosen, best, initial = {}, {}, {}
    for method, rs in by_method.items():
        per_trial: dict[str, list[float]] = {}
        for r in rs:
            per_trial.setdefault(r["trial"], []).append(best_within(r["curve"], mode, budget)[0])
        chosen[method] = select_trial(per_trial, mode)
        sel = [r for r in rs if r["trial"] == chosen[method]]
        vals = [best_within(r["curve"], mode, budget)[0] for r in sel]
        best[method] = float(np.mean(vals)) if vals and np.isfinite(vals).all() else math.nan
        inits = [float(r["curve"]["value"].iloc[0]) for r in sel if not r["curve"].empty]
        initial[method] = float(np.mean(inits)) if inits else math.nan
    target = shared_target(best, initial, mode)
    rows = []
    for method, entry in plan["methods"].items():
        from experiments.cross.tasks import LABELS, TUNED

        label = LABELS.get(method, method)
        if not entry.get("applies", False):
            rows.append({"method": label, "_key": method, "applies": "no: " + entry.get("reason", "")})
            continue
        sel = [r for r in by_method.get(method, []) if r["trial"] == chosen.get(method)]
        if not sel:
            rows.append({"method": label, "_key": method, "applies": "yes", "trial": "not run"})
            continue
        trials = entry.get("trials", {})
        bv = np.array([best_within(r["curve"], mode, budget)[0] for r in sel])
        tv = np.array([best_within(r["curve"], mode, budget)[1] for r in sel])
        tt = np.array([first_reach(r["curve"]["time"], r["curve"]["value"], target, mode) for r in sel])
        tw = np.array([first_reach(r["curve"]["work"], r["curve"]["value"], target, mode) for r in sel])
        wk = np.array([float(r["curve"]["work"].max()) if not r["curve"].empty else math.nan for r in sel])
        statuses = sorted({str(r["status"]) for r in sel})
        reached = np.isfinite(tt)
        rows.append(
            {
                "method": label,
                "_key": method,
                "applies": "yes",
                "trial": f"{chosen[method]}: {TUNED.get(method, '?')}={trials.get(chosen[method], '?')}",
                "seeds": str(len(sel)),
                "best val": _fmt(float(np.mean(bv))) if np.isfinite(bv).all() else "diverged",
                "± sd": _fmt(float(np.std(bv))) if len(bv) > 1 and np.isfinite(bv).all() else "–",
                "test at best val": _fmt(float(np.nanmean(tv))) if np.isfinite(tv).any() else "–",
                "CPU-s to target": _fmt(float(np.mean(tt[reached])), 3) if reached.any() else "not reached",
                "work to target": _fmt(float(np.mean(tw[reached])), 3) if reached.any() else "not reached",
                "reached": f"{int(reached.sum())}/{len(sel)}",
                "work in budget": _fmt(float(np.nanmean(wk)), 3),
                "steps": str(int(np.mean([r["steps"] for r in sel]))),
                "peak MiB": _fmt(float(np.mean([r["peak_mem_bytes"] for r in sel])) / 2**20, 4),
                "state KiB": _state_kib(sel),
                "status": ",".join(statuses),
                "_best": float(np.mean(bv)) if np.isfinite(bv).all() else math.nan,
            }
        )
    frame = pd.DataFrame(rows)
    if "_best" in frame:
        ranked = frame["_best"].rank(ascending=(mode == "min"), method="min")
        frame["rank"] = [str(int(r)) if np.isfinite(r) else "–" for r in ranked]
    seeds = sorted({r["seed"] for r in runs})
    planned = {
        (m, s, t)
        for m, e in plan["methods"].items()
        if e.get("applies")
        for s in plan.get("seeds", [])
        for t in plan.get("trials", [])
    }
    done = {(r["method"], r["seed"], r["trial"]) for r in runs if r["status"] in ("completed", "diverged")}
    info = {
        "target": target,
        "chosen": chosen,
        "seeds": seeds,
        "complete": planned <= done,
        "missing": len(planned - done),
    }
    return frame, info


COLUMNS = [
    "rank",
    "method",
    "applies",
    "trial",
    "seeds",
    "best val",
    "± sd",
    "test at best val",
    "CPU-s to target",
    "work to target",
    "reached",
    "work in budget",
    "steps",
    "peak MiB",
    "state KiB",
    "status",
]


def _state_kib(sel: list[dict]) -> str:
    """The seed-mean optimizer state in KiB, or 'not recorded' (summaries before it was logged)."""
    values = [r.get("state_bytes") for r in sel]
    if any(v is None or not np.isfinite(v) for v in values):
        return "not recorded"
    return _fmt(float(np.mean(values)) / 1024, 4)


def _ordered(frame: pd.DataFrame) -> pd.DataFrame:
    """Applicable methods by rank, then those without a record, then the ones that do not apply; only the
    report's columns, gaps as ``–``."""
    if frame.empty:
        return frame
    f = frame.copy()
    rank = pd.to_numeric(f["rank"], errors="coerce") if "rank" in f else pd.Series(math.nan, index=f.index)
    f["_order"] = [
        0 if np.isfinite(r) else 1 if a == "yes" else 2 for r, a in zip(rank, f["applies"], strict=True)
    ]
    f["_r"] = rank
    f = f.sort_values(["_order", "_r"], kind="stable")
    cols = [c for c in COLUMNS if c in f]
    return f[cols].astype(object).where(f[cols].notna(), "–").astype(str).replace({"nan": "–"})


def _label(plan: dict, info: dict) -> str:
    n = len(info["seeds"])
    return f"{plan['profile']} profile, CPU, {n} seed{'s' if n != 1 else ''}"


def task_figure(plan: dict, runs: list[dict], info: dict, out: Path) -> Path | None:
    """Validation metric vs CPU time and vs work, one line per method (its chosen trial, each seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from experiments.cross.tasks import LABELS, METHODS
    from experiments.plots.common import save_with_csv

    sel = [r for r in runs if info["chosen"].get(r["method"]) == r["trial"] and not r["curve"].empty]
    if not sel:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    cmap = plt.get_cmap("tab10")
    series = []
    for i, method in enumerate(METHODS):
        rs = [r for r in sel if r["method"] == method]
        for j, r in enumerate(sorted(rs, key=lambda r: r["seed"])):
            c = r["curve"]
            kw = {
                "color": cmap(i % 10),
                "ls": "-" if i < 10 else "--",
                "lw": 1.3,
                "alpha": 0.9,
                "label": LABELS[method] if j == 0 else None,
            }
            axes[0].plot(c["time"], c["value"], **kw)
            w = c[c["work"] > 0]  # the log axis starts at the first evaluation after a step
            axes[1].plot(w["work"], w["value"], **kw)
            series.append(c.assign(method=method, seed=r["seed"], trial=r["trial"]))
    target = info.get("target", math.nan)
    for ax, xl in zip(
        axes,
        ("algorithm CPU seconds (one thread)", "work (gradient-equivalent example evaluations)"),
        strict=True,
    ):
        if np.isfinite(target):
            ax.axhline(target, color="k", ls=":", lw=1, label="shared target")
        ax.set_xlabel(xl)
        ax.set_ylabel(plan["metric"])
        ax.grid(alpha=0.3)
        if plan["mode"] == "min":
            vals = np.concatenate([r["curve"]["value"].to_numpy(float) for r in sel])
            vals = vals[np.isfinite(vals)]
            if vals.size and vals.max() / max(vals.min(), 1e-12) > 20 and vals.min() > 0:
                ax.set_yscale("log")
    bests = [best_within(r["curve"], plan["mode"])[0] for r in sel]
    bests = [b for b in bests if np.isfinite(b)]
    if np.isfinite(target) and bests:  # zoom on the range between the target and the best value
        top = min(bests) if plan["mode"] == "min" else max(bests)
        gap = abs(top - target)
        if gap > 0:
            lo, hi = (
                (top - 0.3 * gap, target + 3 * gap)
                if plan["mode"] == "min"
                else (target - 3 * gap, top + 0.3 * gap)
            )
            for ax in axes:
                cur = ax.get_ylim()
                ax.set_ylim(max(lo, cur[0]), min(hi, cur[1]))
    axes[1].set_xscale("log")
    axes[1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # no crowded minor labels
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(
        f"Cross-paper grid: {plan['title']} ({plan['paper']}) — {_label(plan, info)}, "
        f"{plan.get('budget_s', '?'):g} CPU-s per run, chosen trial per method"
    )
    fig.tight_layout()
    return save_with_csv(fig, out, series)


def build(
    results: Path, profile: str = "quick", figures: bool = True
) -> tuple[str, list[tuple[str, pd.DataFrame, list[str]]], list[Path]]:
    """Evaluate every task: ``(note, [(heading, table, notes)], figure paths)``."""
    results = Path(results)
    plans = load_plans(results, profile)
    parts, figs = [], []
    for key, plan in plans.items():
        runs = load_task_runs(results, plan)
        frame, info = task_table(plan, runs)
        rank_line = (
            " > ".join(
                f"{r['method']}"
                for _, r in frame.sort_values("_best", ascending=plan["mode"] == "min").iterrows()
                if "_best" in frame and np.isfinite(r.get("_best", math.nan))
            )
            if "_best" in frame
            else ""
        )
        notes = [
            f"{_label(plan, info)}; {plan.get('budget_s', 0):g} CPU-s per run (process clock, one torch thread); "
            f"{len(plan.get('trials', []))} trials per method ({', '.join(plan.get('trials', []))}: t0 = the method's "
            f"paper default), chosen on validation ({plan['metric']}, {plan['mode']})",
            f"shared target: {plan['metric']} = {_fmt(info['target'])} (the worst best value among the methods "
            "with at least half of the largest improvement over the initial value)",
        ]
        if rank_line:
            notes.append(f"ranking by best validation {plan['metric']}: {rank_line}")
        if not info["complete"]:
            notes.append(f"in progress: {info['missing']} planned run(s) without a finished record")
        fig_path = None
        if figures:
            fig_path = task_figure(plan, runs, info, results / "figures" / f"cross_{key}_{profile}.png")
            if fig_path is not None:
                figs.append(fig_path)
        parts.append(
            (f"{plan['title']} ({plan['paper']}, `{plan['experiment']}`)", _ordered(frame), notes, fig_path)
        )
    note = (
        "Every method on every paper's task that fits the CPU, from one Hydra multirun per task "
        f"(`{MAKE}`; docs/cross.md). Equal algorithm CPU-time budget per run within a task, each method's "
        "paper defaults plus the same number of trials of its one tuned hyper-parameter, the trial chosen on "
        "validation. Work = gradient-equivalent example evaluations (a curvature-vector product on one "
        "example counts as one gradient; forward-only line-search evaluations are not counted, so L-BFGS's "
        "work is a lower bound). Peak MiB is the process's peak memory (data included); state KiB the optimizer "
        "state the run kept between steps (its summary's optimizer_state_bytes; 'not recorded' for records made "
        "before it was logged). A method that does not apply says why. Quick-profile numbers are short "
        "CPU runs: they rank the methods at this budget, not at the papers' scale."
    )
    return note, parts, figs


def _md_table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "(no rows)"
    head = "| " + " | ".join(frame.columns) + " |"
    sep = "|" + "|".join("---" for _ in frame.columns) + "|"
    body = [
        "| " + " | ".join(str(v).replace("|", "/") for v in row) + " |"
        for row in frame.itertuples(index=False)
    ]
    return "\n".join([head, sep, *body])


def section_markdown(
    results: Path, profile: str = "quick", link_from: Path | None = None, figures: bool = True
) -> str:
    """The section as Markdown (figures linked relative to ``link_from``, default ``results``)."""
    import os

    note, parts, _ = build(results, profile, figures)
    lines = [f"## {TITLE}", "", note, ""]
    if not parts:
        lines += [f"not run: `{MAKE}`", ""]
    for heading, frame, notes, fig in parts:
        lines += [f"### {heading}", "", _md_table(frame), ""]
        lines += [f"- {n}" for n in notes] + [""]
        if fig is not None:
            rel = os.path.relpath(fig, link_from or results)
            lines += [f"![{heading}]({rel})", ""]
    lines.append(
        f"<sub>Regenerate: `{MAKE}` (records) or `make cross-figures` (table and figures only)</sub>\n"
    )
    return "\n".join(lines)


def section_html(results: Path, profile: str = "quick") -> str:
    """The section as HTML (figures embedded); drawn from the figures :func:`section_markdown` wrote."""
    import base64

    note, parts, _ = build(results, profile, figures=False)
    out = [f"<h2>{TITLE}</h2>", f"<p>{html.escape(note)}</p>"]
    if not parts:
        out.append(f"<p>not run: <code>{MAKE}</code></p>")
    for heading, frame, notes, _ in parts:
        out.append(f"<h3>{html.escape(heading)}</h3>")
        if not frame.empty:
            head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
            body = "".join(
                "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
                for row in frame.itertuples(index=False)
            )
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        out.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
        key = heading.split("`cross_")[-1].rstrip("`)") if "`cross_" in heading else None
        fig = Path(results) / "figures" / f"cross_{key}_{profile}.png" if key else None
        if fig is not None and fig.exists():
            data = base64.b64encode(fig.read_bytes()).decode()
            out.append(f"<p><img alt='{html.escape(heading)}' src='data:image/png;base64,{data}'></p>")
    return "\n".join(out)


def append_section(results: Path, out_md: Path, out_html: Path | None = None, profile: str = "quick") -> None:
    """Append the section to a written report (``make report``; one call in experiments/report/build.py).

    Never raises: a failure becomes a line in the section, as the report's items do.
    """
    try:
        md = section_markdown(Path(results), profile, link_from=Path(out_md).parent)
        page = section_html(Path(results), profile) if out_html is not None else ""
    except Exception as err:  # the report never crashes on one section
        md = f"## {TITLE}\n\nerror: {type(err).__name__}: {err}\n"
        page = f"<h2>{TITLE}</h2><p>error: {html.escape(f'{type(err).__name__}: {err}')}</p>"
    out_md = Path(out_md)
    if out_md.exists():
        out_md.write_text(out_md.read_text().rstrip("\n") + "\n\n" + md)
    if out_html is not None and Path(out_html).exists():
        text = Path(out_html).read_text()
        tail = "</body></html>"
        text = text.replace(tail, page + "\n" + tail) if tail in text else text + page
        Path(out_html).write_text(text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", type=Path, default=Path("results"))
    p.add_argument("--profile", default="quick", choices=["quick", "paper"])
    args = p.parse_args(argv)
    md = section_markdown(args.results_dir, args.profile, link_from=args.results_dir / "tables")
    tables = args.results_dir / "tables"
    tables.mkdir(parents=True, exist_ok=True)
    (tables / f"cross_grid_{args.profile}.md").write_text(md)
    _, parts, figs = build(args.results_dir, args.profile, figures=False)
    if parts:
        pd.concat([f.assign(task=h) for h, f, _, _ in parts], ignore_index=True).to_csv(
            tables / f"cross_grid_{args.profile}.csv", index=False
        )
    print(md)
    print(
        f"wrote {tables / f'cross_grid_{args.profile}.md'} (.csv) and the figures results/figures/cross_*_{args.profile}.png"
    )


if __name__ == "__main__":
    main()
