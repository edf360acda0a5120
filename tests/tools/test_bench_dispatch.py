"""The dispatch benchmark's calibration and table (benchmarks/bench_dispatch.py; docs/lean_steps.md)."""

from __future__ import annotations

from benchmarks import bench_dispatch


def test_calibration_from_the_h200_record_is_launch_bound():
    """The recorded H200 step times are ops × ~9.75 µs (r ≥ 0.99): the steps waited on the host."""
    cal = bench_dispatch.calibration()
    assert 9.0 < cal["us_per_op"] < 10.5
    assert cal["r"] > 0.99
    assert len(cal["points"]) >= 8


def test_markdown_names_every_row_and_the_before_counts():
    rec = {
        "torch": "x",
        "calibration": {"us_per_op": 9.75, "r": 0.99, "points": [(1, 1)], "record": "r.json"},
        "llm": [
            {
                "name": "racs plain step",
                "counted_on": "fake cuda",
                "ops": 315,
                "views": 39,
                "host_reads": 0,
                "before_ops": 575,
                "before_host_reads": 1,
                "predicted_ms": 3.07,
                "h200_ms": None,
            },
        ],  # fmt: skip
        "solvers": [
            {
                "name": "hf_cg CG iteration",
                "n": 6000,
                "iterations": 1,
                "ops": 72,
                "views": 0,
                "host_reads": 1,
                "before_ops": 162,
                "before_host_reads": 4,
                "floor_ms": 1.8,
                "predicted_ms": 2.5,
            },
        ],  # fmt: skip
        "curvature": [{"name": "FOSI-HB", "note": "unavailable"}],
        "mnist_hfcg_paper_run": bench_dispatch.mnist_hfcg_estimate(
            [
                {
                    "name": "hf_cg CG iteration",
                    "n": 6000,
                    "ops": 72,
                    "before_ops": 162,
                    "floor_ms": 1.8,
                    "predicted_ms": 2.5,
                }
            ]  # fmt: skip
        ),
    }
    md = bench_dispatch.to_markdown(rec)
    assert "| racs plain step | fake cuda | 315 (575) | 39 | 0 (1) |" in md
    assert "| hf_cg CG iteration | 6000 | 1 | 72 (162) |" in md
    est = rec["mnist_hfcg_paper_run"]
    assert abs(est["minutes"] - 125_000 * 2.5 / 6e4) < 1e-9
    assert est["minutes_before"] > est["minutes"]
    assert "H200 minutes" in md


def test_cross_paper_table_labels_the_cuda_step_path():
    """The H200 RACS/Alice rows recorded before the stacked, banked path say they are the per-matrix
    loop; newer records carry their path (issue 41)."""
    from experiments.report.bench import llm_rows

    row = {"amortised_ms": 1.0, "state_bytes": 1}
    old = {"device": "cuda", "results": [{"method": "adamw_fused", **row}, {"method": "racs", **row}]}
    new = {
        "device": "cuda",
        "results": [{"method": "adamw_fused", **row}, {"method": "racs", "step_path": "stacked", **row}],
    }
    cpu = {"device": "cpu", "results": [{"method": "adamw_fused", **row}, {"method": "racs", **row}]}
    assert llm_rows(old)[1]["optimizer"] == "RACS (per-matrix loop, the earlier CUDA path)"
    assert llm_rows(new)[1]["optimizer"] == "RACS (stacked)"
    assert llm_rows(cpu)[1]["optimizer"] == "RACS"
