"""Shared curve analysis: seed averaging on a common grid, time-to-threshold."""

import numpy as np
import pandas as pd

from curvopt.analysis.curves import mean_curve_on_grid, time_to_threshold


def test_mean_curve_on_grid_averages_interpolated_runs():
    a = pd.DataFrame({"run_id": "a", "t": [0.0, 1.0, 2.0], "err": [4.0, 2.0, 1.0]})
    b = pd.DataFrame({"run_id": "b", "t": [0.0, 2.0, 4.0], "err": [2.0, 2.0, 0.0]})
    grid, mean, std = mean_curve_on_grid(pd.concat([a, b]), "t", "err", num_points=3)
    np.testing.assert_allclose(grid, [0.0, 1.0, 2.0])  # common range ends at the shorter run
    np.testing.assert_allclose(mean, [3.0, 2.0, 1.5])
    np.testing.assert_allclose(std, [1.0, 0.0, 0.5])


def test_mean_curve_skips_rows_without_the_metric():
    df = pd.DataFrame({"run_id": "a", "t": [0.0, 0.5, 1.0], "err": [2.0, None, 1.0]})
    grid, mean, _ = mean_curve_on_grid(df, "t", "err", num_points=2)
    np.testing.assert_allclose(mean, [2.0, 1.0])


def test_time_to_threshold_interpolates():
    t = np.array([0.0, 10.0, 20.0])
    acc = np.array([0.1, 0.3, 0.5])
    assert np.isclose(time_to_threshold(t, acc, 0.4, mode="max"), 15.0)
    assert np.isnan(time_to_threshold(t, acc, 0.9, mode="max"))
    assert time_to_threshold(t, np.array([3.0, 2.0, 1.0]), 2.5, mode="min") == 5.0
    assert time_to_threshold(t, acc, 0.05, mode="max") == 0.0
