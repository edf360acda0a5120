"""Shared curve helpers (curvopt.analysis.curves) and the FGN Figure 3 / Table 1 analysis,
on hand-made run records whose answers are known."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from curvopt.analysis.curves import (
    curves_on_grid,
    mean_std,
    run_curves,
    run_ends,
    shared_horizon,
    value_at,
)
from experiments.fgn import cars196


def _frame(run: str, t: list[float], acc: list[float | None]) -> pd.DataFrame:
    return pd.DataFrame({"run_id": run, "algo_time_s": t, "test/accuracy": acc})


def test_run_curves_keep_evaluation_rows_only():
    df = pd.concat([_frame("a", [0, 1, 2, 3], [0.1, None, 0.3, 0.4]), _frame("b", [0, 5], [0.0, None])])
    curves = run_curves(df, "algo_time_s", "test/accuracy")
    assert list(curves) == ["a"]  # b has a single evaluated point
    np.testing.assert_allclose(curves["a"][0], [0, 2, 3])


def test_curves_on_grid_no_extrapolation_unless_hold_last():
    curves = {
        "a": (np.array([0.0, 2.0]), np.array([0.0, 1.0])),
        "b": (np.array([0.0, 4.0]), np.array([1.0, 3.0])),
    }
    grid = np.array([0.0, 1.0, 3.0])
    v = curves_on_grid(curves, grid)
    np.testing.assert_allclose(v[0], [0.0, 0.5, np.nan])
    np.testing.assert_allclose(v[1], [1.0, 1.5, 2.5])
    held = curves_on_grid(curves, grid, hold_last=True)
    np.testing.assert_allclose(held[0], [0.0, 0.5, 1.0])
    mean, std = mean_std(held)
    np.testing.assert_allclose(mean, [0.5, 1.0, 1.75])
    np.testing.assert_allclose(std, [0.5, 0.5, 0.75])
    _, std1 = mean_std(held, ddof=1)
    np.testing.assert_allclose(std1, np.sqrt(2) * np.array([0.5, 0.5, 0.75]))
    np.testing.assert_allclose(run_ends(curves), [2.0, 4.0])
    assert value_at(curves, 1.0) == (1.0, 0.5, 2)


def test_shared_horizon_rules():
    ends = {"adam": np.array([3.0, 5.0]), "fgn": np.array([4.0, 4.5])}
    assert shared_horizon(ends) == 3.0
    assert shared_horizon(ends, "min_mean_end") == 4.0
    with pytest.raises(ValueError):
        shared_horizon(ends, "max")
    with pytest.raises(ValueError):
        shared_horizon({})


def _write_run(
    root: Path, optimizer: str, seed: int, times: list[float], accs: list[float], losses: list[float]
) -> None:
    run = root / "fgn_cars196" / f"{optimizer}_quick_s{seed}"
    run.mkdir(parents=True)
    rows = []
    for step, (t, a, c) in enumerate(zip(times, accs, losses)):
        rows.append({"step": step * 100, "algo_time_s": t, "test/accuracy": a, "test/loss": c})
        rows.append({"step": step * 100 + 1, "algo_time_s": t + 0.01, "loss": 1.0})  # a non-eval row
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "summary.json").write_text(
        json.dumps({"status": "completed", "synthetic_data": True, "device": "cpu", "optimizer": optimizer})
    )
    cfg = {
        "optimizer": {"name": optimizer},
        "seed": seed,
        "profile": "quick",
        "dataset": {"name": "cars196_synthetic"},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))


@pytest.fixture
def records(tmp_path: Path) -> Path:
    # FGN: accuracy 0 → 0.4 linearly over 2 s (both seeds; offsets ±0.02 for a known std),
    # SGN: 0 → 0.4 over 4 s, Adam: 0 → 0.3 over 1 s and then flat until 3 s.
    for seed, off in ((0, -0.02), (1, 0.02)):
        _write_run(tmp_path, "fgn", seed, [0, 1, 2], [0, 0.2 + off, 0.4 + off], [5, 3, 2])
        _write_run(tmp_path, "sgn", seed, [0, 2, 4], [0, 0.2 + off, 0.4 + off], [5, 3.5, 2.5])
        _write_run(tmp_path, "adam", seed, [0, 1, 3], [0, 0.3, 0.3], [5, 4, 4])
    return tmp_path


def test_table1_from_records(records):
    runs = cars196.select_runs(records, "quick", "cars196_synthetic")
    table, notes = cars196.table1(runs, synthetic=True, thresholds=[0.1, 0.3])
    t = table.set_index("method")
    assert notes["horizon_s"] == 2.0  # earliest end of any run (FGN's)
    assert (
        abs(t.loc["fgn", "acc_at_horizon"] - 40.0) < 1e-9
        and abs(t.loc["fgn", "acc_at_horizon_std"] - 2.0) < 1e-9
    )
    assert abs(t.loc["sgn", "acc_at_horizon"] - 20.0) < 1e-9
    assert abs(t.loc["adam", "acc_at_horizon"] - 30.0) < 1e-9
    assert abs(t.loc["fgn", "ce_at_horizon"] - 2.0) < 1e-9
    # time to 10 %: FGN 0.5 s, SGN 1.0 s, Adam 1/3 s; time to 30 %: FGN 1.5 s, SGN not in horizon
    assert abs(t.loc["fgn", "time_to_10.0%"] - 0.5) < 2e-3
    assert abs(t.loc["sgn", "time_to_10.0%"] - 1.0) < 2e-3
    assert abs(t.loc["adam", "time_to_10.0%"] - 1 / 3) < 2e-3
    assert abs(t.loc["fgn", "time_to_30.0%"] - 1.5) < 2e-3
    assert np.isnan(t.loc["sgn", "time_to_30.0%"])
    assert abs(cars196.speedups(table)["time_to_10.0%"] - 2.0) < 1e-2
    assert abs(t.loc["sgn", "final_acc"] - 40.0) < 1e-9 and abs(t.loc["sgn", "run_time_s"] - 4.0) < 1e-9
    # relative thresholds on synthetic data: fractions of the best accuracy at the horizon (40 %)
    _, notes_rel = cars196.table1(runs, synthetic=True)
    assert notes_rel["thresholds"] == [0.38, 0.39, 0.396]
    _, notes_real = cars196.table1(runs, synthetic=False)
    assert notes_real["thresholds"] == [0.42, 0.43, 0.44]
    # whole runs (no horizon): SGN reaches 30 % at 3 s, so the SGN/FGN ratio exists at both levels
    whole, _ = cars196.whole_run_times(runs, synthetic=True, thresholds=[0.1, 0.3])
    w = whole.set_index("method")
    assert (
        abs(w.loc["sgn", "time_to_30.0%"] - 3.0) < 3e-3 and abs(w.loc["adam", "time_to_30.0%"] - 1.0) < 3e-3
    )
    assert all(abs(v - 2.0) < 1e-2 for v in cars196.speedups(whole).values())
    _, whole_rel = cars196.whole_run_times(runs, synthetic=True)  # fractions of Adam's final 30 %
    assert whole_rel["thresholds"] == [0.285, 0.292, 0.297]


def test_analysis_writes_table_and_figure(records, capsys):
    cars196.main(
        ["all", "--profile", "quick", "--results-dir", str(records), "--no-run", "--thresholds", "0.1", "0.3"]
    )
    out = records / "fgn_cars196" / "analysis" / "quick"
    table = pd.read_csv(out / "table1.csv")
    assert set(table["method"]) == {"adam", "sgn", "fgn"}
    text = (out / "table1.md").read_text()
    assert "SYNTHETIC" in text and "Paper" in text and "–" in text and "whole runs" in text
    assert (out / "time_to_threshold_whole_runs.csv").is_file()
    fig = records / "figures" / "fgn" / "fig3_quick.png"
    assert fig.stat().st_size > 10_000
    series = pd.read_csv(fig.with_suffix(".csv"))
    assert set(series["metric"]) == {"test/accuracy", "test/loss"}
    assert "SYNTHETIC" in capsys.readouterr().out
