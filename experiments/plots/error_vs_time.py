"""Error against algorithm time, train dotted and test solid (the SHF paper's Figure 2 style).

Reads only run records (via :mod:`curvopt.analysis.records`); writes the PNG and the plotted
data as CSV next to it so every drawn point can be checked.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from curvopt.analysis.records import load_runs  # noqa: E402
from experiments.plots.common import save_with_csv  # noqa: E402


def plot_error_vs_time(
    frames: dict[str, pd.DataFrame],
    metric: str = "E_sq",
    out_path: Path | None = None,
    title: str = "",
    splits: tuple[str, ...] = ("train", "test"),
    logy: bool = True,
) -> Path | None:
    """Draw error against algorithm time, one panel per entry of ``frames``.

    Args:
        frames: Panel title → long frame of runs (:func:`~curvopt.analysis.records.load_runs`).
        metric: Metric name; columns ``<split>/<metric>`` are plotted.
        out_path: PNG path; ``None`` draws without saving.
        title: Figure title.
        splits: Splits to draw (train dotted, val dashed, test solid).
        logy: Logarithmic y axis.

    Returns:
        The PNG path (with the CSV of the plotted points next to it), or ``None`` without
        ``out_path``.
    """
    styles = {"train": ":", "val": "--", "test": "-"}
    fig, axes = plt.subplots(1, len(frames), figsize=(5.2 * len(frames), 4.2), squeeze=False)
    colours: dict[str, str] = {}
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    plotted = []
    for ax, (panel, df) in zip(axes[0], frames.items()):
        if df.empty:
            ax.text(0.5, 0.5, "no runs", ha="center", va="center", transform=ax.transAxes)
            ax.set_title(panel)
            continue
        for (optimizer, run_id), run in df.groupby(["optimizer", "run_id"], sort=True):
            colour = colours.setdefault(optimizer, palette[len(colours) % len(palette)])
            status = run["status"].iloc[0]
            for split in splits:
                col = f"{split}/{metric}"
                if col not in run:
                    continue
                pts = run[["algo_time_s", col]].dropna()
                label = f"{optimizer} {split}" + (f" ({status})" if status != "completed" else "")
                ax.plot(pts["algo_time_s"], pts[col], styles[split], color=colour, label=label, lw=1.4)
                plotted.append(
                    pts.assign(
                        panel=panel, optimizer=optimizer, run_id=run_id, split=split, metric=metric
                    ).rename(columns={col: "value"})
                )
        ax.set_xlabel("algorithm time [s]")
        ax.set_ylabel(f"{metric} (reconstruction error)" if metric in ("E_sq", "f") else metric)
        if logy:
            ax.set_yscale("log")
        ax.set_title(panel)
        ax.grid(alpha=0.3, which="both")
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    if out_path is None:
        return None
    return save_with_csv(fig, out_path, plotted)


def main() -> None:
    """Command line: ``--experiment`` names (one panel each), ``--metric``, ``--out``, ``--title``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--experiment", required=True, nargs="+", help="experiment name(s); one panel each")
    parser.add_argument("--metric", default="E_sq")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    frames = {exp: load_runs(args.results_dir, exp) for exp in args.experiment}
    profiles = sorted({p for df in frames.values() if not df.empty for p in df["profile"].dropna().unique()})
    title = args.title or f"Error vs algorithm time — profile: {', '.join(profiles) or 'n/a'}"
    path = plot_error_vs_time(frames, args.metric, Path(args.out), title)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
