"""Curve analysis shared by the papers' figures and tables.

Align runs on a common axis, average seeds, time-to-threshold.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def mean_curve_on_grid(
    runs: pd.DataFrame, x: str, y: str, num_points: int = 200, run_col: str = "run_id"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Interpolate every run's ``y(x)`` linearly onto a common grid and average over runs.

    The grid spans the range every run covers: from the largest first ``x`` to the smallest last
    ``x`` over runs (one point when that range is empty). Rows where ``y`` is missing or not
    finite (steps without evaluation) are skipped; a run with fewer than two points is ignored.

    Args:
        runs: Long frame of metrics rows of several runs.
        x: Column of the axis (e.g. ``algo_time_s``).
        y: Column of the value (e.g. ``val/loss``).
        num_points: Grid size.
        run_col: Column identifying the run.

    Returns:
        ``(grid, mean, std)`` (population std over runs); empty arrays when nothing is left.
    """
    curves = []
    for _, run in runs.groupby(run_col):
        pts = run[[x, y]].dropna().sort_values(x)
        pts = pts[np.isfinite(pts[y].to_numpy(dtype=float))]
        if len(pts) >= 2:
            curves.append((pts[x].to_numpy(dtype=float), pts[y].to_numpy(dtype=float)))
    if not curves:
        empty = np.array([])
        return empty, empty, empty
    end = min(c[0][-1] for c in curves)
    start = max(c[0][0] for c in curves)
    grid = np.linspace(start, end, num_points) if end > start else np.array([start])
    values = np.stack([np.interp(grid, cx, cy) for cx, cy in curves])
    return grid, values.mean(axis=0), values.std(axis=0)


def time_to_threshold(x: np.ndarray, y: np.ndarray, threshold: float, mode: str = "min") -> float:
    """First ``x`` at which ``y`` reaches ``threshold``, linearly interpolated between logged points.

    Args:
        x: Axis values, increasing.
        y: Curve values.
        threshold: The level to reach.
        mode: ``"min"``: y ≤ threshold (e.g. a loss); ``"max"``: y ≥ threshold (e.g. accuracy).

    Returns:
        The crossing ``x``, ``x[0]`` if already reached there, ``nan`` if never reached.
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    hit = y <= threshold if mode == "min" else y >= threshold
    if not hit.any():
        return float("nan")
    i = int(np.argmax(hit))
    if i == 0:
        return float(x[0])
    x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
    if y1 == y0:
        return float(x1)
    return float(x0 + (threshold - y0) * (x1 - x0) / (y1 - y0))


# -- per-run curves on a shared axis (FGN Figure 3 / Table 1; reusable by the other papers) ----------
def run_curves(
    runs: pd.DataFrame, x: str, y: str, run_col: str = "run_id"
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-run curves of a metrics frame, sorted by ``x``.

    Only rows where both values are finite are kept (the evaluation rows of a metrics table);
    runs with fewer than two such rows are dropped.

    Args:
        runs: Long frame of metrics rows.
        x: Column of the axis.
        y: Column of the value.
        run_col: Column identifying the run.

    Returns:
        ``{run: (x, y)}`` arrays (empty when a column is missing).
    """
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if runs.empty or x not in runs or y not in runs:
        return out
    for run, frame in runs.groupby(run_col):
        pts = frame[[x, y]].apply(pd.to_numeric, errors="coerce").dropna().sort_values(x)
        xs, ys = pts[x].to_numpy(dtype=float), pts[y].to_numpy(dtype=float)
        keep = np.isfinite(xs) & np.isfinite(ys)
        if keep.sum() >= 2:
            out[str(run)] = (xs[keep], ys[keep])
    return out


def curves_on_grid(
    curves: dict[str, tuple[np.ndarray, np.ndarray]], grid: np.ndarray, hold_last: bool = False
) -> np.ndarray:
    """Linear interpolation of every run onto ``grid``: shape ``(runs, len(grid))``.

    Outside a run's own range the value is ``nan`` (no extrapolation), or with ``hold_last`` the
    run's last value beyond its end (a run that has stopped keeps its final quality).

    Args:
        curves: ``{run: (x, y)}`` from :func:`run_curves`.
        grid: Points to evaluate at.
        hold_last: Hold each run's last value past its end.

    Returns:
        Array of shape ``(runs, len(grid))``.
    """
    grid = np.asarray(grid, dtype=float)
    rows = []
    for xs, ys in curves.values():
        row = np.interp(grid, xs, ys)
        row[grid < xs[0]] = np.nan
        if not hold_last:
            row[grid > xs[-1]] = np.nan
        rows.append(row)
    return np.stack(rows) if rows else np.empty((0, grid.size))


def run_ends(curves: dict[str, tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Last ``x`` of every run (e.g. each run's total algorithm time).

    Args:
        curves: ``{run: (x, y)}`` from :func:`run_curves`.

    Returns:
        One value per run.
    """
    return np.array([xs[-1] for xs, _ in curves.values()], dtype=float)


def shared_horizon(ends_by_group: dict[str, np.ndarray], rule: str = "min_run_end") -> float:
    """Common comparison horizon of several methods' runs.

    Args:
        ends_by_group: Method → end ``x`` of each of its runs (:func:`run_ends`).
        rule: ``"min_run_end"``: the earliest end of any run (every run is observed up to it,
            nothing is extrapolated); ``"min_mean_end"``: the smallest per-method mean end time
            (the other reading of the FGN paper's "shared horizon", docs/decisions.md, FGN-4;
            runs ending earlier hold their last value).

    Returns:
        The horizon.

    Raises:
        ValueError: If there are no runs or the rule is unknown.
    """
    groups = [np.asarray(v, dtype=float) for v in ends_by_group.values() if len(v)]
    if not groups:
        raise ValueError("no runs to define a horizon")
    if rule == "min_run_end":
        return float(min(g.min() for g in groups))
    if rule == "min_mean_end":
        return float(min(g.mean() for g in groups))
    raise ValueError(f"unknown horizon rule {rule!r}; choose min_run_end or min_mean_end")


def mean_std(values: np.ndarray, ddof: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std over runs (axis 0), ignoring ``nan``.

    Args:
        values: ``(runs, points)`` array.
        ddof: Delta degrees of freedom of the std (0 = population).

    Returns:
        ``(mean, std)`` per point.
    """
    values = np.asarray(values, dtype=float)
    count = np.sum(np.isfinite(values), axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.nanmean(values, axis=0) if values.size else np.array([])
        centred = np.where(np.isfinite(values), values - mean, 0.0)
        var = np.sum(centred**2, axis=0) / np.maximum(count - ddof, 1)
    return mean, np.sqrt(var)


def value_at(
    curves: dict[str, tuple[np.ndarray, np.ndarray]], t: float, hold_last: bool = True, ddof: int = 0
) -> tuple[float, float, int]:
    """Mean and std over runs of the interpolated values at ``x = t``.

    Args:
        curves: ``{run: (x, y)}`` from :func:`run_curves`.
        t: The point.
        hold_last: Runs that ended before ``t`` count with their last value.
        ddof: Delta degrees of freedom of the std.

    Returns:
        ``(mean, std, number of runs with a value)``; NaNs and 0 when none has one.
    """
    values = curves_on_grid(curves, np.array([t]), hold_last=hold_last)[:, 0]
    values = values[np.isfinite(values)]
    if values.size == 0:
        return float("nan"), float("nan"), 0
    mean, std = mean_std(values[:, None], ddof)
    return float(mean[0]), float(std[0]), int(values.size)
