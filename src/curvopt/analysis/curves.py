"""Curve analysis shared by the papers' figures and tables: align runs on a common axis,
average seeds, time-to-threshold."""

from __future__ import annotations

import numpy as np
import pandas as pd


def mean_curve_on_grid(
    runs: pd.DataFrame, x: str, y: str, num_points: int = 200, run_col: str = "run_id"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Interpolate every run's ``y(x)`` linearly onto a common grid over
    ``[0, min over runs of max x]`` and return ``(grid, mean, std)``.

    Rows where ``y`` is missing (steps without evaluation) are skipped; a run with fewer than two
    points is ignored. Empty arrays when nothing is left.
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
    """First ``x`` at which ``y`` reaches ``threshold`` (``mode='min'``: y ≤ threshold, e.g. a loss;
    ``'max'``: y ≥ threshold, e.g. accuracy), linearly interpolated between logged points;
    ``nan`` if never reached."""
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
