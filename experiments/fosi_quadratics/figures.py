"""Draw the FOSI paper's quadratic figures (3, 4, 7, 8, 9) from the run records only.

    python -m experiments.fosi_quadratics.figures all
    python -m experiments.fosi_quadratics.figures fig3 fig4 --results-dir results/fosi_quadratics

Reads the records ``run.py`` writes: ``results/fosi_quadratics/<experiment>/{runs.jsonl,
metrics.parquet}`` (the packed layout, ``curvopt.analysis.pack``) or ``<experiment>/<run>/{summary.json,
metrics.jsonl}``, and writes PNGs to ``results/figures/fosi/``, plus ``quadratics_values.csv`` with the
numbers quoted in docs/fosi.md (f(θ₂₀₀) of every Fig. 3 curve; f at 0/200/250 for Fig. 4).
Styles follow the paper: Adam blue, HB orange, GD red; base dashed, FOSI solid.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from curvopt.analysis.pack import packed_run_frame, read_packed_runs  # noqa: E402
from curvopt.training.records import read_metrics  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIGURES = ("fig3", "fig4", "fig7", "fig8", "fig7_robustness", "fig9")
ROBUSTNESS_RECORD = "start_point_robustness.json"  # robustness.py writes it
COLORS = {"adam": "tab:blue", "hb": "tab:orange", "gd": "tab:red"}
ORDER = ("adam", "fosi_adam", "hb", "fosi_hb", "gd", "fosi_gd")
LABELS = {
    "adam": "Adam",
    "fosi_adam": "FOSI-Adam",
    "hb": "HB",
    "fosi_hb": "FOSI-HB",
    "gd": "GD",
    "fosi_gd": "FOSI-GD",
    "fosi_hb_c1": "FOSI-HB (c=1)",
    "fosi_hb_cinf": "FOSI-HB (c=∞)",
    "fosi_gd_c1": "FOSI-GD (c=1)",
    "fosi_gd_cinf": "FOSI-GD (c=∞)",
}
MARKED = ((1.12, 90), (1.16, 90), (1.12, 50), (1.16, 50))


def _num(x: Any) -> float:
    """A logged value as float; the recorder writes non-finite numbers as strings."""
    return float(x) if x is not None else math.nan


def _as_inf(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def load_summaries(results: Path, experiment: str) -> list[dict[str, Any]]:
    folder = results / experiment
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no records at {folder}; run `python -m experiments.fosi_quadratics.run all` first"
        )
    packed = {e["run_id"]: e for e in read_packed_runs(folder)}  # the packed layout wins
    out = []
    for run_id in sorted(packed.keys() | {p.parent.name for p in folder.glob("*/summary.json")}):
        if run_id in packed:
            summary = dict(packed[run_id]["summary"])
            summary["_packed"] = packed[run_id]
        else:
            summary = json.loads((folder / run_id / "summary.json").read_text())
        summary["_dir"] = folder / run_id
        out.append(summary)
    return out


def curve(summary: dict[str, Any], column: str = "f") -> np.ndarray:
    if "_packed" in summary:
        values = packed_run_frame(summary["_dir"].parent, summary["_packed"])[column].tolist()
    else:
        values = [r[column] for r in read_metrics(summary["_dir"] / "metrics.jsonl")]
    return np.array([_num(x) for x in values], dtype=np.float64)


def _style(name: str) -> dict[str, Any]:
    base = name.replace("fosi_", "")
    return {
        "color": COLORS[base],
        "linestyle": "-" if name.startswith("fosi") else "--",
        "label": LABELS[name],
    }


def _save(fig: plt.Figure, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path


def fig3(results: Path, out_dir: Path) -> tuple[Path, list[dict[str, Any]]]:
    runs = load_summaries(results, "q1_fig3")
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5), sharex=True)
    values = []
    for r, n in enumerate((100, 1500)):
        for c, lam1 in enumerate((5, 200)):
            ax = axes[r, c]
            for name in ORDER:
                (s,) = [
                    x
                    for x in runs
                    if x["setting"]["n"] == n
                    and x["setting"]["lambda1"] == lam1
                    and x["setting"]["optimizer"] == name
                ]
                f = curve(s)
                ax.plot(np.arange(len(f)), f, **_style(name))
                values.append(
                    {
                        "figure": 3,
                        "n": n,
                        "lambda1": lam1,
                        "optimizer": LABELS[name],
                        "iteration": 200,
                        "f": f[200],
                    }
                )
            ax.set_yscale("log")
            ax.set_title(f"n = {n}, λ₁ = {lam1}")
            ax.grid(alpha=0.3)
            if c == 0:
                ax.set_ylabel("f(θ)")
            if r == 1:
                ax.set_xlabel("iteration")
    axes[0, 0].legend(ncol=3, fontsize=8)
    fig.suptitle("FOSI Fig. 3: quadratics with a random basis (profile: paper)")
    return _save(fig, out_dir, "fig3_quadratic_dimension_spectrum.png"), values


def fig4(results: Path, out_dir: Path) -> tuple[Path, list[dict[str, Any]]]:
    runs = {s["setting"]["optimizer"]: s for s in load_summaries(results, "q2_fig4")}
    fig, ax = plt.subplots(figsize=(6, 4))
    values = []
    for name in ("gd", "fosi_gd"):
        f = curve(runs[name])
        ax.plot(np.arange(len(f)), f, **_style(name))
        for it in (0, 200, 250):
            values.append({"figure": 4, "optimizer": LABELS[name], "iteration": it, "f": f[it]})
    ax.set_xlabel("iteration")
    ax.set_ylabel("f(θ)")
    kappa = runs["fosi_gd"]["setting"]
    ax.set_title(
        f"FOSI Fig. 4: κ = {kappa['condition_number']:.0f}, FOSI-GD κ̃ = {kappa['effective_condition_number']:.0f}"
    )
    ax.set_yticks([0, 5, 10, 15])
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out_dir, "fig4_gd_vs_fosi_gd.png"), values


def _q3_table(results: Path) -> dict[str, dict[tuple[float, int], dict[str, Any]]]:
    table: dict[str, dict[tuple[float, int], dict[str, Any]]] = {}
    for s in load_summaries(results, "q3_fig7_fig8"):
        st = s["setting"]
        table.setdefault(st["optimizer"], {})[(round(st["b"], 3), int(st["zeta"]))] = s
    return table


def fig7(results: Path, out_dir: Path) -> Path:
    table = _q3_table(results)
    keys = table["gd"].keys()
    bs = sorted({b for b, _ in keys if b >= 1.1 - 1e-9})
    zetas = sorted({z for _, z in keys if z >= 30})
    levels = {"adam": (-9, 2), "hb": (-12, -1), "gd": (-8, 3)}
    fig, axes = plt.subplots(3, 2, figsize=(10, 11), sharex=True, sharey=True)
    for r, base in enumerate(("adam", "hb", "gd")):
        lo, hi = levels[base]
        lv = 2.0 ** np.arange(lo, hi + 1)
        for c, name in enumerate((base, f"fosi_{base}")):
            Z = np.array([[_as_inf(_num(table[name][(b, z)]["f_final"])) for b in bs] for z in zetas])
            ax = axes[r, c]
            cs = ax.contourf(
                bs,
                zetas,
                np.clip(Z, lv[0], lv[-1]),
                levels=lv,
                norm=matplotlib.colors.LogNorm(),
                cmap="viridis",
            )
            for b, z in MARKED:
                ax.plot(b, z, "kx", markersize=8, mew=2)
            ax.set_title(f"{LABELS[name]}: f(θ₂₀₀)")
            if r == 2:
                ax.set_xlabel("b (condition number grows with b)")
            if c == 0:
                ax.set_ylabel("ζ (rotated block size)")
            fig.colorbar(cs, ax=ax, ticks=lv[::2], format=matplotlib.ticker.LogFormatterMathtext(base=2))
    fig.suptitle("FOSI Fig. 7: f_{b,ζ}(θ₂₀₀), base vs FOSI (profile: paper)")
    return _save(fig, out_dir, "fig7_kappa_zeta_contours.png")


def fig8(results: Path, out_dir: Path) -> Path:
    table = _q3_table(results)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5), sharex=True)
    for ax, (b, z) in zip(axes.flat, MARKED):
        for name in ORDER:
            f = curve(table[name][(round(b, 3), z)])
            ax.plot(np.arange(len(f)), f, **_style(name))
        ax.set_yscale("log")
        ax.set_title(f"f_{{{b},{z}}}")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("iteration")
    axes[0, 0].legend(ncol=3, fontsize=8)
    fig.suptitle("FOSI Fig. 8: learning curves at the marked (b, ζ) (profile: paper)")
    return _save(fig, out_dir, "fig8_kappa_zeta_curves.png")


def load_robustness(results: Path) -> dict[str, Any]:
    """The start-point robustness record of Figs 7-8 (``robustness.py``)."""
    path = results / ROBUSTNESS_RECORD
    if not path.is_file():
        raise FileNotFoundError(
            f"no record at {path}; run `python -m experiments.fosi_quadratics.robustness` first"
        )
    return json.loads(path.read_text())


def fig7_robustness(results: Path, out_dir: Path) -> Path:
    """Beside Fig. 7: per (b, ζ) the share of random eigenvector-sign start points in which
    FOSI-Adam ends at or below Adam (left), and the worst f ratio FOSI-Adam / Adam over the draws
    (right); x: the cells that fail from the recorded start (eigh's signs); the dashed line is
    the lower edge of the paper's plot (ζ ≥ 30)."""
    rec = load_robustness(results)
    cells = rec["cells"]
    bs = sorted({c["b"] for c in cells})
    zetas = sorted({c["zeta"] for c in cells})
    by = {(c["b"], c["zeta"]): c for c in cells}
    share = np.array([[by[(b, z)]["share_fosi_le_adam"] for b in bs] for z in zetas])
    worst = np.array([[by[(b, z)]["ratio_max"] for b in bs] for z in zetas])
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.5), sharey=True)
    panels = (
        (share, "FOSI-Adam ≤ Adam: share of sign draws", {"cmap": "RdYlGn", "vmin": 0.0, "vmax": 1.0}),
        (
            worst,
            "worst f(θ₂₀₀) ratio FOSI-Adam / Adam over the draws",
            {"cmap": "RdBu_r", "norm": matplotlib.colors.LogNorm(vmin=0.25, vmax=4.0)},  # white: 1
        ),
    )
    fail_x = [bs.index(c["b"]) for c in cells if c["eigh_signs_fails"]]
    fail_y = [zetas.index(c["zeta"]) for c in cells if c["eigh_signs_fails"]]
    for ax, (Z, title, kw) in zip(axes, panels):
        im = ax.imshow(Z, origin="lower", aspect="auto", interpolation="nearest", **kw)
        ax.plot(fail_x, fail_y, "kx", markersize=6, mew=1.5, label="fails from the recorded θ₀")
        ax.axhline(sum(z < 30 for z in zetas) - 0.5, color="k", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(bs)))
        ax.set_xticklabels([f"{b:.3f}" for b in bs], rotation=90, fontsize=7)
        ax.set_yticks(range(len(zetas)))
        ax.set_yticklabels([str(z) for z in zetas], fontsize=7)
        ax.set_xlabel("b")
        ax.set_title(title, fontsize=10)
        cb = fig.colorbar(im, ax=ax, fraction=0.046)
        if "norm" in kw:
            cb.set_ticks([0.25, 0.5, 1.0, 2.0, 4.0], labels=["≤ 0.25", "0.5", "1", "2", "≥ 4"])
            cb.minorticks_off()
    axes[0].set_ylabel("ζ (rotated block size); paper's Fig. 7 shows ζ ≥ 30 (above the dashed line)")
    axes[0].legend(loc="lower left", fontsize=8)
    st = rec["settings"]
    fig.suptitle(
        f"FOSI Figs 7-8, start-point robustness: {st['draws_per_cell']} random eigenvector-sign "
        f"draws per cell (seed {st['sign_seed']}), Adam η = {st['adam_lr']}, 200 iterations"
    )
    return _save(fig, out_dir, "fig7_start_point_robustness.png")


def fig9(results: Path, out_dir: Path) -> Path:
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    ylim = (1e-3, 450.0)
    top = ylim[1] * 10  # NaN / +∞ drawn above the axis, as the paper treats them as +∞

    def sweep(experiment: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        runs: dict[str, list[tuple[float, float]]] = {}
        for s in load_summaries(results, experiment):
            st = s["setting"]
            runs.setdefault(st["optimizer"], []).append((st["eta"], _as_inf(_num(s["f_final"]))))
        return {k: tuple(np.array(v).T) for k, v in ((k, sorted(v)) for k, v in runs.items())}

    def draw(ax: plt.Axes, data: dict, names: tuple[str, ...]) -> None:
        for name in names:
            eta, f = data[name]
            f = np.where(np.isfinite(f), f, top)
            if not name.startswith("fosi"):
                kw = {"color": "black", "linestyle": "--", "label": LABELS[name]}
            else:
                base = "adam" if "adam" in name else ("hb" if "hb" in name else "gd")
                kw = {
                    "color": COLORS[base],
                    "linestyle": "-." if name.endswith("_c1") else "-",
                    "label": LABELS[name],
                }
            ax.plot(eta, f, **kw)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(*ylim)
        ax.set_xlabel("η")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    lr = sweep("q4_fig9_lr")
    draw(axes[0, 0], lr, ("adam", "fosi_adam"))
    draw(axes[0, 1], lr, ("hb", "fosi_hb_c1", "fosi_hb_cinf"))
    draw(axes[0, 2], lr, ("gd", "fosi_gd_c1", "fosi_gd_cinf"))
    axes[0, 0].set_ylabel("f_{1.12,90}(θ₂₀₀), momentum 0.9")
    mom = sweep("q4_fig9_momentum")
    draw(axes[1, 0], mom, ("adam", "fosi_adam"))
    draw(axes[1, 1], mom, ("hb", "fosi_hb_c1", "fosi_hb_cinf"))
    axes[1, 0].set_ylabel("f_{1.12,90}(θ₂₀₀), best momentum in [0.7, 1)")
    axes[1, 2].axis("off")
    fig.suptitle("FOSI Fig. 9: learning-rate (top) and momentum (bottom) sweeps (profile: paper)")
    with np.errstate(over="ignore"):  # log-axis transform of the +∞ stand-ins
        return _save(fig, out_dir, "fig9_lr_momentum.png")


def write_values(rows: list[dict[str, Any]], out_dir: Path) -> Path:
    path = out_dir / "quadratics_values.csv"
    keys = ["figure", "n", "lambda1", "optimizer", "iteration", "f"]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in keys})
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("figures", nargs="+", choices=[*FIGURES, "all"])
    parser.add_argument("--results-dir", type=Path, default=REPO / "results" / "fosi_quadratics")
    parser.add_argument("--out-dir", type=Path, default=REPO / "results" / "figures" / "fosi")
    args = parser.parse_args(argv)
    chosen = FIGURES if "all" in args.figures else tuple(dict.fromkeys(args.figures))
    values: list[dict[str, Any]] = []
    for name in chosen:
        result = globals()[name](args.results_dir, args.out_dir)
        if isinstance(result, tuple):
            path, rows = result
            values += rows
        else:
            path = result
        print(f"{name}: {path}")
    if values:
        print(f"values: {write_values(values, args.out_dir)}")
        for row in values:
            where = f"n={row['n']} λ₁={row['lambda1']}" if row["figure"] == 3 else ""
            print(
                f"  Fig {row['figure']} {where:>16} {row['optimizer']:>10} f(θ_{row['iteration']}) = {row['f']:.4e}"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
