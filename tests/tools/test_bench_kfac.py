"""benchmarks.bench_kfac: both factor paths and both quadratic-model paths run on the AE and agree."""

from __future__ import annotations

import json

from benchmarks import bench_kfac


def test_bench_kfac_records_every_block_and_agreeing_paths(tmp_path):
    out = tmp_path / "kfac.json"
    bench_kfac.main(["--batch", "2", "--rounds", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["benchmark"] == "kfac_input_factor" and data["batch"] == 2
    kinds = [b["kind"] for b in data["blocks"]]
    assert kinds.count("convT") == 3 and kinds.count("conv") == 7 and kinds.count("linear") == 2
    assert all(b["max_abs_diff_rel"] < 1e-5 for b in data["blocks"])
    assert data["quad_model_max_diff_rel"] < 1e-4
    assert data["kfac_step_s"] > 0 and data["reference_total_s"] > 0
