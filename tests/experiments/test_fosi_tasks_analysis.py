"""FOSI Tables 1–2 and Figures 2/5/6 from hand-made run records (known answers), including a
diverged baseline and the paper's numbers file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from experiments.fosi_tasks import analysis, figures
from experiments.fosi_tasks import run as driver


def _write_run(
    root: Path, experiment: str, run_id: str, optimizer: str, rows: list[dict], status="completed"
):
    d = root / experiment / run_id
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (d / "config.yaml").write_text(
        yaml.safe_dump(
            {"optimizer": {"name": optimizer}, "seed": 0, "profile": "quick", "dataset": {"name": "x"}}
        )
    )
    (d / "summary.json").write_text(json.dumps({"status": status, "run_id": run_id}))


def _lr_rows(
    acc_per_epoch: list[float], loss_per_epoch: list[float], seconds_per_step: float, steps: int = 2
):
    """``steps`` steps per epoch; one test evaluation per epoch."""
    rows = [
        {
            "step": 0,
            "epoch": 0.0,
            "algo_time_s": 0.0,
            "wall_time_s": 0.0,
            "test/accuracy": 0.1,
            "test/loss": 3.0,
        }
    ]
    step = 0
    for e, (acc, loss) in enumerate(zip(acc_per_epoch, loss_per_epoch, strict=True)):
        for j in range(steps):
            step += 1
            row = {
                "step": step,
                "epoch": e + (j + 1) / steps,
                "algo_time_s": step * seconds_per_step,
                "wall_time_s": step * seconds_per_step + 0.5,
                "loss": loss + (0.01 if j == 0 else -0.01),
            }
            if j == steps - 1:
                row.update({"test/accuracy": acc, "test/loss": loss})
            rows.append(row)
    return rows


@pytest.fixture
def lr_results(tmp_path):
    #   HB best accuracy 0.90 at epoch 3 (t = 6 steps * 1 s); FOSI-HB reaches 0.90 at epoch 2 (t = 4 * 1.5 s)
    _write_run(
        tmp_path,
        "fosi_lr",
        "heavy_ball_quick_s0",
        "heavy_ball",
        _lr_rows([0.8, 0.85, 0.9, 0.89], [0.5, 0.4, 0.3, 0.35], 1.0),
    )
    _write_run(
        tmp_path,
        "fosi_lr",
        "fosi_heavy_ball_quick_s0",
        "fosi_heavy_ball",
        _lr_rows([0.85, 0.9, 0.91, 0.92], [0.28, 0.3, 0.25, 0.2], 1.5),
    )
    #   Adam best 0.88 at epoch 4 (t = 8 * 0.5); FOSI-Adam never reaches it
    _write_run(
        tmp_path,
        "fosi_lr",
        "adam_quick_s0",
        "adam",
        _lr_rows([0.8, 0.82, 0.85, 0.88], [0.6, 0.5, 0.45, 0.4], 0.5),
    )
    _write_run(
        tmp_path,
        "fosi_lr",
        "fosi_adam_quick_s0",
        "fosi_adam",
        _lr_rows([0.7, 0.8, 0.85, 0.87], [0.6, 0.5, 0.45, 0.41], 0.5),
    )
    return tmp_path


def test_table1_times_and_ratios(lr_results):
    runs = {"lr": analysis.load_task(lr_results, analysis.TASKS["lr"], "quick")}
    table = analysis.time_table(runs, "val").set_index(["task", "optimizer"])
    assert table.loc[("lr", "heavy_ball"), "seconds"] == pytest.approx(6.0)
    assert table.loc[("lr", "heavy_ball"), "target"] == pytest.approx(0.9)
    assert table.loc[("lr", "fosi_heavy_ball"), "seconds"] == pytest.approx(6.0)  # step 4 * 1.5 s
    assert table.loc[("lr", "fosi_heavy_ball"), "ratio"] == pytest.approx(1.0)
    assert table.loc[("lr", "adam"), "seconds"] == pytest.approx(4.0)
    assert math.isinf(table.loc[("lr", "fosi_adam"), "seconds"])
    # wall clock adds the 0.5 s offset
    wall = analysis.time_table(runs, "val", clock="wall").set_index(["task", "optimizer"])
    assert wall.loc[("lr", "heavy_ball"), "seconds"] == pytest.approx(6.5)


def test_table2_uses_epoch_means_of_minibatch_losses(lr_results):
    runs = {"lr": analysis.load_task(lr_results, analysis.TASKS["lr"], "quick")}
    curve = analysis.train_curve(runs["lr"]["heavy_ball"], analysis.TASKS["lr"])
    assert curve["loss"].tolist() == pytest.approx([0.5, 0.4, 0.3, 0.35])  # ±0.01 cancel in each epoch
    table = analysis.time_table(runs, "train").set_index(["task", "optimizer"])
    assert table.loc[("lr", "heavy_ball"), "seconds"] == pytest.approx(6.0)  # min 0.3 at epoch 3
    assert table.loc[("lr", "fosi_heavy_ball"), "seconds"] == pytest.approx(
        3.0
    )  # 0.3 at epoch 2: 2 steps*1.5


def test_markdown_has_paper_columns_and_missing_tasks(lr_results):
    runs = {"lr": analysis.load_task(lr_results, analysis.TASKS["lr"], "quick")}
    table = analysis.with_paper(analysis.time_table(runs, "val"), "val")
    md = analysis.markdown_table(table, "val", "quick", "algo")
    lr_line = next(line for line in md.splitlines() if line.startswith("| LR"))
    assert "(90.0%)" in lr_line and "never" in lr_line and "| 16 | 8 | 0.50 |" in lr_line
    assert "| AE | missing" in md
    assert "0.7484" in md  # the paper's mean over its 10 pairs


def test_paper_numbers_reproduce_the_papers_means():
    paper = analysis.paper_numbers()
    for table, mean in (("table1", 0.7485), ("table2", 0.783)):
        p = paper[paper["table"] == table].set_index(["task", "optimizer"])["seconds"]
        ratios = [p[(t, f)] / p[(t, b)] for t in analysis.TASKS for b, f in analysis.PAIRS]
        assert len(ratios) == 10 and sum(ratios) / 10 == pytest.approx(mean, abs=6e-4)


def test_diverged_baseline_is_reported_and_figures_draw(tmp_path):
    task = analysis.TASKS["ae"]
    rows = [{"step": 0, "epoch": 0.0, "algo_time_s": 0.0, "wall_time_s": 0.0, "val/E_sq": 200.0}]
    for s in range(1, 9):
        rows.append({"step": s, "epoch": s / 4, "algo_time_s": s, "wall_time_s": s, "loss": 100.0 / s})
        if s % 4 == 0:
            rows[-1]["val/E_sq"] = 200.0 / s
    bad = rows[:5] + [{"step": 5, "epoch": 1.25, "algo_time_s": 5.0, "wall_time_s": 5.0, "loss": "nan"}]
    for opt in ("heavy_ball", "fosi_heavy_ball", "adam", "fosi_adam", "kfac"):
        _write_run(tmp_path, "fosi_ae", f"{opt}_quick_s0", opt, rows)
    _write_run(tmp_path, "fosi_ae", "lbfgs_quick_s0_L10", "lbfgs", bad, status="diverged")
    runs = analysis.load_task(tmp_path, task, "quick")
    assert set(runs) == {"heavy_ball", "fosi_heavy_ball", "adam", "fosi_adam", "kfac", "lbfgs_L10"}
    assert analysis.best_lbfgs(runs, task) == "lbfgs_L10"
    out, notes = figures.figure6(task, runs, "quick", "algo", tmp_path / "f6.png")
    assert out.is_file() and any("diverged" in n for n in notes)
    assert figures.figure5(task, runs, "quick", "algo", tmp_path / "f5.png").is_file()
    # the AE train loss is reported in the paper's units (2 x the repo's 1/2-SSE)
    assert analysis.train_curve(runs["adam"], task)["loss"].iloc[0] == pytest.approx(
        2 * sum(100.0 / s for s in range(1, 5)) / 4
    )
    table = analysis.time_table({"ae": runs}, "val")
    assert (table[table["task"] == "ae"]["status"] == "completed").all()


def test_run_key_parsing():
    assert analysis.run_key("heavy_ball_paper_s0", "paper") == "heavy_ball"
    assert analysis.run_key("lbfgs_quick_s0_L40", "quick") == "lbfgs_L40"
    assert analysis.run_key("kfac_quick_s0_lradaptive_m0.9", "quick") == "kfac_lradaptive_m0.9"
    assert analysis.run_key("adam_quick_s1", "quick") == ""


def test_driver_plans_the_papers_sweeps_and_skips_missing_data(tmp_path):
    import argparse

    args = argparse.Namespace(kfac_grid="full", lbfgs_histories=[10, 20, 40, 80, 100])
    ae = driver.planned_runs("fig6", analysis.TASKS["ae"], args)
    assert sum(opt == "kfac" for opt, _, _ in ae) == 16 and sum(opt == "lbfgs" for opt, _, _ in ae) == 5
    assert ("lbfgs", "L40", ["optimizer.history_size=40"]) in ae
    lm = driver.planned_runs("fig6", analysis.TASKS["lm"], args)
    assert not any(opt == "kfac" for opt, _, _ in lm)  # as the paper: no K-FAC for the LSTM
    assert [opt for opt, _, _ in driver.planned_runs("table1", analysis.TASKS["lr"], args)] == list(
        analysis.MAIN_OPTIMIZERS
    )
    for key, needle in (
        ("lr", "mnist"),
        ("ae", "cifar-10"),
        ("lm", "input.txt"),
        ("tl", "cifar"),
        ("ac", "audioset"),
    ):
        problem = driver.data_problem(analysis.TASKS[key], tmp_path)
        assert problem is not None and needle in problem.lower()


def test_every_planned_run_config_composes():
    """Each experiment's per-optimizer files (conf/per_optimizer/<experiment>/<optimizer>.yaml) only
    set keys that the optimizer's config (or the experiment's ``optimizer:`` block) declares: the
    loop merges them into a struct config, so an undeclared key fails only at run time (as AE's
    HB/Adam clipping once did). Plain YAML, no Hydra."""
    conf = Path(__file__).resolve().parents[2] / "conf"

    def chain(name: str) -> list[dict]:
        cfg = yaml.safe_load((conf / "experiment" / f"{name}.yaml").read_text())
        parents = [d for d in cfg.get("defaults", []) if isinstance(d, str) and d.startswith("fosi_")]
        return [c for parent in parents for c in chain(parent)] + [cfg]

    checked = 0
    for task in analysis.TASKS:
        for profile in ("", "_paper"):
            name = f"fosi_{task}{profile}"
            declared_here = set().union(*(set(c.get("optimizer") or {}) for c in chain(name)))
            for opt in (*analysis.MAIN_OPTIMIZERS, "kfac", "lbfgs"):
                declared = (
                    set(yaml.safe_load((conf / "optimizer" / f"{opt}.yaml").read_text())) | declared_here
                )
                path = conf / "per_optimizer" / name / f"{opt}.yaml"
                variant = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
                extra = set(variant.get("optimizer") or {}) - declared
                assert not extra, f"{path.relative_to(conf)} sets undeclared {sorted(extra)}"
                checked += 1
    assert checked >= 60


def test_ae_lbfgs_that_did_not_diverge_is_drawn(tmp_path):
    """The paper leaves AE's L-BFGS out because it diverged; a run of ours that did not diverge
    is drawn, and the note says so (a TL-style omission for other reasons stays an omission)."""
    task = analysis.TASKS["ae"]
    rows = [{"step": 0, "epoch": 0.0, "algo_time_s": 0.0, "wall_time_s": 0.0, "val/E_sq": 200.0}]
    for s in range(1, 9):
        rows.append({"step": s, "epoch": s / 4, "algo_time_s": s, "wall_time_s": s, "loss": 100.0 / s})
        if s % 4 == 0:
            rows[-1]["val/E_sq"] = 200.0 / s
    for opt in ("fosi_heavy_ball", "kfac"):
        _write_run(tmp_path, "fosi_ae", f"{opt}_quick_s0", opt, rows)
    _write_run(tmp_path, "fosi_ae", "lbfgs_quick_s0_L10", "lbfgs", rows)
    runs = analysis.load_task(tmp_path, task, "quick")
    _, notes = figures.figure6(task, runs, "quick", "algo", tmp_path / "f6.png")
    assert any("L-BFGS (L=10) drawn" in n and "did not diverge" in n for n in notes)
    _, notes = figures.figure6(task, runs, "quick", "algo", tmp_path / "f6b.png", paper_omissions=False)
    assert not any("L-BFGS" in n for n in notes)


@pytest.mark.parametrize("eval_every", [None, 2])
def test_a_segment_end_evaluation_does_not_count(tmp_path, eval_every):
    """A run continued in segments also evaluates where each segment ended (step 3 here, off the
    every-2-steps schedule). Times to the base's best use the scheduled evaluations only, as a run
    made in one go has them; without a recorded schedule every evaluation counts."""
    _write_run(
        tmp_path, "fosi_lr", "heavy_ball_quick_s0", "heavy_ball", _lr_rows([0.8, 0.85, 0.9], [0.5] * 3, 1.0)
    )
    rows = _lr_rows([0.85, 0.88, 0.91], [0.3] * 3, 1.5)
    rows[3].update({"test/accuracy": 0.95, "test/loss": 0.1})  # step 3, t = 4.5 s: a segment's end
    _write_run(tmp_path, "fosi_lr", "fosi_heavy_ball_quick_s0", "fosi_heavy_ball", rows)
    if eval_every is not None:
        for run in ("heavy_ball_quick_s0", "fosi_heavy_ball_quick_s0"):
            cfg_path = tmp_path / "fosi_lr" / run / "config.yaml"
            cfg = yaml.safe_load(cfg_path.read_text())
            cfg_path.write_text(yaml.safe_dump({**cfg, "trainer": {"eval_every": eval_every}}))
    runs = {"lr": analysis.load_task(tmp_path, analysis.TASKS["lr"], "quick")}
    table = analysis.time_table(runs, "val").set_index(["task", "optimizer"])
    assert table.loc[("lr", "heavy_ball"), "seconds"] == pytest.approx(6.0)
    expected = 4.5 if eval_every is None else 9.0  # scheduled: 0.91 at step 6 (6 * 1.5 s)
    assert table.loc[("lr", "fosi_heavy_ball"), "seconds"] == pytest.approx(expected)


def test_overhead_remeasuring_one_task_keeps_the_other_rows(tmp_path, monkeypatch):
    """experiments.fosi_tasks.overhead: re-measuring LM replaces LM's rows and keeps LR's and AE's."""
    import json

    from experiments.fosi_tasks import overhead

    path = tmp_path / "fosi_overhead_paper.json"
    old = [{"task": t, "base": b, "tau3_s": 1.0} for t in ("lr", "ae", "lm") for b in ("heavy_ball", "adam")]
    path.write_text(json.dumps(old))

    def fake_measure(task, base, *args, **kwargs):
        return {"task": task.key, "base": base, "num_params": 1, "tau1_s": 1.0, "tau2_s": 1.0, "tau3_s": 2.0,
                "ese_in_steps": 2.0, "rho_T800": 1.0, "profile_T": 800, "rho_profile_T": 1.0, "T_for_rho_1.1": 1.0}  # fmt: skip

    monkeypatch.setattr(overhead, "measure", fake_measure)
    monkeypatch.setattr(overhead, "data_problem", lambda task, data_dir: None)
    overhead.main(["--profile", "paper", "--tasks", "lm", "--out", str(tmp_path)])
    rows = json.loads(path.read_text())
    assert [(r["task"], r["base"]) for r in rows] == [(r["task"], r["base"]) for r in old]
    assert [r["tau3_s"] for r in rows] == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    assert all("measured_at" in r for r in rows if r["task"] == "lm")


def test_figure_provenance_names_profile_device_seeds_and_clock():
    import pandas as pd

    runs = {
        "heavy_ball": pd.DataFrame(
            {"device": ["auto"], "seed": [0], "clock": ["process"], "num_threads": [1.0]}
        ),
        "kfac": pd.DataFrame({"device": ["cpu"], "seed": [1], "clock": ["process"], "num_threads": [1.0]}),
    }
    assert figures.provenance(runs, "paper") == "profile paper · cpu · seeds 0,1 · process clock, 1 thread"
    assert figures.provenance({"x": pd.DataFrame({"step": [1]})}, "quick") == "profile quick"


def test_figure6_axis_zooms_past_an_untrained_start_only():
    import matplotlib.pyplot as plt

    from experiments.fosi_tasks.figures import _zoom_past_start

    fig, (spiky, flat) = plt.subplots(1, 2)
    t = list(range(100))
    spiky.plot(t, [790.0] + [60.0 - 0.1 * i for i in t[1:]])
    spiky.plot(t, [800.0] + [62.0 - 0.05 * i for i in t[1:]])
    _zoom_past_start(spiky)
    lo, hi = spiky.get_ylim()
    # the late curves span 50.1 to 61.75; the 790-800 start is cut off
    assert 49.0 < lo < 50.1 and 61.75 < hi < 63.0, (lo, hi)
    flat.plot(t, [2.0 - 0.01 * i for i in t])
    before = flat.get_ylim()
    _zoom_past_start(flat)
    assert flat.get_ylim() == before
    plt.close(fig)
