"""SHF-LSMR paper: Figure 2 (error vs time), Figure 3 (batch size vs time) and Table 2, drawn
from run records only (``results/shf_fig2_<dataset>/``).

    python -m experiments.shf.figures fig2 --datasets mnist
    python -m experiments.shf.figures fig3 --datasets mnist curves usps
    python -m experiments.shf.figures table2 --datasets mnist

Seeds are averaged by linear interpolation of each run's curve onto a common time grid over
``[0, min_seed T_final]`` (docs/decisions.md SHF-24); every plotted series is saved as CSV next
to the PNG. Titles say which profile produced the runs, and CURVES is labelled CURVES-like when
the data came from our generator.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from curvopt.analysis.curves import mean_curve_on_grid  # noqa: E402
from curvopt.analysis.records import load_runs, load_summaries  # noqa: E402
from experiments.plots.common import save_with_csv  # noqa: E402

METHOD_LABELS = {"shf_lsmr": "SHF-LSMR (ours)", "hf_cg": "Martens HF-CG"}
METHOD_COLOURS = {"shf_lsmr": "tab:red", "hf_cg": "tab:blue"}
PAPER_TABLE2 = Path(__file__).with_name("paper_table2.csv")


def experiment_name(dataset: str) -> str:
    return f"shf_fig2_{dataset}"


def panel_title(dataset: str, df: pd.DataFrame) -> str:
    synthetic = (
        bool(df["synthetic_data"].astype(object).fillna(False).astype(bool).any())
        if "synthetic_data" in df
        else False
    )
    name = {"mnist": "MNIST", "usps": "USPS", "curves": "CURVES"}.get(dataset, dataset)
    return f"{name}-like (synthetic)" if synthetic else name


def profile_label(frames: list[pd.DataFrame]) -> str:
    profiles = sorted({str(p) for df in frames if not df.empty for p in df["profile"].dropna().unique()})
    devices = sorted(
        {str(d) for df in frames if not df.empty and "device" in df for d in df["device"].dropna().unique()}
    )
    return f"profile: {', '.join(profiles) or 'n/a'}; device: {', '.join(devices) or 'n/a'}"


def time_label(frames: list[pd.DataFrame]) -> str:
    """x-axis label: wall time (the papers' computation time) or, for quick runs timed on a shared
    CPU, the process's CPU seconds with the thread count."""
    clocks = sorted({str(c) for df in frames if "clock" in df for c in df["clock"].dropna().unique()})
    if clocks == ["process"]:
        threads = sorted(
            {str(int(t)) for df in frames if "num_threads" in df for t in df["num_threads"].dropna().unique()}
        )
        return f"algorithm CPU time [s] ({'/'.join(threads) or '?'} thread(s))"
    return "computation (algorithm wall) time [s]"


FINISHED = ("completed", "diverged")


def select_runs(df: pd.DataFrame, profile: str, finished_only: bool = False) -> pd.DataFrame:
    """Runs of one profile; ``finished_only`` drops runs still in progress (no final summary)."""
    if df.empty:
        return df
    df = df[df["profile"] == profile]
    if finished_only and "status" in df:
        df = df[df["status"].isin(FINISHED)]
    return df


def finished_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The finished rows of ``runs`` (all of them when the records carry no status)."""
    return runs[runs["status"].isin(FINISHED)] if "status" in runs else runs


def unfinished_note(runs: pd.DataFrame) -> str:
    """`` (in progress: step N)`` for a run whose records end before it finished."""
    if "status" not in runs or runs["status"].isin(FINISHED).all():
        return ""
    steps = runs.loc[~runs["status"].isin(FINISHED), "step"]
    return f" (in progress, step {int(steps.max())})" if not steps.empty else " (in progress)"


def _seed_counts(df: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """method -> (finished runs, runs in progress) in one panel's records."""
    counts = {}
    for method, runs in df.groupby("optimizer"):
        done = finished_runs(runs)["run_id"].nunique()
        counts[method] = (done, runs["run_id"].nunique() - done)
    return counts


def _seed_text(counts: dict[str, tuple[int, int]]) -> str:
    return ", ".join(
        f"{METHOD_LABELS.get(m, m)}: {d} seed(s)" + (f" + {o} in progress" if o else "")
        for m, (d, o) in sorted(counts.items())
    )


def budget_label(frames: dict[str, pd.DataFrame]) -> str:
    """The seed count per method (per dataset when the panels differ), and the algorithm-time budget
    when the profile has one.

    Args:
        frames: dataset -> that panel's run records.
    """
    parts = []
    counts = {d: _seed_counts(df) for d, df in frames.items() if not df.empty}
    first = next(iter(counts.values()), None)
    if counts and all(c == first for c in counts.values()):
        parts.append(_seed_text(first))
    elif counts:
        parts.append(" | ".join(f"{panel_title(d, frames[d])}: {_seed_text(c)}" for d, c in counts.items()))
    budgets = sorted(
        {
            float(b)
            for df in frames.values()
            if "max_algo_time_s" in df
            for b in df["max_algo_time_s"].dropna().unique()
        }
    )
    if budgets:
        parts.append("budget " + "/".join(f"{b:g}" for b in budgets) + " s of algorithm time per run")
    return "; ".join(parts)


def _panels(results: Path, datasets: list[str], profile: str, height: float):
    """One panel per dataset, with that dataset's runs of ``profile`` (runs still in progress are
    drawn and labelled so)."""
    frames = {d: select_runs(load_runs(results, experiment_name(d)), profile) for d in datasets}
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.4 * len(datasets), height), squeeze=False)
    return frames, fig, axes


def fig2(results: Path, datasets: list[str], profile: str, out: Path) -> Path:
    frames, fig, axes = _panels(results, datasets, profile, 4.3)
    series = []
    for ax, dataset in zip(axes[0], datasets):
        df = frames[dataset]
        if df.empty:
            ax.text(0.5, 0.5, _not_run(dataset, profile), ha="center", va="center", transform=ax.transAxes)
            ax.set_title(dataset)
            continue
        for method, runs in df.groupby("optimizer", sort=True):
            colour = METHOD_COLOURS.get(method)
            # the mean is over finished runs; runs still in progress are drawn thinly beside it (with
            # no finished run yet, the in-progress runs themselves, labelled so)
            finished = finished_runs(runs)
            main = finished if not finished.empty else runs
            n_seeds = main["run_id"].nunique()
            n_open = runs["run_id"].nunique() - n_seeds
            for split, style in (("train", ":"), ("test", "-")):
                col = f"{split}/E_sq"
                grid, mean, std = mean_curve_on_grid(main, "algo_time_s", col)
                if grid.size == 0:
                    continue
                if n_seeds > 1 or n_open:  # each seed thinly, the mean over the common time range boldly
                    for _, run in runs.groupby("run_id"):
                        pts = run[["algo_time_s", col]].dropna()
                        ax.plot(pts["algo_time_s"], pts[col], style, color=colour, lw=0.5, alpha=0.35)
                label = (
                    f"{METHOD_LABELS.get(method, method)} {split}"
                    + (f" (mean of {n_seeds})" if n_seeds > 1 else "")
                    + (f" (+{n_open} in progress, thin)" if n_open else unfinished_note(main))
                )
                ax.plot(grid, mean, style, color=colour, label=label, lw=1.6)
                series.append(
                    pd.DataFrame(
                        {
                            "dataset": dataset,
                            "method": method,
                            "split": split,
                            "algo_time_s": grid,
                            "E_sq_mean": mean,
                            "E_sq_std": std,
                            "seeds": n_seeds,
                        }
                    )
                )
            best = main.groupby("run_id").apply(_best_val_point, include_groups=False).dropna()
            if method == "shf_lsmr" and not best.empty:
                ax.scatter(
                    best["algo_time_s"],
                    best["test/E_sq"],
                    marker="o",
                    s=18,
                    color=colour,
                    zorder=3,
                    label="SHF best-validation iterate",
                )
        ax.set_yscale("log")
        ax.set_xlabel(time_label([df]))
        ax.set_ylabel("reconstruction error E_sq = mean ‖x̂ − x‖²")
        ax.set_title(panel_title(dataset, df))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(
        f"SHF-LSMR Figure 2: training (dotted) and test (solid) error vs time\n"
        f"{profile_label(list(frames.values()))}; {budget_label(frames)}",
        fontsize=10,
    )
    return _save(fig, out, series)


def _not_run(dataset: str, profile: str) -> str:
    scale = "" if profile == "quick" else f" SCALE={profile}"
    return f"no {profile} runs:\nmake reproduce-fig2{scale} SHF_DATASETS={dataset}"


def _save(fig: plt.Figure, out: Path, series: list[pd.DataFrame]) -> Path:
    fig.tight_layout()
    return save_with_csv(fig, out, series)


def _best_val_point(run: pd.DataFrame) -> pd.Series:
    evals = run.dropna(subset=["val/E_sq"])
    if evals.empty:
        return pd.Series({"algo_time_s": np.nan, "test/E_sq": np.nan})
    row = evals.loc[evals["val/E_sq"].idxmin()]
    return pd.Series({"algo_time_s": row["algo_time_s"], "test/E_sq": row.get("test/E_sq", np.nan)})


def _peak_memory_note(runs: pd.DataFrame) -> str:
    """Largest logged peak memory of a method's runs (CPU: process RSS incl. data; CUDA: allocated)."""
    if "peak_mem_bytes" not in runs or runs["peak_mem_bytes"].dropna().empty:
        return ""
    return f" (peak mem {runs['peak_mem_bytes'].max() / 2**20:.0f} MiB)"


def fig3(results: Path, datasets: list[str], profile: str, out: Path) -> Path:
    frames, fig, axes = _panels(results, datasets, profile, 4.0)
    series = []
    for ax, dataset in zip(axes[0], datasets):
        df = frames[dataset]
        if df.empty or "batch_size" not in df:
            ax.text(0.5, 0.5, _not_run(dataset, profile), ha="center", va="center", transform=ax.transAxes)
            ax.set_title(dataset)
            continue
        for (method, run_id), run in df.groupby(["optimizer", "run_id"], sort=True):
            pts = run[["algo_time_s", "batch_size"]].dropna()
            if not pts.empty and pts["algo_time_s"].iloc[0] > 0:  # the first batch is in use from t = 0
                pts = pd.concat([pts.iloc[:1].assign(algo_time_s=0.0), pts], ignore_index=True)
            ax.step(
                pts["algo_time_s"],
                pts["batch_size"],
                where="post",
                color=METHOD_COLOURS.get(method),
                lw=1.0,
                alpha=0.8,
                label=METHOD_LABELS.get(method, method)
                + _peak_memory_note(df[df["optimizer"] == method])
                + unfinished_note(run),
            )
            series.append(pts.assign(dataset=dataset, method=method, run_id=run_id))
            if method == "hf_cg" and not pts.empty and pd.notna(run["num_train"].iloc[0]):
                # Martens' gradient and line search use the whole training set every iteration
                n_train = int(run["num_train"].iloc[0])
                ax.axhline(
                    n_train,
                    color=METHOD_COLOURS["hf_cg"],
                    ls="--",
                    lw=0.8,
                    label=f"HF-CG gradient / line-search set (N = {n_train})",
                )
        ax.set_xlabel(time_label([df]))
        ax.set_ylabel("mini-batch size (curvature batch for HF-CG)")
        ax.set_title(panel_title(dataset, df))
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
    fig.suptitle(
        f"SHF-LSMR Figure 3: mini-batch size vs time\n{profile_label(list(frames.values()))}; "
        f"{budget_label(frames)}",
        fontsize=10,
    )
    return _save(fig, out, series)


ALL_DATASETS = ("mnist", "curves", "usps")
TABLE2_COLUMNS = (
    "dataset", "method", "selection", "ours_train_E_sq", "ours_train_std", "ours_test_E_sq", "ours_test_std",
    "ours_train_f", "ours_test_f", "seeds", "device", "data", "paper_train", "paper_test", "profile", "status",
)  # fmt: skip


def table2(results: Path, datasets: list[str], profile: str, out_dir: Path) -> pd.DataFrame:
    """Train/test E_sq at the best-validation iterate (SHF protocol) for both methods, and, for
    Martens, also at the best-test iterate (the paper's protocol for the baseline), mean over seeds.

    The command line writes the rows of every dataset of :data:`ALL_DATASETS` (those asked for
    first), so the table regenerated for one dataset keeps the others'."""
    paper = pd.read_csv(PAPER_TABLE2)
    rows = []
    for dataset in datasets:
        exp = experiment_name(dataset)
        everything = select_runs(load_runs(results, exp), profile)
        df = select_runs(everything, profile, finished_only=True)  # a running run has no final iterate yet
        summaries = load_summaries(results, exp)
        running = sorted(set(everything["run_id"]) - set(df["run_id"])) if not everything.empty else []
        for method in ("shf_lsmr", "hf_cg"):
            runs = df[df["optimizer"] == method] if not df.empty else df
            in_progress = [r for r in running if r.startswith(method)]
            if runs.empty:
                status = f"in progress: {', '.join(in_progress)}" if in_progress else "not run"
                rows.append({"dataset": dataset, "method": method, "profile": profile, "status": status})
                continue
            picks = {"best_val": [], "best_test": []}
            for _, run in runs.groupby("run_id"):
                evals = run.dropna(subset=["val/E_sq", "test/E_sq", "train/E_sq"])
                if evals.empty:
                    continue
                picks["best_val"].append(evals.loc[evals["val/E_sq"].idxmin()])
                picks["best_test"].append(evals.loc[evals["test/E_sq"].idxmin()])
            ref = paper[(paper["dataset"] == dataset) & (paper["method"] == method)]
            statuses = (
                summaries[summaries["run_id"].isin(runs["run_id"].unique())]["status"]
                .value_counts()
                .to_dict()
            )
            for protocol, chosen in picks.items():
                if not chosen:
                    continue
                chosen_df = pd.DataFrame(chosen)
                rows.append(
                    {
                        "dataset": dataset,
                        "method": method,
                        "selection": protocol,
                        "ours_train_E_sq": chosen_df["train/E_sq"].mean(),
                        "ours_train_std": chosen_df["train/E_sq"].std(ddof=1),
                        "ours_test_E_sq": chosen_df["test/E_sq"].mean(),
                        "ours_test_std": chosen_df["test/E_sq"].std(ddof=1),
                        # f = E_sq/2 (the paper's objective, mean ½‖x̂ − x‖²): the paper's "error" may be either
                        "ours_train_f": chosen_df["train/E_sq"].mean() / 2,
                        "ours_test_f": chosen_df["test/E_sq"].mean() / 2,
                        "seeds": len(chosen_df),
                        "device": ", ".join(sorted({str(d) for d in runs["device"].dropna().unique()})),
                        "data": "CURVES-like (our generator, not Martens' file)"
                        if bool(runs["synthetic_data"].astype(object).fillna(False).astype(bool).any())
                        else dataset,
                        "paper_train": float(ref["train_error"].iloc[0]) if not ref.empty else np.nan,
                        "paper_test": float(ref["test_error"].iloc[0]) if not ref.empty else np.nan,
                        "profile": profile,
                        "status": ", ".join(f"{k}: {v}" for k, v in statuses.items())
                        + (f"; in progress: {', '.join(in_progress)}" if in_progress else ""),
                    }
                )
    table = pd.DataFrame(rows)
    table = table[[c for c in TABLE2_COLUMNS if c in table] + [c for c in table if c not in TABLE2_COLUMNS]]
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"shf_table2_{profile}"
    table.to_csv(stem.with_suffix(".csv"), index=False)
    note = (
        f"SHF-LSMR Table 2 — our runs ({profile} profile) next to the paper's 5-seed means. Errors are "
        "E_sq = mean over examples of the summed squared pixel error. SHF: iterate with the lowest "
        "validation error; Martens: both best-validation and the paper's best-test selection. "
        + (
            "Quick-profile numbers come from short CPU runs on data subsets and are NOT the paper's scale.\n\n"
            if profile == "quick"
            else "\n\n"
        )
    )
    stem.with_suffix(".md").write_text(
        note
        + table.astype(object)
        .where(table.notna(), None)
        .to_markdown(index=False, floatfmt=".4g", missingval="–")
        + "\n"
    )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["fig2", "fig3", "table2"])
    parser.add_argument("--datasets", nargs="+", default=["mnist"])
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--results-dir", type=Path, default=Path("results"))
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.what == "table2":
        # every dataset, those asked for first: the file regenerated for one keeps the others' rows
        datasets = list(dict.fromkeys([*args.datasets, *ALL_DATASETS]))
        table = table2(args.results_dir, datasets, args.profile, args.out_dir or args.results_dir / "tables")
        print(table.to_string(index=False))
        return
    out_dir = args.out_dir or args.results_dir / "figures"
    fn = fig2 if args.what == "fig2" else fig3
    path = fn(args.results_dir, args.datasets, args.profile, out_dir / f"shf_{args.what}_{args.profile}.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
