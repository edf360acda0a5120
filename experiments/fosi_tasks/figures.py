"""FOSI Figures 2, 5 and 6 from run records (styles of the paper: Adam blue, HB orange, base dashed,
FOSI solid; Figure 6: FOSI-HB orange, K-FAC red, L-BFGS green)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from experiments.fosi_tasks.analysis import (  # noqa: E402
    LABELS,
    MAIN_OPTIMIZERS,
    Task,
    best_kfac,
    best_lbfgs,
    eval_curve,
    status_of,
    train_curve,
)

STYLE = {
    "adam": ("tab:blue", "--"),
    "fosi_adam": ("tab:blue", "-"),
    "heavy_ball": ("tab:orange", "--"),
    "fosi_heavy_ball": ("tab:orange", "-"),
    "kfac": ("tab:red", "-"),
    "lbfgs": ("tab:green", "-"),
}
# Figure 6 caption: what the paper leaves out, and why.
PAPER_OMISSIONS = {
    ("ae", "lbfgs"): "L-BFGS diverges in the first epoch for every L",
    ("tl", "lbfgs"): "L-BFGS very poor and 8x slower",
    ("lm", "kfac"): "K-FAC does not support the LSTM",
}
# Omissions whose reason is divergence: they apply only when our run diverged too; a run of ours
# that did not diverge is drawn (the figure shows what happened here, the note what the paper says).
OMITTED_FOR_DIVERGING = {("ae", "lbfgs")}


def _label(key: str, rows: pd.DataFrame | None = None) -> str:
    base = key.split("_L")[0] if key.startswith("lbfgs") else key.split("_lr")[0]
    label = LABELS.get(base, key)
    if key.startswith("lbfgs") and "_L" in key:
        label += f" (L={key.split('_L')[1]})"
    if rows is not None and status_of(rows) == "diverged":
        label += " — diverged"
    return label


def provenance(runs: dict[str, pd.DataFrame], profile: str) -> str:
    """What a figure's curves come from: ``profile paper · cpu · seed 0 · process clock, 1 thread``.

    Args:
        runs: The figure's runs (record frames with the loop's ``device``, ``seed``, ``clock`` and
            ``num_threads`` columns where the records have them).
        profile: The profile drawn.

    Returns:
        One line for the figure's title.
    """

    def values(col: str) -> list[str]:
        seen: list[str] = []
        for rows in runs.values():
            if col in rows:
                for v in rows[col].dropna().unique():
                    text = str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)
                    if text not in seen:
                        seen.append(text)
        return seen

    parts = [f"profile {profile}"]
    devices = [d for d in values("device") if d != "auto"]  # "auto": a config value, not a device
    if devices:
        parts.append("/".join(devices))
    seeds = values("seed")
    if seeds:
        parts.append(f"seed{'s' if len(seeds) > 1 else ''} {','.join(seeds)}")
    clock = "/".join(values("clock"))
    if clock:
        threads = "/".join(values("num_threads"))
        parts.append(
            f"{clock} clock" + (f", {threads} thread{'s' if threads != '1' else ''}" if threads else "")
        )
    return " · ".join(parts)


def _plot(
    ax, curve: pd.DataFrame, x: str, y: str, key: str, label: str, style_key: str | None = None
) -> None:
    color, ls = STYLE.get(style_key or key, ("black", "-"))
    if curve.empty:
        ax.plot([], [], color=color, ls=ls, label=label + " (no points)")
        return
    ax.plot(curve[x], curve[y], color=color, ls=ls, label=label, marker="." if len(curve) < 30 else None)


def _zoom_past_start(ax, share: float = 0.05, ratio: float = 3.0) -> None:
    """Cut the y-axis to what the curves do after the first ``share`` of the x-range, when the
    start (an untrained model's loss) is over ``ratio`` times higher and would flatten the rest."""
    xs, ys = [], []
    for line in ax.get_lines():
        x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
        ok = np.isfinite(x) & np.isfinite(y)
        xs.append(x[ok])
        ys.append(y[ok])
    if not xs or not any(len(x) for x in xs):
        return
    lo_x, hi_x = min(x.min() for x in xs if len(x)), max(x.max() for x in xs if len(x))
    cut = lo_x + share * (hi_x - lo_x)
    late = np.concatenate([y[x >= cut] for x, y in zip(xs, ys)])
    every = np.concatenate(ys)
    if late.size == 0 or late.max() <= 0 or every.max() <= ratio * late.max():
        return
    pad = 0.05 * (late.max() - late.min()) or 0.05 * abs(late.max())
    ax.set_ylim(late.min() - pad, late.max() + pad)


def _mark_divergence(ax, rows: pd.DataFrame, curve: pd.DataFrame, x: str, y: str, key: str) -> None:
    if status_of(rows) == "diverged" and not curve.empty:
        color, _ = STYLE.get(key, ("black", "-"))
        ax.plot(curve[x].iloc[-1], curve[y].iloc[-1], marker="x", ms=10, color=color)


def figure5(task: Task, runs: dict[str, pd.DataFrame], profile: str, clock: str, out: Path) -> Path:
    """Train loss vs epoch (iteration for LM), train loss vs time, validation loss vs epoch."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    xlab = "iteration" if task.key == "lm" else "epoch"
    xcol = "step" if task.key == "lm" else "epoch"
    for key in MAIN_OPTIMIZERS:
        rows = runs.get(key)
        if rows is None:
            continue
        tc = train_curve(rows, task, clock)
        vc = eval_curve(rows, task.val_loss, clock, task.val_loss_scale)
        label = _label(key, rows)
        _plot(axes[0], tc, xcol, "loss", key, label)
        _plot(axes[1], tc, "time", "loss", key, label)
        _plot(axes[2], vc, xcol, "value", key, label)
        _mark_divergence(axes[0], rows, tc, xcol, "loss", key)
    axes[0].set(xlabel=xlab, ylabel="train loss")
    axes[1].set(xlabel=f"{clock} time (s)", ylabel="train loss")
    axes[2].set(xlabel=xlab, ylabel="validation loss")
    if task.fig5_ymax is not None:  # the paper's y upper limits
        for ax in axes:
            lo, hi = ax.get_ylim()
            if hi > task.fig5_ymax > lo:
                ax.set_ylim(lo, task.fig5_ymax)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"FOSI Figure 5 — {task.title}\n{provenance(runs, profile)}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def figure2(task: Task, runs: dict[str, pd.DataFrame], profile: str, clock: str, out: Path) -> Path:
    """AC: train loss and validation accuracy (hit rate) against time."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key in MAIN_OPTIMIZERS:
        rows = runs.get(key)
        if rows is None:
            continue
        label = _label(key, rows)
        _plot(axes[0], train_curve(rows, task, clock), "time", "loss", key, label)
        _plot(axes[1], eval_curve(rows, task.val_metric, clock), "time", "value", key, label)
    axes[0].set(xlabel=f"{clock} time (s)", ylabel="train loss")
    axes[1].set(xlabel=f"{clock} time (s)", ylabel="validation accuracy (hit rate)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"FOSI Figure 2 — {task.title}\n{provenance(runs, profile)}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def figure6(
    task: Task,
    runs: dict[str, pd.DataFrame],
    profile: str,
    clock: str,
    out: Path,
    paper_omissions: bool = True,
) -> tuple[Path, list[str]]:
    """FOSI-HB vs K-FAC vs L-BFGS (best L): train and validation loss against time. A method that
    diverged is left out (with the reason in the title), as are the paper's omissions, except one
    the paper made because the method diverged when ours did not (that run is drawn)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    notes: list[str] = []
    chosen = {
        "fosi_heavy_ball": "fosi_heavy_ball",
        "kfac": best_kfac(runs, task),
        "lbfgs": best_lbfgs(runs, task),
    }
    for method, key in chosen.items():
        if key is None:
            if (task.key, method) in PAPER_OMISSIONS:
                notes.append(f"{LABELS[method]} omitted: {PAPER_OMISSIONS[(task.key, method)]}")
            continue
        rows = runs.get(key)
        if rows is None:
            continue
        if status_of(rows) == "diverged":
            notes.append(f"{_label(key)} diverged (omitted)")
            continue
        if paper_omissions and (task.key, method) in PAPER_OMISSIONS:
            reason = PAPER_OMISSIONS[(task.key, method)]
            if (task.key, method) not in OMITTED_FOR_DIVERGING:
                notes.append(f"{_label(key)} omitted as in the paper: {reason}")
                continue
            notes.append(f"{_label(key)} drawn: the paper omits it ({reason}); ours did not diverge")
        label = _label(key, rows)
        _plot(axes[0], train_curve(rows, task, clock), "time", "loss", key, label, method)
        _plot(
            axes[1],
            eval_curve(rows, task.val_loss, clock, task.val_loss_scale),
            "time",
            "value",
            key,
            label,
            method,
        )
    axes[0].set(xlabel=f"{clock} time (s)", ylabel="train loss")
    axes[1].set(xlabel=f"{clock} time (s)", ylabel="validation loss")
    for ax in axes:
        _zoom_past_start(ax)
    axes[0].legend(fontsize=8)
    title = f"FOSI Figure 6 — {task.title}\n{provenance(runs, profile)}"
    if notes:
        title += "\n" + "; ".join(notes)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out, notes
