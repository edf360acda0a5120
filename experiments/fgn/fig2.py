"""FGN paper Figure 2 (mechanism checks): measure, record, then draw from the records only.

    python -m experiments.fgn.fig2 all --profile quick          # what `make reproduce-fgn-fig2` runs
    python -m experiments.fgn.fig2 timing --profile paper --set timing.classes=[2,4096]
    python -m experiments.fgn.fig2 plot --profile quick

Records (``results/fgn_fig2/<profile>/``):

* ``timing.jsonl``: one JSON row per (method, C, repeat) timing cell — ms per update (mean, median,
  min over the timed steps), CG iterations, device, threads. Cells already present are skipped,
  so an interrupted sweep resumes where it stopped (``--force`` re-times);
* ``traces.csv``: panel (b), closed forms and traces of the explicit matrices;
* ``quality.csv``: panel (c), ``R`` per damping scale and mixing weight;
* ``config.json``: the resolved settings of the last run of each part.

Figure: ``results/figures/fgn/fig2_<profile>.png`` (and ``.pdf``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from experiments.fgn import mechanism

CONFIG = Path(__file__).with_name("fig2.yaml")
METHOD_LABELS = {
    "adam": "Adam",
    "sgn": "SGN (full GGN, param-space CG)",
    "fgn_generic": "FGN generic (torch.func)",
    "fgn_affine": "FGN closed-form Gram",
}
METHOD_STYLE = {
    "adam": ("tab:gray", "o"),
    "sgn": ("tab:blue", "s"),
    "fgn_generic": ("tab:orange", "^"),
    "fgn_affine": ("tab:red", "D"),
}


def load_config(profile: str, overrides: list[str]) -> dict[str, Any]:
    cfg = yaml.safe_load(CONFIG.read_text())[profile]
    for item in overrides:
        key, _, raw = item.partition("=")
        section, _, name = key.partition(".")
        if section not in cfg or not name:
            raise SystemExit(f"--set {item}: expected section.key=value with section in {sorted(cfg)}")
        cfg[section][name] = yaml.safe_load(raw)
    return cfg


def out_dir(results: Path, profile: str) -> Path:
    path = results / "fgn_fig2" / profile
    path.mkdir(parents=True, exist_ok=True)
    return path


def _save_config(folder: Path, part: str, cfg: dict[str, Any]) -> None:
    path = folder / "config.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    saved[part] = cfg
    path.write_text(json.dumps(saved, indent=2))


# -- parts ---------------------------------------------------------------------------------------------
def run_timing(cfg: dict[str, Any], folder: Path, profile: str, force: bool = False) -> None:
    import torch

    tc = dict(cfg["timing"])
    if tc.get("threads"):
        torch.set_num_threads(int(tc["threads"]))
    if tc.get("device", "cpu") == "auto":
        tc["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    records = folder / "timing.jsonl"
    done = set()
    if records.exists() and not force:
        for line in records.read_text().splitlines():
            row = json.loads(line)
            done.add((row["method"], row["C"], row["D"], row["b"], row["repeat"], row["device_kind"]))
    elif force and records.exists():
        records.unlink()
    _save_config(folder, "timing", tc)
    device_kind = tc["device"]
    for repeat in range(int(tc["repeats"])):
        for c in tc["classes"]:
            for method in tc["methods"]:
                key = (method, int(c), int(tc["dim"]), int(tc["batch_size"]), repeat, device_kind)
                if key in done:
                    continue
                t0 = time.perf_counter()
                try:
                    row = mechanism.time_cell(
                        method,
                        int(c),
                        int(tc["dim"]),
                        int(tc["batch_size"]),
                        int(tc["num_examples"]),
                        int(tc["warmup_steps"]),
                        int(tc["timed_steps"]),
                        seed=int(tc["seed"]),
                        device=tc["device"],
                        settings=tc,
                    )
                    row["status"] = "ok"
                except (FloatingPointError, RuntimeError) as err:
                    row = {"method": method, "C": int(c), "D": int(tc["dim"]), "b": int(tc["batch_size"])}
                    row.update(status="failed", error=str(err).splitlines()[0])
                row.update(
                    repeat=repeat,
                    profile=profile,
                    device_kind=device_kind,
                    cell_wall_s=time.perf_counter() - t0,
                )
                with records.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(
                    f"[timing] C={c:5d} {method:12s} "
                    + (f"{row['ms_mean']:9.2f} ms/update" if row["status"] == "ok" else row["status"]),
                    flush=True,
                )


def run_traces(cfg: dict[str, Any], folder: Path) -> None:
    tc = cfg["traces"]
    alphas = np.linspace(0.0, 1.0, int(tc["num_points"]))
    table = pd.DataFrame(mechanism.trace_decomposition(float(tc["p_star"]), int(tc["C"]), alphas))
    table.to_csv(folder / "traces.csv", index=False)
    _save_config(folder, "traces", tc)
    gap = np.max(np.abs(table["tau_full_matrix"] - (table["tau_ret"] + table["tau_drop"])))
    print(f"[traces] {len(table)} points, max |tau_full(matrix) - (tau_ret + tau_drop)| = {gap:.2e}")


def run_quality(cfg: dict[str, Any], folder: Path) -> None:
    qc = cfg["quality"]
    c = int(qc["C"])
    t = mechanism.competitor_positions(c, qc["t_spacing"], float(qc["t_low"]), float(qc["t_high"]))
    alphas = np.geomspace(float(qc["alpha_min"]), 1.0, int(qc["num_points"]))
    rows = mechanism.step_quality(
        c, float(qc["p_star"]), float(qc["eta"]), float(qc["beta"]), t, list(qc["damping_scales"]), alphas
    )
    pd.DataFrame(rows).to_csv(folder / "quality.csv", index=False)
    _save_config(folder, "quality", {**qc, "t_values": t.tolist()})
    print(f"[quality] {len(rows)} points, t_j = {np.round(t, 4).tolist()}")


# -- the figure (records only) ------------------------------------------------------------------------------
def timing_ratio_table(per_cell: pd.DataFrame, device: str) -> str:
    """Markdown of panel (a): ms per update per method and C, and the ratios the issue's
    performance targets are about (to Adam, and FGN over SGN)."""
    wide = per_cell.pivot(index="C", columns="method", values="ms_mean").sort_index()
    methods = [m for m in mechanism.METHODS if m in wide]
    lines = [
        f"### FGN Figure 2a: ms per update [{device}]",
        "",
        "| C | "
        + " | ".join(f"{m} (ms)" for m in methods)
        + " | "
        + " | ".join(f"{m} / adam" for m in methods if m != "adam" and "adam" in wide)
        + " | fgn_affine / sgn | fgn_generic / sgn |",
        "|---|" + "---|" * (2 * len(methods) + 1),
    ]
    for c, row in wide.iterrows():
        cells = [f"{row[m]:.2f}" for m in methods]
        if "adam" in wide:
            cells += [f"{row[m] / row['adam']:.3f}" for m in methods if m != "adam"]
        for m in ("fgn_affine", "fgn_generic"):
            cells.append(f"{row[m] / row['sgn']:.3f}" if {m, "sgn"} <= set(wide) else "")
        lines.append(f"| {int(c)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(folder: Path, figures: Path, profile: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    timing_path = folder / "timing.jsonl"
    device = "?"
    if timing_path.exists():
        timing = pd.DataFrame([json.loads(line) for line in timing_path.read_text().splitlines()])
        timing = timing[timing["status"] == "ok"]
        device = ", ".join(sorted(set(timing["device"].astype(str)))) if len(timing) else "?"
        if "clock" in timing and timing["clock"].notna().any():
            device += ", " + "/".join(sorted(set(timing["clock"].dropna().astype(str)))) + " clock"
        if "load_avg_1min" in timing and timing["load_avg_1min"].notna().any():
            device += f", load {timing['load_avg_1min'].min():.1f}-{timing['load_avg_1min'].max():.1f}"
        per_cell = timing.groupby(["method", "C"])["ms_mean"].median().reset_index()
        for method in mechanism.METHODS:
            part = per_cell[per_cell["method"] == method].sort_values("C")
            if part.empty:
                continue
            colour, marker = METHOD_STYLE[method]
            ax.plot(part["C"], part["ms_mean"], marker=marker, color=colour, label=METHOD_LABELS[method])
        per_cell.to_csv(folder / "fig2a_series.csv", index=False)
        ratios = timing_ratio_table(per_cell, device)
        (folder / "fig2a_ratios.md").write_text(ratios)
        tables = figures.parent.parent / "tables"  # results/figures/fgn -> results/tables
        tables.mkdir(parents=True, exist_ok=True)
        (tables / f"fgn_fig2a_{profile}.md").write_text(ratios)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no timing records", ha="center", transform=ax.transAxes)
    ax.set_xlabel("number of classes C")
    ax.set_ylabel("time per update (ms)")
    ax.set_title(f"(a) update time vs C [{device}]", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)

    ax = axes[1]
    traces_path = folder / "traces.csv"
    if traces_path.exists():
        tr = pd.read_csv(traces_path).sort_values("xi")
        ax.plot(tr["xi"], tr["tau_full"], color="black", label=r"$\tau_{full}$ (softmax GGN)")
        ax.plot(tr["xi"], tr["tau_ret"], color="tab:red", label=r"$\tau_{ret}$ (FGN)")
        ax.fill_between(
            tr["xi"],
            tr["tau_ret"],
            tr["tau_full"],
            color="tab:red",
            alpha=0.15,
            label=r"$\tau_{drop}=p_\dagger\xi$",
        )
        ax.legend(fontsize=8)
    ax.set_xlabel(r"dispersion $\xi = 1-\|\rho\|^2$")
    ax.set_ylabel("output-space trace")
    ax.set_title(r"(b) trace decomposition ($p_*=0.6$, C=10)", fontsize=10)
    ax.grid(True, alpha=0.3)

    ax = axes[2]
    quality_path = folder / "quality.csv"
    if quality_path.exists():
        q = pd.read_csv(quality_path)
        for scale, part in q.groupby("s_lambda"):
            part = part.sort_values("xi")
            ax.plot(part["xi"], part["R"], label=rf"$s_\lambda$ = {scale:g}")
        ax.axhline(1.0, color="black", lw=0.8, ls=":")
        ax.legend(fontsize=8)
    ax.set_xlabel(r"dispersion $\xi$")
    ax.set_ylabel(r"$R = \Delta(d_{FGN}) / \Delta(d_{GGN})$")
    ax.set_title(r"(c) step quality ($p_*=0.7$, C=10)", fontsize=10)
    ax.grid(True, alpha=0.3)

    fig.suptitle(f"FGN mechanism checks (Figure 2) — profile: {profile}", fontsize=11)
    fig.tight_layout()
    figures.mkdir(parents=True, exist_ok=True)
    path = figures / f"fig2_{profile}.png"
    fig.savefig(path, dpi=130)
    fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)
    print(f"[plot] {path}")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=["all", "timing", "traces", "quality", "plot"])
    parser.add_argument("--profile", default="quick", choices=["quick", "paper"])
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--force", action="store_true", help="re-time cells that already have records")
    args = parser.parse_args(argv)
    cfg = load_config(args.profile, args.set)
    results = Path(args.results_dir)
    folder = out_dir(results, args.profile)
    if args.part in ("all", "traces"):
        run_traces(cfg, folder)
    if args.part in ("all", "quality"):
        run_quality(cfg, folder)
    if args.part in ("all", "timing"):
        run_timing(cfg, folder, args.profile, args.force)
    if args.part in ("all", "plot"):
        plot(folder, results / "figures" / "fgn", args.profile)


if __name__ == "__main__":
    main()
