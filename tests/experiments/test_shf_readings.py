"""experiments.shf.readings: each reading of the paper's ambiguous places, labelled from its recorded config
and judged on the paper's claims (hand-made records)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from experiments.shf import readings


def _run(
    root: Path,
    run_id: str,
    method: str,
    opt: dict,
    rows: list[dict],
    best: dict,
    seed: int = 0,
    model: dict | None = None,
) -> None:
    run = root / "shf_fig2_usps" / run_id
    run.mkdir(parents=True)
    cfg = {
        "profile": "paper",
        "seed": seed,
        "dataset": {"name": "usps", "num_train": 8000},
        "optimizer": {"name": method, **opt},
        **({"model": model} if model else {}),
    }
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "status": "completed",
        "run_id": run_id,
        "seed": seed,
        "optimizer": method,
        "best": {"step": 6, "metrics": best},
    }
    (run / "summary.json").write_text(json.dumps(summary))


def _rows(train_f: list[float], test_f: list[float], batch: list[int] | None) -> list[dict]:
    out = []
    for i, (a, b) in enumerate(zip(train_f, test_f)):
        row = {"step": i + 1, "algo_time_s": float(i + 1), "train/f": a, "test/f": b}
        if batch is not None:
            row.update(batch_size=batch[i], damping=1.0, rho=1.0, batch_rule="keep")
        out.append(row)
    return out


def test_gradual_growth_checks_each_claim() -> None:
    t = np.arange(1.0, 101.0)
    jump = readings.gradual_growth(t, np.where(t < 2, 200.0, 2000.0), 2000)
    assert jump["grows"] and not jump["not_front_loaded"] and not jump["small_on_average"] and not jump["ok"]
    assert not readings.gradual_growth(t, np.full(100, 200.0), 2000)["ok"]  # never grows
    assert not readings.gradual_growth(t, np.linspace(200, 280, 100), 2000)["grows"]  # +40 % < 1.5x
    steady = readings.gradual_growth(t, np.linspace(200, 1500, 100), 2000)
    assert steady["ok"] and steady["time_mean_batch"] == pytest.approx(850.0)
    # front-loaded: 200 -> 1000 within the first 20 % of the time, then flat
    front = np.minimum(200 + 40 * (t - 1), 1000.0)
    assert not readings.gradual_growth(t, front, 2000)["not_front_loaded"]


def test_reading_label_fills_flags_older_records_lack_with_the_constructor_default() -> None:
    base = {"cfg.optimizer.damping_center": "warm_start", "cfg.model.code_activation": "sigmoid"}
    # a record made before variance_gradients existed ran the constructor default ("example")
    assert (
        readings.reading_label({**base}, {**base, "cfg.optimizer.variance_gradients": "example"}, "shf_lsmr")
        == "default"
    )
    run = {**base, "cfg.optimizer.variance_gradients": "summand", "cfg.model.code_activation": None}
    assert readings.reading_label(run, base, "shf_lsmr") == "variance_gradients=summand, code_activation=None"


def test_a_record_older_than_the_damping_center_flag_ran_warm_start() -> None:
    """damping_center's default changed from warm_start to zero (docs/decisions.md SHF-4): a record
    made before the flag existed ran warm_start, not today's constructor default."""
    base = {"cfg.optimizer.damping_center": "zero"}
    assert readings.reading_label({}, base, "shf_lsmr") == "damping_center=warm_start"
    assert readings.reading_label({"cfg.optimizer.damping_center": "zero"}, base, "shf_lsmr") == "default"
    # the base itself may be an old record: both sides are filled the same way
    assert readings.reading_label({"cfg.optimizer.damping_center": "warm_start"}, {}, "shf_lsmr") == "default"


def test_hf_cg_references_per_network(tmp_path: Path) -> None:
    """SHF / HF-CG on each network: the completed HF-CG reading of that network with the most seeds."""
    shf_net = {"loss": "squared_error", "code_activation": "sigmoid"}
    martens_net = {"loss": "sigmoid_bce", "code_activation": None}
    _run(
        tmp_path,
        "shf_lsmr_paper_s0",
        "shf_lsmr",
        {"max_batch_size": 2000},
        _rows([2, 1], [3, 2.2], [200, 2000]),
        {"train/f": 1.0, "test/f": 2.2},
        model=shf_net,
    )
    for s, test in ((0, 2.0), (1, 2.2)):  # the default HF-CG: SHF's network
        _run(
            tmp_path,
            f"hf_cg_paper_s{s}",
            "hf_cg",
            {},
            _rows([2, 1], [3, test], None),
            {"train/f": 1.0, "test/f": test},
            seed=s,
            model=shf_net,
        )
    audit = tmp_path / "shf_audit"
    _run(
        audit,
        "hf_cg_paper_s0_martens_net",
        "hf_cg",
        {"weight_cost": 2e-5},
        _rows([2, 1], [3, 1.6], None),
        {"train/f": 0.9, "test/f": 1.6},
        model=martens_net,
    )
    runs = readings.collect(tmp_path, "usps")
    assert dict(zip(runs["run_id"], runs["network"]))["hf_cg_paper_s0_martens_net"] == "martens"
    table = readings.readings_table(runs, "usps").set_index(["method", "reading"])
    d = table.loc[("shf_lsmr", "default")]
    assert d["vs_hf_cg"] == pytest.approx(2.2 / 2.1) and d["vs_hf_cg_same_net"] == pytest.approx(2.2 / 2.1)
    assert d["vs_hf_cg_martens_net"] == pytest.approx(2.2 / 1.6)


def test_collect_and_table_from_records(tmp_path: Path) -> None:
    n = 8
    for s in (0, 1):  # default SHF: jumps to n_max at once; reaches train f <= 0.999 at step 6
        _run(
            tmp_path,
            f"shf_lsmr_paper_s{s}",
            "shf_lsmr",
            {"max_batch_size": 2000, "variance_gradients": "example"},
            _rows(
                [5, 4, 3, 2, 1.5, 0.9, 0.8, 0.7],
                [6, 5, 4, 3, 2.5, 2.0 + s / 10, 2.1, 2.2],
                [200] + [2000] * (n - 1),
            ),
            {"train/f": 0.9, "test/f": 2.0 + s / 10},
            seed=s,
        )
    _run(
        tmp_path,
        "hf_cg_paper_s0",
        "hf_cg",
        {},
        _rows([3, 1, 0.5], [3, 1.8, 2.0], None),
        {"train/f": 1.0, "test/f": 1.8},
    )
    audit = tmp_path / "shf_audit"
    _run(
        audit,
        "shf_lsmr_paper_s0_summand",
        "shf_lsmr",
        {"max_batch_size": 2000, "variance_gradients": "summand"},
        _rows(
            [5, 4, 3.5, 3, 2.8, 2.7, 2.6, 2.5],
            [6, 5, 4, 3.5, 3.2, 3.1, 3.0, 3.0],
            [200, 220, 250, 280, 320, 360, 400, 440],
        ),
        {"train/f": 2.5, "test/f": 3.0},
    )
    runs = readings.collect(tmp_path, "usps")
    assert set(runs["reading"]) == {"default", "variance_gradients=summand"}
    table = readings.readings_table(runs, "usps").set_index(["method", "reading"])
    d = table.loc[("shf_lsmr", "default")]
    assert d["seeds"] == 2 and d["test_f_best_val"] == pytest.approx(2.05)
    assert d["test_f_equal_train"] == pytest.approx(2.05)  # first iterate with train f <= 0.999
    assert d["vs_hf_cg"] == pytest.approx(2.05 / 1.8) and d["vs_paper"] == pytest.approx(2.05 / 1.947 - 1)
    assert d["gradual"] == "0/2" and d["share_before_peak"] == pytest.approx(2 / 8)
    # an HF-CG row is compared with the paper's HF-CG test f (1.961), not SHF's (1.947)
    assert table.loc[("hf_cg", "default")]["vs_paper"] == pytest.approx(1.8 / 1.961 - 1)
    s = table.loc[("shf_lsmr", "variance_gradients=summand")]
    assert s["gradual"] == "1/1" and s["peak_batch"] == 440 and np.isnan(s["test_f_equal_train"])
    md = readings.to_markdown(readings.readings_table(runs, "usps"), "usps", "paper")
    assert "| shf_lsmr | variance_gradients=summand | 1 | 3.000 |" in md
