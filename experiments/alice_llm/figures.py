"""RACS/Alice LLM experiments: Table 2, Figures 1–3, 5, 6 and Table 5 from run records, and
Figure 4 from the memory benchmark's records, next to the paper's numbers where they exist.

    python -m experiments.alice_llm.figures table2 --profile quick
    python -m experiments.alice_llm.figures fig2 --profile paper --sizes 60m 130m 350m

Definitions (paper §F.5 and Table 2's caption; docs/decisions.md RACS-3, RACS-4, RACS-23):

* eval ppl = exp(token-weighted mean validation CE) (``val/ppl``); GaLore's off-by-one value
  (``val/ppl_galore``) is shown beside it when logged — the paper's numbers come from GaLore's
  evaluation code;
* speed-up = Adam's total steps / the first evaluation step at which the method's eval ppl is
  at most Adam's final eval ppl (``never`` if it is not reached);
* TP = training tokens (non-pad targets) per second of update time, evaluation excluded;
  effective TP = TP × speed-up (0 when Adam's final ppl is never reached, as in the paper's
  Figure 3b).

Every figure writes its data as CSV beside the PNG; titles name the profile and device.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from curvopt.analysis.records import load_runs, load_summaries  # noqa: E402
from experiments.alice_llm.specs import (  # noqa: E402
    FIG5_PANELS,
    TABLE2_METHODS,
    TABLE5_ROWS,
    ablation_experiment_for,
    experiment_for,
    method_by_key,
    sizes_for,
)

PAPER_NUMBERS = Path(__file__).with_name("paper_numbers.csv")
PPL = "val/ppl"
PPL_GALORE = "val/ppl_galore"
SIZE_LABELS = {"tiny": "tiny (quick)", "60m": "60M", "130m": "130M", "350m": "350M", "1b": "1.3B"}
COLOURS = {
    "adam": "black",
    "galore": "tab:blue",
    "fira": "tab:green",
    "racs": "tab:purple",
    "alice0": "tab:orange",
    "alice": "tab:red",
}


def paper_numbers() -> pd.DataFrame:
    return pd.read_csv(PAPER_NUMBERS, comment="#")


def paper_value(table: str, method: str, size: str, head: str, metric: str) -> float:
    df = paper_numbers()
    hit = df[
        (df["table"] == table)
        & (df["method"] == method)
        & (df["size"] == size)
        & (df["head"] == head)
        & (df["metric"] == metric)
    ]
    return float(hit["value"].iloc[0]) if len(hit) else float("nan")


# -- records -----------------------------------------------------------------------------------
def load_experiment(results: Path, experiment: str, profile: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rows, summaries) of ``experiment`` at ``profile``; runs without a tag are ignored."""
    runs = load_runs(results, experiment)
    sums = load_summaries(results, experiment)
    if runs.empty or sums.empty:
        return pd.DataFrame(), pd.DataFrame()
    runs = runs[(runs["profile"] == profile) & runs["tag"].notna()]
    sums = sums[(sums.get("profile", pd.Series(dtype=str)) == profile) & sums.get("tag", pd.Series()).notna()]
    return runs, sums


def eval_curve(runs: pd.DataFrame, tag: str, metric: str = PPL) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the evaluations of the run tagged ``tag`` (first seed if several)."""
    if runs.empty or metric not in runs:
        return np.array([]), np.array([])
    sel = runs[runs["tag"] == tag]
    if sel.empty:
        return np.array([]), np.array([])
    first = sorted(sel["run_id"].unique())[0]
    pts = sel[sel["run_id"] == first][["step", metric]].dropna().sort_values("step")
    return pts["step"].to_numpy(dtype=float), pts[metric].to_numpy(dtype=float)


def steps_to_reach(steps: np.ndarray, values: np.ndarray, target: float) -> float:
    """First evaluation step with ``value <= target`` (no interpolation: the paper reads its
    speed-ups off the 500-step evaluation grid); nan if never."""
    ok = np.flatnonzero(np.isfinite(values) & (values <= target) & (steps > 0))
    return float(steps[ok[0]]) if ok.size else float("nan")


def speedup(adam: tuple[np.ndarray, np.ndarray], method: tuple[np.ndarray, np.ndarray]) -> float:
    a_steps, a_vals = adam
    if a_steps.size == 0 or method[0].size == 0:
        return float("nan")
    reach = steps_to_reach(method[0], method[1], float(a_vals[-1]))
    return float(a_steps[-1]) / reach if math.isfinite(reach) else float("nan")


def _summary_of(sums: pd.DataFrame, tag: str) -> pd.Series | None:
    sel = sums[sums["tag"] == tag] if not sums.empty else sums
    if sel is None or sel.empty:
        return None
    return sel.sort_values("run_id").iloc[0]


def _device(sums: pd.DataFrame) -> str:
    if sums.empty:
        return "n/a"
    cols = [c for c in ("device_name", "device") if c in sums]
    return ", ".join(sorted({str(v) for c in cols[:1] for v in sums[c].dropna().unique()})) or "n/a"


# -- Table 2 -----------------------------------------------------------------------------------
def table2_frame(results: Path, profile: str, sizes: list[str] | None = None) -> pd.DataFrame:
    rows = []
    for size in sizes_for(profile, sizes):
        runs, sums = load_experiment(results, experiment_for(size), profile)
        adam = eval_curve(runs, "adam")
        adam_sum = _summary_of(sums, "adam") if not sums.empty else None
        adam_tp = (
            float(adam_sum["tokens_per_s"]) if adam_sum is not None and "tokens_per_s" in adam_sum else np.nan
        )
        for m in TABLE2_METHODS:
            curve = eval_curve(runs, m.key)
            s = _summary_of(sums, m.key) if not sums.empty else None
            base = m.key.split("+")[0]
            final = float(curve[1][-1]) if curve[1].size else np.nan
            galore = eval_curve(runs, m.key, PPL_GALORE)
            sp = speedup(adam, curve)
            tp = float(s["tokens_per_s"]) if s is not None and "tokens_per_s" in s else np.nan
            rows.append(
                {
                    "size": size,
                    "method": m.key,
                    "label": m.label,
                    "head": m.head,
                    "status": s["status"] if s is not None else "missing",
                    "steps": int(curve[0][-1]) if curve[0].size else np.nan,
                    "ppl": final,
                    "ppl_galore_eval": float(galore[1][-1]) if galore[1].size else np.nan,
                    "paper_ppl": paper_value("table2", base, size, m.head, "ppl"),
                    "speedup": sp,
                    "paper_speedup": paper_value("table2", base, size, m.head, "speedup"),
                    "tokens_per_s": tp,
                    "tp_vs_adam": tp / adam_tp if math.isfinite(adam_tp) and adam_tp > 0 else np.nan,
                    "effective_tp": tp * sp if math.isfinite(sp) else (0.0 if math.isfinite(tp) else np.nan),
                    "paper_tp": paper_value("table2", base, size, m.head, "tp"),
                    "paper_effective_tp": paper_value("table2", base, size, m.head, "eff_tp"),
                    "peak_mem_bytes": float(s["peak_mem_bytes"])
                    if s is not None and "peak_mem_bytes" in s
                    else np.nan,
                    "device": s.get("device_name", s.get("device")) if s is not None else None,
                }
            )
    return pd.DataFrame(rows)


def _fmt(value: float, digits: int = 2) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def table2_markdown(df: pd.DataFrame, profile: str) -> str:
    """Paper layout: one row per base method, columns ``<size> Ppl.`` / ``Ppl.*``; cells
    ``ours (paper)``, then speed-up and TP rows."""
    sizes = list(dict.fromkeys(df["size"]))
    lines = [
        f"Table 2 (profile: {profile}; cells: ours (paper); Ppl. = last layer by the method, "
        "Ppl.* = by Adam; NA = not applicable)",
        "",
    ]
    header = ["Method"] + [f"{SIZE_LABELS.get(s, s)} {c}" for s in sizes for c in ("Ppl.", "Ppl.*")]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for base, label in dict.fromkeys((m.key.split("+")[0], m.label.split(" (+")[0]) for m in TABLE2_METHODS):
        cells = [label]
        for s in sizes:
            for head in ("method", "adam"):
                sel = df[
                    (df["size"] == s) & (df["method"].str.split("+").str[0] == base) & (df["head"] == head)
                ]
                if sel.empty:
                    cells.append("NA")
                    continue
                r = sel.iloc[0]
                paper = f" ({_fmt(r.paper_ppl)})" if math.isfinite(r.paper_ppl) else ""
                cells.append(f"{_fmt(r.ppl)}{paper}" if r.status != "missing" else f"not run{paper}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    header = ["Row"] + [SIZE_LABELS.get(s, s) for s in sizes]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def row(label: str, key: str, col: str, paper_col: str | None, digits: int) -> None:
        cells = [label]
        for s in sizes:
            sel = df[(df["size"] == s) & (df["method"] == key)]
            if sel.empty:
                cells.append("–")
                continue
            r = sel.iloc[0]
            paper = f" ({_fmt(r[paper_col], digits)})" if paper_col and math.isfinite(r[paper_col]) else ""
            cells.append(f"{_fmt(r[col], digits)}{paper}")
        lines.append("| " + " | ".join(cells) + " |")

    row("Speed-up in steps (Alice) vs our Adam", "alice", "speedup", "paper_speedup", 2)
    row("Speed-up in steps (RACS) vs our Adam", "racs", "speedup", None, 2)
    for key, name in (("adam", "Adam"), ("alice", "Alice"), ("racs", "RACS")):
        row(f"TP tokens/s ({name})", key, "tokens_per_s", "paper_tp", 0)
        row(f"Effective TP ({name})", key, "effective_tp", "paper_effective_tp", 0)
        row(f"TP relative to Adam ({name})", key, "tp_vs_adam", None, 3)
    devices = sorted({str(d) for d in df["device"].dropna().unique()})
    lines += [
        "",
        f"Device: {', '.join(devices) or 'n/a'}. Paper TP: A100s (GPU count not stated); compare ratios only.",
    ]
    if devices == ["cpu"]:
        lines += [
            "",
            "TP here is each run's wall-clock tokens/s on a CPU that may be shared with other jobs, at "
            "whatever load each run saw: TP ratios between these runs are not controlled. "
            "`benchmarks/bench_llm_throughput.py --threads 1` times all methods back to back on the "
            "process clock (`results/benchmarks/llm_throughput*.md`).",
        ]
    return "\n".join(lines) + "\n"


def table2(results: Path, profile: str, sizes: list[str] | None, out: Path) -> Path:
    df = table2_frame(results, profile, sizes)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / f"alice_table2_{profile}.csv", index=False)
    path = out / f"alice_table2_{profile}.md"
    path.write_text(table2_markdown(df, profile))
    return path


# -- Figures 1 and 2 ---------------------------------------------------------------------------
def _style(key: str) -> dict:
    base = key.split("+")[0]
    return {"color": COLOURS.get(base, "grey"), "linestyle": "--" if key.endswith("+head") else "-"}


def fig_curves(results: Path, profile: str, sizes: list[str], out: Path, name: str) -> Path:
    """Eval ppl vs training step, one panel per size, one line per method; the dotted line is
    Adam's final eval ppl (read the speed-up where a curve crosses it)."""
    out.mkdir(parents=True, exist_ok=True)
    sizes = sizes_for(profile, sizes)
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.2 * len(sizes), 4), squeeze=False)
    data = []
    devices = []
    for ax, size in zip(axes[0], sizes):
        runs, sums = load_experiment(results, experiment_for(size), profile)
        devices.append(_device(sums))
        for m in TABLE2_METHODS:
            steps, vals = eval_curve(runs, m.key)
            if steps.size == 0:
                continue
            ax.plot(steps, vals, label=m.label, marker=".", **_style(m.key))
            data += [{"size": size, "method": m.key, "step": s, "ppl": v} for s, v in zip(steps, vals)]
        adam = eval_curve(runs, "adam")
        if adam[1].size:
            ax.axhline(adam[1][-1], color="black", linestyle=":", linewidth=0.8)
            finite = np.concatenate([eval_curve(runs, m.key)[1] for m in TABLE2_METHODS])
            finite = finite[np.isfinite(finite)]
            lo, hi = finite.min(), np.percentile(finite, 90)  # ignore the step-0 ppl
            ax.set_ylim(lo * 0.95, max(hi, adam[1][-1] * 1.5))
        ax.set_title(f"LLaMA {SIZE_LABELS.get(size, size)} on C4")
        ax.set_xlabel("training step")
        ax.set_ylabel("eval perplexity")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=7)
    fig.suptitle(
        f"{name}: eval ppl vs step (profile: {profile}; device: {', '.join(sorted(set(devices)))})",
        fontsize=9,
    )
    fig.tight_layout()
    path = out / f"alice_{name}_{profile}.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    pd.DataFrame(data).to_csv(path.with_suffix(".csv"), index=False)
    return path


# -- Figure 3 ----------------------------------------------------------------------------------
def fig3(results: Path, profile: str, sizes: list[str] | None, out: Path) -> Path:
    """(a) tokens/s per method and size; (b) effective tokens/s (Adam = reference)."""
    df = table2_frame(results, profile, sizes)
    out.mkdir(parents=True, exist_ok=True)
    keys = ["adam", "galore", "fira", "racs", "alice0", "alice"]
    df = df[df["method"].isin(keys)]
    sizes = list(dict.fromkeys(df["size"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(keys)
    for panel, (ax, col) in enumerate(zip(axes, ("tokens_per_s", "effective_tp"))):
        for i, key in enumerate(keys):
            vals = [
                float(df[(df["size"] == s) & (df["method"] == key)][col].iloc[0])
                if len(df[(df["size"] == s) & (df["method"] == key)])
                else np.nan
                for s in sizes
            ]
            ax.bar(np.arange(len(sizes)) + i * width, vals, width, label=key, color=COLOURS[key])
        ax.set_xticks(np.arange(len(sizes)) + 0.4 - width / 2)
        ax.set_xticklabels([SIZE_LABELS.get(s, s) for s in sizes])
        ax.set_ylabel("tokens / s" if panel == 0 else "effective tokens / s")
        ax.set_title("(a) throughput" if panel == 0 else "(b) effective throughput (0 = never reaches Adam)")
    axes[0].legend(fontsize=7)
    devices = sorted({str(d) for d in df["device"].dropna().unique()})
    fig.suptitle(f"Figure 3 (profile: {profile}; device: {', '.join(devices) or 'n/a'})", fontsize=9)
    fig.tight_layout()
    path = out / f"alice_fig3_{profile}.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    df.to_csv(path.with_suffix(".csv"), index=False)
    return path


# -- Figure 4 ----------------------------------------------------------------------------------
def fig4(results: Path, profile: str, out: Path) -> Path:
    """Measured peak memory per method, with and without layer-wise updates, from the records
    of ``experiments/alice_llm/memory.py`` (``results/alice_memory/*.json``)."""
    recs = [json.loads(p.read_text()) for p in sorted((results / "alice_memory").glob("*.json"))]
    df = pd.DataFrame(recs)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"alice_fig4_{profile}.png"
    if not df.empty:
        df = df[df["profile"] == profile]
    fig, ax = plt.subplots(figsize=(7, 4))
    if not df.empty:
        sizes = list(dict.fromkeys(df["size"]))
        methods = list(dict.fromkeys(df["method"]))
        width = 0.8 / max(1, 2 * len(methods))
        for i, (method, layerwise) in enumerate((m, lw) for m in methods for lw in (False, True)):
            vals = []
            for s in sizes:
                sel = df[(df["size"] == s) & (df["method"] == method) & (df["layerwise"] == layerwise)]
                vals.append(float(sel["peak_bytes"].iloc[0]) / 2**30 if len(sel) else np.nan)
            ax.bar(
                np.arange(len(sizes)) + i * width,
                vals,
                width,
                label=f"{method}{'-layerwise' if layerwise else ''}",
                color=COLOURS.get(method.split("+")[0], "grey"),
                hatch="//" if layerwise else None,
            )
        ax.set_xticks(np.arange(len(sizes)) + 0.4 - width / 2)
        ax.set_xticklabels([SIZE_LABELS.get(s, s) for s in sizes])
        ax.legend(fontsize=6, ncol=2)
        kinds = ", ".join(sorted(df["memory_kind"].unique()))
        if "dtype" in df:
            kinds += ", " + ", ".join(sorted(df["dtype"].dropna().unique()))
        devices = ", ".join(sorted(df["device"].unique()))
    else:
        kinds = devices = "n/a"
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title(f"Figure 4: measured memory ({kinds}); profile {profile}; device {devices}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    df.to_csv(path.with_suffix(".csv"), index=False)
    return path


# -- Figure 5 and Table 5 ----------------------------------------------------------------------
def _ablation_runs(results: Path, profile: str, size: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    runs, sums = load_experiment(results, ablation_experiment_for(size), profile)
    main_runs, main_sums = load_experiment(results, experiment_for(size), profile)
    return pd.concat([runs, main_runs], ignore_index=True), pd.concat([sums, main_sums], ignore_index=True)


def fig5(results: Path, profile: str, size: str, out: Path) -> Path:
    runs, sums = _ablation_runs(results, profile, size)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(FIG5_PANELS), figsize=(4.2 * len(FIG5_PANELS), 3.8))
    data = []
    for ax, (panel, keys) in zip(axes, FIG5_PANELS.items()):
        for key in keys:
            steps, vals = eval_curve(runs, key)
            if steps.size == 0:
                continue
            ax.plot(steps[steps > 0], vals[steps > 0], label=method_by_key(key).label, marker=".")
            data += [{"panel": panel, "method": key, "step": s, "ppl": v} for s, v in zip(steps, vals)]
        ax.set_title(panel.replace("_", " ", 1), fontsize=9)
        ax.set_xlabel("training step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    axes[0].set_ylabel("eval perplexity")
    fig.suptitle(
        f"Figure 5 ablations, LLaMA {SIZE_LABELS.get(size, size)} (profile: {profile}; device: {_device(sums)})",
        fontsize=9,
    )
    fig.tight_layout()
    path = out / f"alice_fig5_{profile}.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    pd.DataFrame(data).to_csv(path.with_suffix(".csv"), index=False)
    return path


def table5(results: Path, profile: str, size: str, out: Path) -> Path:
    runs, _ = _ablation_runs(results, profile, size)
    lines = [
        f"Table 5 (LLaMA {SIZE_LABELS.get(size, size)}, profile {profile}; paper: 130M): eval ppl, ours (paper)",
        "",
        "| Components | Eval ppl |",
        "|---|---|",
    ]
    rows = []
    for key in TABLE5_ROWS:
        _, vals = eval_curve(runs, key)
        ours = float(vals[-1]) if vals.size else float("nan")
        paper = paper_value("table5", key, "130m", "method", "ppl")
        rows.append({"method": key, "ppl": ours, "paper_ppl_130m": paper})
        lines.append(f"| {method_by_key(key).label} | {_fmt(ours)} ({_fmt(paper)}) |")
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out / f"alice_table5_{profile}.csv", index=False)
    path = out / f"alice_table5_{profile}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# -- Figure 6 ----------------------------------------------------------------------------------
def fig6(results: Path, profile: str, out: Path) -> Path:
    """|cos| between leading eigenvectors before and after each refresh (records of
    ``experiments/alice_llm/basis_stability.py``: ``results/alice_basis/<profile>_*.csv``)."""
    files = sorted((results / "alice_basis").glob(f"{profile}_*.csv"))
    df = pd.concat([pd.read_csv(f) for f in files], ignore_index=True) if files else pd.DataFrame()
    out.mkdir(parents=True, exist_ok=True)
    idx = [1, 2, 4, 8]
    fig, axes = plt.subplots(1, len(idx), figsize=(4 * len(idx), 3.5))
    for ax, i in zip(axes, idx):
        if not df.empty:
            for variant, sel in df[df["index"] == i].groupby("variant"):
                ax.plot(sel["step"], sel["abs_cos"], marker=".", label=variant)
        ax.set_title(f"eigenvector {i}")
        ax.set_xlabel("step")
        ax.set_ylim(0, 1.05)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[0].set_ylabel("|cos(U_old, U_new)|")
    layer = df["param"].iloc[0] if not df.empty else "n/a"
    fig.suptitle(f"Figure 6: basis stability across refreshes (profile: {profile}; {layer})", fontsize=9)
    fig.tight_layout()
    path = out / f"alice_fig6_{profile}.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    df.to_csv(path.with_suffix(".csv"), index=False)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["table2", "fig1", "fig2", "fig3", "fig4", "fig5", "table5", "fig6"])
    parser.add_argument("--profile", default="quick", choices=["quick", "paper"])
    parser.add_argument("--sizes", nargs="*", default=None, help="paper sizes (60m 130m 350m 1b)")
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--out", type=Path, default=Path("results/figures"))
    args = parser.parse_args(argv)
    p, r, o = args.profile, args.results, args.out
    if args.what == "table2":
        path = table2(r, p, args.sizes, o)
        print(path.read_text())
    elif args.what == "fig1":
        path = fig_curves(r, p, args.sizes or ["1b"], o, "fig1")
    elif args.what == "fig2":
        path = fig_curves(r, p, args.sizes or ["60m", "130m", "350m"], o, "fig2")
    elif args.what == "fig3":
        path = fig3(r, p, args.sizes, o)
    elif args.what == "fig4":
        path = fig4(r, p, o)
    elif args.what == "fig5":
        path = fig5(r, p, "tiny" if p == "quick" else "130m", o)
    elif args.what == "table5":
        path = table5(r, p, "tiny" if p == "quick" else "130m", o)
        print(path.read_text())
    else:
        path = fig6(r, p, o)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
