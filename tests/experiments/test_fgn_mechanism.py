"""FGN Figure 2 measurements (traces, step quality, timing cells) and the driver's records."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from experiments.fgn import fig2, mechanism


def test_trace_decomposition_matches_the_spec_table():
    alphas = np.linspace(0.0, 1.0, 41)
    tr = mechanism.trace_decomposition(0.6, 10, alphas)
    # matrices built explicitly agree with the closed forms, and τ_full = τ_ret + τ_drop
    for key in ("tau_ret", "tau_drop", "tau_full"):
        np.testing.assert_allclose(tr[f"{key}_matrix"], tr[key], atol=1e-14)
    np.testing.assert_allclose(tr["tau_full"], tr["tau_ret"] + tr["tau_drop"], atol=1e-14)
    # spec fgn §4.1 table (ξ, τ_ret, τ_drop, τ_full) at the two ends of the α range
    assert tr["xi"][0] == 0 and abs(tr["tau_ret"][0] - 0.48) < 1e-12 and tr["tau_drop"][0] == 0
    assert abs(tr["xi"][-1] - 8 / 9) < 1e-12
    np.testing.assert_allclose(
        [tr["tau_ret"][-1], tr["tau_drop"][-1], tr["tau_full"][-1]], [0.2667, 0.3556, 0.6222], atol=1e-4
    )
    # and in between, by interpolation along the ξ axis (the closed forms are linear in ξ)
    for xi, ret, drop, full in (
        (0.2, 0.432, 0.08, 0.512),
        (0.4, 0.384, 0.16, 0.544),
        (0.6, 0.336, 0.24, 0.576),
    ):
        assert abs(np.interp(xi, tr["xi"], tr["tau_ret"]) - ret) < 1e-9
        assert abs(np.interp(xi, tr["xi"], tr["tau_drop"]) - drop) < 1e-9
        assert abs(np.interp(xi, tr["xi"], tr["tau_full"]) - full) < 1e-9


def test_step_quality_ratio_behaves_as_the_paper_claims():
    t = mechanism.competitor_positions(10)
    assert abs(t.mean()) < 1e-15 and t[0] == -1.0 and t[-1] == 1.0
    alphas = np.concatenate([[0.0], np.geomspace(1e-3, 1.0, 60)])
    rows = pd.DataFrame(mechanism.step_quality(10, 0.7, 1.25, 3.0, t, [0.01, 0.1, 1.0], alphas))
    # exact at ξ = 0 (ρ one-hot: no dropped curvature), never better than the GGN step
    assert np.allclose(rows.loc[rows["alpha"] == 0, "R"], 1.0, atol=1e-12)
    assert (rows["R"] <= 1 + 1e-12).all() and (rows["R"] > 0).all()
    wide = rows.pivot(index="alpha", columns="s_lambda", values="R")
    # larger damping keeps R closer to 1, at every ξ
    assert (wide[1.0] >= wide[0.1] - 1e-12).all() and (wide[0.1] >= wide[0.01] - 1e-12).all()
    # R falls as competitors spread out (first half of the ξ range)
    low = rows[(rows["s_lambda"] == 0.01) & (rows["xi"] < 0.5)].sort_values("xi")
    assert np.all(np.diff(low["R"]) <= 1e-12) and low["R"].iloc[-1] < 0.9


def test_competitor_positions_integer_spacing():
    t = mechanism.competitor_positions(5, spacing="integers")
    np.testing.assert_allclose(t, [-1.5, -0.5, 0.5, 1.5])
    with pytest.raises(ValueError):
        mechanism.competitor_positions(5, spacing="random")


@pytest.mark.parametrize("method", mechanism.METHODS)
def test_time_cell_runs_every_method(method):
    row = mechanism.time_cell(
        method, 3, 16, 8, 32, warmup_steps=1, timed_steps=2, settings={"adam_fused": False}
    )
    assert row["ms_mean"] > 0 and row["C"] == 3 and row["num_params"] == 16 * 3 + 3
    if method != "adam":
        assert 1 <= row["cg_iters_mean"] <= 5


def test_fig2_driver_writes_records_then_draws_from_them(tmp_path, capsys):
    args = [
        "all",
        "--profile",
        "quick",
        "--results-dir",
        str(tmp_path),
        "--set",
        "timing.classes=[2,4]",
        "--set",
        "timing.dim=16",
        "--set",
        "timing.batch_size=8",
        "--set",
        "timing.num_examples=32",
        "--set",
        "timing.warmup_steps=1",
        "--set",
        "timing.timed_steps=1",
        "--set",
        "quality.num_points=20",
        "--set",
        "traces.num_points=11",
    ]
    fig2.main(args)
    folder = tmp_path / "fgn_fig2" / "quick"
    rows = [json.loads(line) for line in (folder / "timing.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * len(mechanism.METHODS) and all(r["status"] == "ok" for r in rows)
    assert len(pd.read_csv(folder / "traces.csv")) == 11
    assert len(pd.read_csv(folder / "quality.csv")) == 60
    assert (tmp_path / "figures" / "fgn" / "fig2_quick.png").stat().st_size > 10_000
    assert json.loads((folder / "config.json").read_text())["quality"]["t_values"][0] == -1.0
    # a second call re-times nothing (records are kept), but redraws
    capsys.readouterr()
    fig2.main(args)
    assert "[timing]" not in capsys.readouterr().out
    assert len((folder / "timing.jsonl").read_text().splitlines()) == len(rows)
