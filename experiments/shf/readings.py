"""SHF-LSMR readings side by side: each ambiguous place of the paper, run, and judged on its claims.

A *reading* is a set of flag values (docs/decisions.md SHF-2, SHF-4, SHF-8, SHF-27, ...) that differ
from the default. Its runs are the default experiment's runs (``results/shf_fig2_<dataset>``) and the
audit runs (``results/shf_audit/shf_fig2_<dataset>``); each run is labelled by the flags its recorded
config sets differently from the default runs' config, so no file name has to be trusted.

Each reading is judged on the paper's own claims (Section 4.3, Figure 3, Table 2):

- test f at the best-validation iterate (Table 2) and at equal training error (the first evaluated
  iterate whose train f is at or below the paper's, 0.999 on USPS);
- SHF / HF-CG test f, against the HF-CG runs of the same table;
- the batch-size trajectory: share of run time before the largest batch, n at 25/50/75 % of the
  run time, the time-averaged batch, and whether the growth is *gradual* (:func:`gradual_growth`);
- the largest batch (the memory the paper says is saved) and the CPU time.

``python -m experiments.shf.readings --dataset usps`` writes
``results/shf_audit/readings_<dataset>_<profile>.{json,md}``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from curvopt.analysis.pack import read_packed_runs
from curvopt.analysis.records import load_runs, load_summaries

# Flags whose values define a reading (optimizer and model keys, flattened as in load_summaries).
READING_KEYS = (
    "cfg.optimizer.variance_gradients",
    "cfg.optimizer.variance_norm_power",
    "cfg.optimizer.damping_center",
    "cfg.optimizer.step_space",
    "cfg.optimizer.warm_start",
    "cfg.optimizer.return_best",
    "cfg.optimizer.precon_sqrt",
    "cfg.optimizer.drop",
    "cfg.optimizer.damping",
    "cfg.optimizer.theta",
    "cfg.optimizer.stall_window",
    "cfg.optimizer.weight_cost",
    "cfg.optimizer.initlambda",
    "cfg.model.code_activation",
    "cfg.model.output_activation",
    "cfg.model.loss",
    "cfg.model.sparse_init_count",
    "cfg.model.sparse_init_std",
    "cfg.trainer.dtype",
    "cfg.trainer.max_steps",  # a truncated probe reads as its own row
    "cfg.trainer.patience_evals",  # HF-CG stopped by SHF's patience rule instead of 500 iterations
)
PROBE_STEP = 150  # every reading's test f is also compared at this outer iteration (truncated probes)
# The paper's Table 2 (experiments/shf/paper_table2.csv, the one copy): per dataset and method, train
# and test f. SHF's train f is the "equal training error" level; each row's "vs paper" compares with its
# own method's test f.
_PAPER = pd.read_csv(Path(__file__).with_name("paper_table2.csv")).set_index(["dataset", "method"])
PAPER_TRAIN_F = {d: float(_PAPER.loc[(d, "shf_lsmr"), "train_error"]) for d in ("usps", "mnist", "curves")}
PAPER_TEST_F = {d: float(_PAPER.loc[(d, "shf_lsmr"), "test_error"]) for d in ("usps", "mnist", "curves")}
PAPER_HF_TEST_F = {d: float(_PAPER.loc[(d, "hf_cg"), "test_error"]) for d in ("usps", "mnist", "curves")}
# Gradual growth (docs/decisions.md SHF-28): by 25 % of the run time the batch has made less than half
# of its growth, it grows by at least half of n_1, and its time average is at most half of n_max.
GROWTH_EARLY_SHARE = 0.25
GROWTH_MIN_FACTOR = 1.5
GROWTH_MEAN_SHARE = 0.5


_NAN = object()  # a flattened key that a record does not have (pandas fills it with NaN)

# The two autoencoder networks HF-CG is run on (docs/decisions.md SHF-16), told apart by the loss.
NETWORKS = {
    "shf": "SHF's network (logistic code and output layers, squared error, no weight cost)",
    "martens": "Martens' network (linear code layer, cross-entropy, weight cost 2e-5)",
}


def network_of(loss: Any) -> str:
    """``"shf"`` for a run whose recorded ``model.loss`` is the squared error, else ``"martens"``."""
    return "shf" if loss == "squared_error" else "martens"


def _value(v: Any) -> Any:
    """NaN (pandas' missing) as None."""
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


# What a record made before a flag existed ran with, where the flag's default has changed since
# (the constructor default is the right fill for every other flag). damping_center: records older
# than the flag ran warm_start, the default until docs/decisions.md SHF-4 changed it to zero.
RECORD_DEFAULTS: dict[str, dict[str, Any]] = {"shf_lsmr": {"cfg.optimizer.damping_center": "warm_start"}}


def _code_defaults(method: str) -> dict[str, Any]:
    """What a record without a flag ran with, as flattened config keys: the optimizer's constructor
    defaults, overridden by :data:`RECORD_DEFAULTS` for flags whose default has changed since."""
    from curvopt.optim.hf_cg import HFCG
    from curvopt.optim.shf import SHF

    cls = {"shf_lsmr": SHF, "hf_cg": HFCG}.get(method)
    if cls is None:
        return {}
    defaults = {
        f"cfg.optimizer.{k}": p.default
        for k, p in inspect.signature(cls).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return {**defaults, **RECORD_DEFAULTS.get(method, {})}


def reading_label(cfg: dict[str, Any], base: dict[str, Any], method: str | None = None) -> str:
    """The flags of ``cfg`` that differ from ``base``, as ``key=value`` joined by ``, ``.

    A flag missing from a record (one made before the flag existed) takes what that run used: the
    optimizer's constructor default, or the older default in :data:`RECORD_DEFAULTS`.

    Args:
        cfg: One run's flattened config (``cfg.optimizer.…`` keys).
        base: The default runs' flattened config.
        method: ``shf_lsmr`` or ``hf_cg``, for the constructor defaults.

    Returns:
        ``"default"`` when nothing differs.

    Example:
        >>> reading_label({"cfg.optimizer.damping_center": "zero"}, {"cfg.optimizer.damping_center": "warm_start"})
        'damping_center=zero'
    """
    fill = _code_defaults(method) if method else {}

    def get(d: dict[str, Any], key: str) -> Any:
        # a key this record does not have (NaN in a frame row) takes the constructor default;
        # None is a YAML null and a value of its own
        v = d.get(key, _NAN)
        if isinstance(v, float) and math.isnan(v):
            v = _NAN
        return fill.get(key, _NAN) if v is _NAN else v

    diffs = []
    for key in READING_KEYS:
        a, b = get(cfg, key), get(base, key)
        if a is not _NAN and a != b:
            diffs.append(f"{key.split('.')[-1]}={a}")
    return ", ".join(diffs) or "default"


def batch_at_shares(t: np.ndarray, b: np.ndarray, shares=(0.25, 0.5, 0.75)) -> list[float]:
    """The batch size in use at the given shares of the run's time (step function of time)."""
    out = []
    for s in shares:
        idx = int(np.searchsorted(t, s * t[-1], side="right")) - 1
        out.append(float(b[max(idx, 0)]))
    return out


def time_mean_batch(t: np.ndarray, b: np.ndarray) -> float:
    """Time-weighted mean batch size: each step's batch weighted by the time that step took."""
    dt = np.diff(np.concatenate([[0.0], t]))
    return float((dt * b).sum() / dt.sum()) if dt.sum() > 0 else float(b.mean())


def gradual_growth(t: np.ndarray, b: np.ndarray, n_max: float) -> dict[str, Any]:
    """Does the mini-batch grow *gradually* (paper Section 4.3, Figure 3), not jump?

    Section 4.3: the size "increases ... throughout the progression of the algorithm"; Section 6:
    "we gradually increase the mini-batch size to save time and memory ... our approach uses
    significantly less memory" than Martens' fixed batch (N/numchunks, n_max on USPS). So the growth
    must (i) happen at all (final ≥ ``GROWTH_MIN_FACTOR``·n₁), (ii) not be front-loaded (at
    ``GROWTH_EARLY_SHARE`` of the run time less than half of the growth is done) and (iii) leave the
    time-averaged batch at most ``GROWTH_MEAN_SHARE``·n_max. A jump to n_max at t ≈ 0 fails (ii) and
    (iii); a batch that never grows fails (i).

    Args:
        t: Algorithm time at each step (increasing).
        b: Batch size used at each step.
        n_max: The batch-size cap.

    Returns:
        The three checks, their inputs and ``ok`` (all three).

    Example:
        >>> import numpy as np
        >>> t = np.arange(1.0, 101.0)
        >>> gradual_growth(t, np.where(t < 2, 200.0, 2000.0), 2000)["ok"]   # a jump at t ≈ 0
        False
        >>> gradual_growth(t, np.linspace(200, 1500, 100), 2000)["ok"]       # steady growth
        True
    """
    t, b = np.asarray(t, float), np.asarray(b, float)
    n1, nend = float(b[0]), float(b[-1])
    n_quarter = batch_at_shares(t, b, (GROWTH_EARLY_SHARE,))[0]
    mean_b = time_mean_batch(t, b)
    grows = nend >= GROWTH_MIN_FACTOR * n1
    not_front_loaded = (n_quarter - n1) < 0.5 * (nend - n1) if nend > n1 else False
    small_on_average = mean_b <= GROWTH_MEAN_SHARE * n_max
    return {
        "grows": bool(grows),
        "not_front_loaded": bool(not_front_loaded),
        "small_on_average": bool(small_on_average),
        "time_mean_batch": mean_b,
        "ok": bool(grows and not_front_loaded and small_on_average),
    }


def run_row(
    frame: pd.DataFrame, summary: dict[str, Any], dataset: str, n_max: float | None
) -> dict[str, Any]:
    """One run's numbers for the readings table.

    Args:
        frame: The run's metric rows (``load_runs`` rows of this run).
        summary: Its flattened summary (``load_summaries`` row).
        dataset: ``usps``, ``mnist`` or ``curves``.
        n_max: SHF's batch cap (``None`` for HF-CG).

    Returns:
        ``{"test_f_best_val", "train_f_best_val", "test_f_equal_train", "iterations", "cpu_s", ...}``.
    """
    f = frame.sort_values("step")
    ev = f.dropna(subset=["train/f", "test/f"])
    target = PAPER_TRAIN_F[dataset]
    hit = ev[ev["train/f"] <= target]
    row: dict[str, Any] = {
        "run_id": summary["run_id"],
        "seed": int(summary["cfg.seed"]),
        "status": summary.get("status"),
        "iterations": int(f["step"].max()),
        "cpu_s": float(f["algo_time_s"].max()),
        "train_f_best_val": _value(summary.get("best.metrics.train/f")),
        "test_f_best_val": _value(summary.get("best.metrics.test/f")),
        "best_val_step": _value(summary.get("best.step")),
        "test_f_equal_train": float(hit["test/f"].iloc[0]) if len(hit) else None,
        "min_train_f": float(ev["train/f"].min()) if len(ev) else None,
    }
    at = ev[ev["step"] == PROBE_STEP]
    row[f"test_f_it{PROBE_STEP}"] = float(at["test/f"].iloc[0]) if len(at) else None
    row[f"cpu_s_it{PROBE_STEP}"] = float(at["algo_time_s"].iloc[0]) if len(at) else None
    steps = f.dropna(subset=["batch_size"]) if "batch_size" in f else f.iloc[0:0]
    if n_max is not None and len(steps) > 1:
        t = steps["algo_time_s"].to_numpy(float)
        b = steps["batch_size"].to_numpy(float)
        first_peak = t[int(np.argmax(b >= b.max()))]
        n25, n50, n75 = batch_at_shares(t, b)
        growth = gradual_growth(t, b, n_max)
        row.update(
            {
                "peak_batch": float(b.max()),
                "share_before_peak": float(first_peak / t[-1]) if t[-1] > 0 else None,
                "n_25": n25,
                "n_50": n50,
                "n_75": n75,
                "time_mean_batch": growth["time_mean_batch"],
                "gradual": growth["ok"],
            }
        )
        if "damping" in steps:
            row["lambda_last"] = float(steps["damping"].iloc[-1])
        if "rho" in steps:
            rho = steps["rho"].replace([np.inf, -np.inf], np.nan).dropna()
            row["rho_p10"], row["rho_p90"] = (
                (float(rho.quantile(0.1)), float(rho.quantile(0.9))) if len(rho) else (None, None)
            )
        if "batch_rule" in steps:
            rule = steps["batch_rule"].value_counts()
            row["stall_steps"] = int(rule.get("stall", 0))
            row["variance_steps"] = int(rule.get("variance", 0))
    return row


def _config(summary_row: pd.Series) -> dict[str, Any]:
    """A run's flattened config, read from its ``config.yaml`` when it has one (a frame row turns a
    YAML null into NaN, which would read as "not recorded")."""
    run_dir = Path(str(summary_row.get("run_dir", "")))
    path = run_dir / "config.yaml"
    packed = {r["run_id"]: r for r in read_packed_runs(run_dir.parent)}
    if path.is_file():
        config = yaml.safe_load(path.read_text())
    elif run_dir.name in packed and packed[run_dir.name].get("config") is not None:
        config = packed[run_dir.name]["config"]  # a packed run keeps its parsed config
    else:
        return summary_row.to_dict()
    flat: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}", x)
        else:
            flat[prefix] = v

    walk("cfg", config)
    return flat


def collect(results: Path, dataset: str, profile: str = "paper") -> pd.DataFrame:
    """Every run of ``dataset`` at ``profile``, default and audit, with its reading label.

    Args:
        results: The results root.
        dataset: ``usps``, ``mnist`` or ``curves``.
        profile: The profile to keep.

    Returns:
        One row per run (:func:`run_row` plus ``method`` and ``reading``).
    """
    exp = f"shf_fig2_{dataset}"
    sources = [(results, "default experiment"), (results / "shf_audit", "audit")]
    sums = {src: load_summaries(root, exp) for root, src in sources}
    base: dict[str, dict[str, Any]] = {}
    default = sums["default experiment"]
    for method in ("shf_lsmr", "hf_cg"):
        if default.empty or "cfg.optimizer.name" not in default:
            continue
        part = default[(default["cfg.optimizer.name"] == method) & (default["cfg.profile"] == profile)]
        if len(part):
            base[method] = _config(part.iloc[0])
    rows = []
    for root, src in sources:
        s = sums[src]
        if s.empty or "cfg.optimizer.name" not in s:
            continue
        s = s[s["cfg.profile"] == profile]
        runs = load_runs(root, exp)
        for _, summ in s.iterrows():
            method = summ["cfg.optimizer.name"]
            if method not in base:
                continue
            frame = runs[runs["run_id"] == summ["run_id"]]
            if frame.empty:
                continue
            n_max = summ.get("cfg.optimizer.max_batch_size") if method == "shf_lsmr" else None
            if n_max is not None:
                n_max = min(float(n_max), float(summ.get("cfg.dataset.num_train", n_max)))
            row = run_row(frame, summ.to_dict(), dataset, n_max)
            cfg = _config(summ)
            row.update(method=method, reading=reading_label(cfg, base[method], method), source=src)
            row["network"] = network_of(cfg.get("cfg.model.loss"))
            rows.append(row)
    return pd.DataFrame(rows)


def readings_table(runs: pd.DataFrame, dataset: str) -> pd.DataFrame:
    """Mean over seeds per (method, reading); SHF / HF-CG against the default HF-CG (``vs_hf_cg``) and
    against HF-CG on each network (``vs_hf_cg_same_net``: SHF's, squared error; ``vs_hf_cg_martens_net``:
    Martens', cross-entropy), each the completed reading of that network with the most seeds. Completed runs are averaged; a run interrupted with a checkpoint gets
    a row of its own, marked ``[in progress: N it]``, with its numbers so far.

    Args:
        runs: :func:`collect`'s frame.
        dataset: For the paper's values.

    Returns:
        One row per (method, reading) with ``seeds``, means (and sample std of the Table-2 test f).
    """
    if runs.empty:
        return pd.DataFrame()
    runs = runs.copy()
    # a run still in progress (interrupted with a checkpoint) is shown on a row of its own, never mixed
    # into a finished reading's mean
    live = runs["status"] != "completed"
    runs.loc[live, "reading"] = (
        runs.loc[live, "reading"] + " [in progress: " + runs.loc[live, "iterations"].astype(str) + " it]"
    )
    done = runs[runs["status"].isin(["completed", "interrupted"])]
    hf = done[(done["method"] == "hf_cg") & (done["reading"] == "default")]
    hf_test = float(hf["test_f_best_val"].mean()) if len(hf) else math.nan
    # HF-CG on each network (SHF's own, as the paper's authors used on USPS, and Martens'): the
    # completed reading of that network with the most seeds
    finished = runs[(runs["method"] == "hf_cg") & (runs["status"] == "completed")]
    net_test: dict[str, float] = {}
    if "network" in finished:
        for net, g in finished.groupby("network"):
            counts = g.groupby("reading")["seed"].nunique()
            top = counts[counts == counts.max()].index
            ref = "default" if "default" in top else sorted(top)[0]
            net_test[net] = float(g.loc[g["reading"] == ref, "test_f_best_val"].mean())
    same_test, martens_test = net_test.get("shf", math.nan), net_test.get("martens", math.nan)
    out = []
    for (method, reading), g in done.groupby(["method", "reading"], sort=False):
        row: dict[str, Any] = {"method": method, "reading": reading, "seeds": int(g["seed"].nunique())}
        for col in g.columns:
            if col in {"method", "reading", "run_id", "status", "source", "seed"}:
                continue
            vals = pd.to_numeric(g[col], errors="coerce")
            if vals.notna().any():
                row[col] = float(vals.mean())
        t = g["test_f_best_val"].astype(float)
        row["test_f_best_val_std"] = float(t.std(ddof=1)) if len(t) > 1 else None
        paper = PAPER_HF_TEST_F[dataset] if method == "hf_cg" else PAPER_TEST_F[dataset]
        row["vs_paper"] = row["test_f_best_val"] / paper - 1
        row["vs_hf_cg"] = row["test_f_best_val"] / hf_test if math.isfinite(hf_test) else None
        row["vs_hf_cg_same_net"] = row["test_f_best_val"] / same_test if math.isfinite(same_test) else None
        row["vs_hf_cg_martens_net"] = (
            row["test_f_best_val"] / martens_test if math.isfinite(martens_test) else None
        )
        if "gradual" in g and g["gradual"].notna().any():
            row["gradual"] = f"{int(g['gradual'].astype(bool).sum())}/{len(g)}"
        out.append(row)
    return pd.DataFrame(out)


def to_markdown(table: pd.DataFrame, dataset: str, profile: str) -> str:
    """The side-by-side table as Markdown (one row per reading)."""
    if table.empty:
        return f"No {dataset} {profile} runs.\n"
    cols = [
        ("method", "method", "{}"),
        ("reading", "reading", "{}"),
        ("seeds", "seeds", "{:d}"),
        ("test_f_best_val", "test f (best val)", "{:.3f}"),
        ("vs_paper", "vs paper (same method)", "{:+.1%}"),
        ("vs_hf_cg_same_net", "/ HF-CG on SHF's net", "{:.3f}"),
        ("vs_hf_cg_martens_net", "/ HF-CG on Martens' net", "{:.3f}"),
        ("train_f_best_val", "train f (best val)", "{:.3f}"),
        ("test_f_equal_train", f"test f at train f ≤ {PAPER_TRAIN_F[dataset]}", "{:.3f}"),
        (f"test_f_it{PROBE_STEP}", f"test f @ it {PROBE_STEP}", "{:.3f}"),
        ("share_before_peak", "time before peak n", "{:.1%}"),
        ("n_25", "n @25%", "{:.0f}"),
        ("n_50", "n @50%", "{:.0f}"),
        ("n_75", "n @75%", "{:.0f}"),
        ("peak_batch", "peak n", "{:.0f}"),
        ("gradual", "gradual", "{}"),
        ("cpu_s", "CPU-s", "{:.0f}"),
    ]
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for _, r in table.iterrows():
        cells = []
        for key, _, fmt in cols:
            v = r.get(key)
            if v is None or (isinstance(v, float) and math.isnan(v)):
                cells.append("–")
            elif key == "seeds":
                cells.append(fmt.format(int(v)))
            else:
                cells.append(fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="usps", choices=sorted(PAPER_TRAIN_F))
    p.add_argument("--profile", default="paper")
    p.add_argument("--results-dir", type=Path, default=Path("results"))
    args = p.parse_args(argv)
    runs = collect(args.results_dir, args.dataset, args.profile)
    table = readings_table(runs, args.dataset)
    out = args.results_dir / "shf_audit" / f"readings_{args.dataset}_{args.profile}"
    out.parent.mkdir(parents=True, exist_ok=True)
    md = to_markdown(table, args.dataset, args.profile)
    out.with_suffix(".md").write_text(md)
    payload = {
        "dataset": args.dataset,
        "profile": args.profile,
        "runs": json.loads(runs.to_json(orient="records")),
        "readings": json.loads(table.to_json(orient="records")),
    }
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    print(md)
    print(f"wrote {out}.md and .json")


if __name__ == "__main__":
    main()
