"""The cross-paper grid (experiments/cross, experiments/report/cross.py): which method applies where and
why, the judging functions on hand-made records, the sweeps, and the report section on a fake record set."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from experiments.cross import run as cross_run
from experiments.cross.tasks import METHODS, TASKS, ModelFacts, applicability, facts_of_model
from experiments.report import cross as rc

MLP_SQ = ModelFacts(
    loss="squared_error",
    plain_mlp=True,
    sequence_output=False,
    recurrent=False,
    matrix_params=4,
    body_matrices=3,
)
LOGREG = ModelFacts(
    loss="cross_entropy",
    plain_mlp=True,
    sequence_output=False,
    recurrent=False,
    matrix_params=1,
    body_matrices=0,
)
LSTM_LM = ModelFacts(
    loss="cross_entropy",
    plain_mlp=False,
    sequence_output=True,
    recurrent=True,
    uncovered=("lstm1.weight",),
    matrix_params=4,
    body_matrices=1,
)
LLAMA = ModelFacts(
    loss="cross_entropy",
    plain_mlp=False,
    sequence_output=True,
    recurrent=False,
    uncovered=("embed.weight", "norm.weight"),
    matrix_params=16,
    body_matrices=14,
)


def applies(facts: ModelFacts) -> set[str]:
    return {m for m in METHODS if applicability(m, facts)[0]}


def test_applicability_per_kind_of_model():
    everywhere = {"adam", "heavy_ball", "fosi_adam", "fosi_heavy_ball", "lbfgs"}
    assert applies(MLP_SQ) == everywhere | {"shf_lsmr", "hf_cg", "kfac", "racs", "alice"}
    assert applies(LOGREG) == everywhere | {"hf_cg", "fgn", "sgn", "kfac", "alice"}
    assert applies(LSTM_LM) == everywhere | {"racs", "alice"}
    assert applies(LLAMA) == everywhere | {"racs", "alice"}


@pytest.mark.parametrize(
    "method, facts, needle",
    [
        ("shf_lsmr", LOGREG, "sum-of-squares"),
        ("fgn", MLP_SQ, "softmax"),
        ("sgn", LLAMA, "(batch, T, V)"),
        ("kfac", LSTM_LM, "time step"),
        ("kfac", LLAMA, "no Kronecker block for 2 parameter tensors"),
        ("hf_cg", LSTM_LM, "recurrent"),
        ("racs", LOGREG, "output head"),
    ],
)
def test_a_method_that_does_not_apply_says_why(method, facts, needle):
    ok, why = applicability(method, facts)
    assert not ok and needle in why


def test_applicability_refuses_unknown_methods():
    with pytest.raises(ValueError, match="unknown method"):
        applicability("sophia", MLP_SQ)


def test_facts_read_from_models():
    mlp = nn.Sequential(nn.Linear(8, 4), nn.Sigmoid(), nn.Linear(4, 8))
    f = facts_of_model(mlp, "squared_error")
    assert (
        f.plain_mlp
        and not f.recurrent
        and f.uncovered == ()
        and f.matrix_params == 2
        and f.body_matrices == 1
    )

    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(4, 4)
            self.out = nn.Linear(4, 3)

    r = facts_of_model(Rec(), "cross_entropy")
    assert r.recurrent and not r.plain_mlp and "lstm.weight_ih_l0" in r.uncovered
    assert not applicability("kfac", r)[0] and not applicability("hf_cg", r)[0]


def curve(times, values, works=None, test=None):
    n = len(times)
    return pd.DataFrame(
        {
            "step": np.arange(n),
            "time": np.asarray(times, float),
            "work": np.asarray(works if works is not None else np.arange(n) * 100.0, float),
            "value": np.asarray(values, float),
            "test": np.asarray(test if test is not None else [np.nan] * n, float),
        }
    )


def test_best_within_budget_and_first_reach():
    c = curve([0, 1, 2, 3, 4], [10, 8, 5, 4, 1], test=[11, 9, 6, 5, 2])
    assert rc.best_within(c, "min", budget=3.0) == (4.0, 5.0)  # the evaluation at t=4 is past the budget
    assert rc.best_within(c, "min") == (1.0, 2.0)
    assert rc.best_within(curve([0, 1], [0.1, 0.9]), "max") == (0.9, math.nan) or math.isnan(
        rc.best_within(curve([0, 1], [0.1, 0.9]), "max")[1]
    )
    # a diverged run: non-finite values never count
    assert math.isnan(rc.best_within(curve([0, 1], [np.nan, np.inf]), "min")[0])
    assert rc.first_reach(c["time"], c["value"], 5.0, "min") == 2.0
    assert rc.first_reach(c["work"], c["value"], 5.0, "min") == 200.0  # equal work: same rule on work
    assert math.isnan(rc.first_reach(c["time"], c["value"], 0.5, "min"))
    assert rc.first_reach([0, 1, 2], [0.2, 0.5, 0.9], 0.5, "max") == 1.0


def test_shared_target_is_the_worst_best_among_methods_that_trained():
    best = {"a": 1.0, "b": 3.0, "stuck": 10.0}
    initial = {"a": 10.0, "b": 10.0, "stuck": 10.0}
    assert rc.shared_target(best, initial, "min") == 3.0
    # a method with less than half of the best improvement (10 -> 8 against 10 -> 1) does not set it
    assert (
        rc.shared_target({"a": 1.0, "b": 3.0, "slow": 8.0}, {"a": 10.0, "b": 10.0, "slow": 10.0}, "min")
        == 3.0
    )
    assert rc.shared_target({"a": 0.9, "b": 0.8}, {"a": 0.1, "b": 0.1}, "max") == 0.8
    assert math.isnan(rc.shared_target({"a": 5.0}, {"a": 5.0}, "min"))


def test_trial_chosen_on_validation_mean_over_seeds():
    assert rc.select_trial({"t0": [1.0, 4.0], "t1": [2.5, 2.0]}, "min") == "t1"
    assert rc.select_trial({"t0": [0.9, 0.8], "t1": [0.95, np.nan]}, "max") == "t0"  # a diverged seed loses


def test_step_work_counts_gradients_and_curvature_products():
    assert rc.step_work({"batch_size": 100}, "adam") == 100
    assert rc.step_work({"batch_size": 200, "inner_iters": 5}, "shf_lsmr") == 200 * 6
    assert rc.step_work({"batch_size": 2000, "inner_iters": 10}, "hf_cg", num_train=8000) == 8000 + 20000
    assert rc.step_work({"batch_size": 64, "cg_iters": 5}, "fgn") == 64 * 6
    assert rc.step_work({"batch_size": 10, "ese_ran": 1, "lanczos_iters": 40}, "fosi_adam") == 410
    assert rc.step_work({"batch_size": 10, "ese_ran": 0, "lanczos_iters": 40}, "fosi_adam") == 10
    assert rc.step_work({"batch_size": 10}, "kfac") == 20
    assert rc.step_work({"step": 0}, "adam") == 0  # an evaluation-only row


def test_run_curve_cumulates_work_to_each_evaluation():
    rows = pd.DataFrame(
        [
            {"step": 0, "algo_time_s": 0.0, "val/loss": 5.0},
            {"step": 1, "algo_time_s": 0.5, "batch_size": 10, "inner_iters": 2},
            {
                "step": 2,
                "algo_time_s": 1.0,
                "batch_size": 10,
                "inner_iters": 3,
                "val/loss": 3.0,
                "test/loss": 3.5,
            },
        ]
    )
    c = rc.run_curve(rows, "shf_lsmr", "val/loss")
    assert c["work"].tolist() == [0.0, 30.0 + 40.0]
    assert c["value"].tolist() == [5.0, 3.0] and c["test"].iloc[-1] == 3.5


def fake_plan(tmp_path):
    plan = {
        "task": "usps",
        "experiment": "cross_usps",
        "title": "toy task",
        "paper": "SHF",
        "profile": "quick",
        "metric": "val/loss",
        "mode": "min",
        "seeds": [0, 1],
        "trials": ["t0", "t1"],
        "budget_s": 10.0,
        "methods": {
            "adam": {"applies": True, "reason": "", "trials": {"t0": 1e-3, "t1": 3e-3}},
            "shf_lsmr": {"applies": True, "reason": "", "trials": {"t0": 7.5, "t1": 0.75}},
            "fgn": {"applies": False, "reason": "FGN is a softmax cross-entropy method"},
        },
    }
    return plan


def write_run(root, exp, run_id, method, seed, values, times, batch=10, inner=None, status="completed"):
    d = root / exp / run_id
    d.mkdir(parents=True)
    rows = []
    for i, (v, t) in enumerate(zip(values, times, strict=True)):
        row = {"step": i, "epoch": 0.0, "algo_time_s": t, "wall_time_s": t, "val/loss": v}
        if i > 0:
            row.update({"batch_size": batch, "loss": v})
            if inner is not None:
                row["inner_iters"] = inner
        rows.append(row)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (d / "summary.json").write_text(
        json.dumps(
            {
                "status": status,
                "run_id": run_id,
                "steps": len(values) - 1,
                "algo_time_s": times[-1],
                "peak_mem_bytes": 2**20 * 100,
                "optimizer": method,
                "profile": "quick",
                "seed": seed,
            }
        )
    )
    (d / "config.yaml").write_text(
        f"optimizer:\n  name: {method}\nseed: {seed}\nprofile: quick\ndataset:\n  name: toy\n  num_train: 100\n"
        f"trainer:\n  clock: process\n  num_threads: 1\n  max_algo_time_s: 10\n  eval_every: 1\n"
    )


def fake_records(tmp_path):
    plan = fake_plan(tmp_path)
    exp = tmp_path / "cross_usps"
    exp.mkdir()
    (exp / "grid_quick.json").write_text(json.dumps(plan))
    t = [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 14.0]  # the last evaluation is past the 10 s budget
    for s in (0, 1):
        write_run(tmp_path, "cross_usps", f"adam_quick_s{s}_t0", "adam", s, [10, 8, 6, 5, 4.5, 4.5, 0.1], t)
        write_run(tmp_path, "cross_usps", f"adam_quick_s{s}_t1", "adam", s, [10, 7, 5, 4, 3.5, 3.0, 3.0], t)
        write_run(
            tmp_path,
            "cross_usps",
            f"shf_lsmr_quick_s{s}_t0",
            "shf_lsmr",
            s,
            [10, 3.5, 2, 1.5, 1.2, 1.1, 1.1],
            t,
            inner=4,
        )
        write_run(
            tmp_path,
            "cross_usps",
            f"shf_lsmr_quick_s{s}_t1",
            "shf_lsmr",
            s,
            [10, 9, 9, 9, 9, 9, 9],
            t,
            inner=4,
        )
    return plan


def test_task_table_on_fake_records(tmp_path):
    plan = fake_records(tmp_path)
    runs = rc.load_task_runs(tmp_path, plan)
    assert len(runs) == 8
    frame, info = rc.task_table(plan, runs)
    # adam's t0 reaches 0.1 only after the 10 s budget: within the budget t1 (3.0) beats t0 (4.5)
    assert info["chosen"] == {"adam": "t1", "shf_lsmr": "t0"}
    assert info["target"] == pytest.approx(3.0) and info["complete"]
    rows = frame.set_index("_key")
    assert rows.loc["shf_lsmr", "rank"] == "1" and rows.loc["adam", "rank"] == "2"
    assert rows.loc["shf_lsmr", "CPU-s to target"] == "4" and rows.loc["adam", "CPU-s to target"] == "10"
    # equal work: SHF's steps cost 10 x (1 + 4) examples, Adam's 10
    assert rows.loc["shf_lsmr", "work to target"] == "100" and rows.loc["adam", "work to target"] == "50"
    assert int(rows.loc["adam", "steps"]) == 5  # judged at the budget: the evaluation at 14 s is not counted
    assert rows.loc["fgn", "applies"].startswith("no: FGN is a softmax")
    assert rows.loc["adam", "reached"] == "2/2"


def test_report_section_on_fake_records(tmp_path):
    fake_records(tmp_path)
    md = rc.section_markdown(tmp_path, "quick")
    assert md.startswith("## Cross-paper grid")
    assert "SHF-LSMR" in md and "no: FGN is a softmax" in md and "ranking by best validation" in md
    assert "quick profile, CPU, 2 seeds" in md
    assert (tmp_path / "figures" / "cross_usps_quick.png").exists()
    out_md, out_html = tmp_path / "REPORT.md", tmp_path / "REPORT.html"
    out_md.write_text("# Reproduction report\n")
    out_html.write_text("<html><body><h1>x</h1></body></html>")
    rc.append_section(tmp_path, out_md, out_html)
    assert "## Cross-paper grid" in out_md.read_text()
    assert "<h2>Cross-paper grid</h2>" in out_html.read_text() and out_html.read_text().endswith(
        "</body></html>"
    )


def test_report_section_without_records_says_how_to_run(tmp_path):
    assert "not run: `make reproduce-cross`" in rc.section_markdown(tmp_path, "quick")


def test_sweeps_cover_exactly_the_missing_runs():
    jobs = [(m, s, t) for m in ("adam", "kfac") for s in (0, 1) for t in ("t0", "t1")]
    assert cross_run.sweeps(jobs) == [(["adam", "kfac"], [0, 1], ["t0", "t1"])]
    ragged = [("adam", 0, "t0"), ("adam", 1, "t1"), ("kfac", 0, "t0")]
    covered = {
        (m, s, t)
        for methods, seeds, trials in cross_run.sweeps(ragged)
        for m in methods
        for s in seeds
        for t in trials
    }
    assert covered == set(ragged)


def test_multirun_command_is_one_sweep_with_the_budget(tmp_path):
    cmd = cross_run.multirun_command(
        TASKS["usps"], "quick", ["adam", "shf_lsmr"], [0, 1], ["t0"], 20.0, tmp_path, ["trainer.device=cpu"]
    )
    assert cmd[1:3] == ["src/train.py", "-m"]
    assert "experiment=cross_usps" in cmd and "optimizer=adam,shf_lsmr" in cmd and "seed=0,1" in cmd
    assert "cross.trial=t0" in cmd and "trainer.max_algo_time_s=20" in cmd and "trainer.clock=process" in cmd
    assert cmd[-1] == "trainer.device=cpu"


def test_cross_configs_compose_with_trial_values_and_run_ids():
    from experiments.runs import compose_config

    cfg = compose_config(["experiment=cross_usps", "optimizer=shf_lsmr", "cross.trial=t1", "seed=1"])
    assert cfg.run_id == "shf_lsmr_quick_s1_t1" and cfg.optimizer.damping == 0.75
    assert cfg.trainer.clock == "process" and cfg.trainer.num_threads == 1
    cfg = compose_config(["experiment=cross_lr", "optimizer=heavy_ball"])
    assert cfg.optimizer.lr == 0.1 and cfg.run_id == "heavy_ball_quick_s0_t0"  # FOSI's HB lr on LR
    cfg = compose_config(["experiment=cross_llm", "optimizer=fosi_adam"])
    assert cfg.optimizer.scheduler is None and cfg.optimizer.ese_period == 50
    cfg = compose_config(["experiment=cross_lm", "optimizer=fosi_heavy_ball"])
    assert (cfg.optimizer.k, cfg.optimizer.ese_period, cfg.optimizer.ese_warmup) == (5, 100, 40)


def test_kfac_facts_of_a_real_linear_model_cover_everything():
    model = nn.Sequential(nn.Linear(3, 2))
    f = facts_of_model(model, "cross_entropy")
    assert applicability("kfac", f)[0]
    assert torch.is_tensor(next(model.parameters()))
