"""Two-iteration smoke runs of every SHF-LSMR experiment config (both methods), and the Figure 2 /
Figure 3 / Table 2 code drawing from the records those runs write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from curvopt.errors import DataNotFoundError
from curvopt.training.build import run_from_config
from curvopt.training.records import read_metrics
from experiments.shf import figures
from tests.conftest import CONF_DIR, compose

DATASETS = ("mnist", "curves", "usps")
METHODS = ("shf_lsmr", "hf_cg")
# Small subsets so a smoke run costs a second or two; everything else is the experiment's config.
SHRINK = {
    "mnist": ["dataset.num_train=300", "dataset.num_val=100", "dataset.num_test=100"],
    "curves": [
        "dataset.num_train=300",
        "dataset.num_val=100",
        "dataset.num_test=100",
        "+dataset.generated_train=300",
        "+dataset.generated_test=200",
        "dataset.cache=false",
    ],
    "usps": ["dataset.num_train=300", "dataset.num_val=100", "dataset.num_test=100"],
}
METHOD_SHRINK = {
    "shf_lsmr": [
        "optimizer.batch_size=60",
        "optimizer.maxiter=8",
        "optimizer.miniter=2",
    ],
    "hf_cg": ["optimizer.cg_maxiter=5"],
}


def test_every_shf_experiment_has_quick_and_paper_profiles():
    names = {p.stem for p in (CONF_DIR / "experiment").glob("shf_fig2_*.yaml")}
    for d in DATASETS:
        assert {f"shf_fig2_{d}", f"shf_fig2_{d}_paper"} <= names
        quick = compose([f"experiment=shf_fig2_{d}"])
        paper = compose([f"experiment=shf_fig2_{d}_paper", "optimizer=hf_cg"])
        assert quick.profile == "quick" and quick.trainer.max_algo_time_s > 0
        assert paper.profile == "paper" and paper.trainer.clock == "wall"
        assert paper.trainer.max_steps == 500  # Martens' 500 outer iterations
        if d == "usps":  # USPS is not in Martens (2010): HF-CG trains SHF's network (decisions SHF-16)
            assert paper.model.code_activation == "sigmoid" and paper.model.loss == "squared_error"
            assert paper.optimizer.weight_cost == 0 and paper.trainer.patience_evals == 75
        else:  # Martens' own network on the datasets the paper re-ran his experiments on
            assert paper.model.code_activation is None and paper.model.loss == "sigmoid_bce"
            assert paper.trainer.patience_evals is None
    # Table 1 of the paper: initial / maximum batch sizes and splits
    mnist = compose(["experiment=shf_fig2_mnist_paper"])
    assert (mnist.optimizer.batch_size, mnist.optimizer.max_batch_size, mnist.optimizer.damping) == (
        300,
        6000,
        12,
    )
    assert (mnist.dataset.num_train, mnist.dataset.num_val) == (50000, 10000)
    curves = compose(["experiment=shf_fig2_curves_paper"])
    assert (curves.optimizer.batch_size, curves.optimizer.max_batch_size, curves.optimizer.theta) == (
        250,
        2500,
        0.5,
    )
    usps = compose(["experiment=shf_fig2_usps_paper"])
    assert (usps.optimizer.gamma, usps.optimizer.atol, usps.model.sparse_init_count) == (0.65, 1e-6, 10)


@pytest.mark.parametrize("dataset", DATASETS)
def test_two_iterations_of_each_method_then_figures(dataset, tmp_path):
    for method in METHODS:
        cfg = compose(
            [
                f"experiment=shf_fig2_{dataset}",
                f"optimizer={method}",
                "logger=none",
                "trainer.progress=false",
                "trainer.max_steps=2",
                "trainer.eval_every=1",
                f"paths.results_dir={tmp_path}",
                f"run_id={method}_quick_s0",
                *SHRINK[dataset],
                *METHOD_SHRINK[method],
            ]
        )
        try:
            summary = run_from_config(cfg)
        except DataNotFoundError as err:
            pytest.skip(f"data not available here: {str(err).splitlines()[0]}")
        assert summary["status"] == "completed", summary
        rows = read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")
        assert [r["step"] for r in rows] == [0, 1, 2]
        for key in (
            "batch_size",
            "damping",
            "inner_iters",
            "inner_stop",
            "step_length",
            "rho",
            "train/E_sq",
            "train/f",
            "val/E_sq",
            "test/E_sq",
        ):
            assert key in rows[-1], key
        assert rows[-1]["train/f"] == pytest.approx(rows[-1]["train/E_sq"] / 2)
        summary_file = json.loads((Path(summary["run_dir"]) / "summary.json").read_text())
        assert summary_file["steps"] == 2
    out = tmp_path / "figs"
    png = figures.fig2(tmp_path, [dataset], "quick", out / "fig2.png")
    assert png.exists() and png.with_suffix(".csv").exists()
    assert figures.fig3(tmp_path, [dataset], "quick", out / "fig3.png").exists()
    table = figures.table2(tmp_path, [dataset], "quick", out)
    assert set(table["method"]) == set(METHODS)
    assert table["ours_test_E_sq"].notna().all()
    assert (out / "shf_table2_quick.md").read_text().count("NOT the paper's scale") == 1


def test_figures_say_not_run_without_records(tmp_path):
    png = figures.fig2(tmp_path, ["usps"], "paper", tmp_path / "fig2.png")
    assert png.exists() and not png.with_suffix(".csv").exists()
    table = figures.table2(tmp_path, ["usps"], "paper", tmp_path)
    assert list(table["status"]) == ["not run", "not run"]


def test_budget_label_gives_seed_counts_per_dataset_when_panels_differ():
    """The suptitle must not quote one panel's seed count for every panel."""
    import pandas as pd

    def frame(runs):
        return pd.DataFrame(
            [{"optimizer": m, "run_id": f"{m}_s{i}", "status": st} for i, (m, st) in enumerate(runs)]
        )

    usps = frame(
        [("hf_cg", "completed"), ("hf_cg", "completed"), ("hf_cg", "interrupted"), ("shf_lsmr", "completed")]
    )
    curves = frame([("hf_cg", "completed"), ("shf_lsmr", "completed")])
    label = figures.budget_label({"curves": curves, "usps": usps, "mnist": pd.DataFrame()})
    assert "CURVES: Martens HF-CG: 1 seed(s), SHF-LSMR (ours): 1 seed(s)" in label
    assert "USPS: Martens HF-CG: 2 seed(s) + 1 in progress, SHF-LSMR (ours): 1 seed(s)" in label
    same = figures.budget_label({"curves": curves, "usps": curves.copy()})
    assert same == "Martens HF-CG: 1 seed(s), SHF-LSMR (ours): 1 seed(s)"


def test_fig2_mean_is_over_finished_runs_only(tmp_path):
    """A seed still in progress is drawn thinly, not averaged: the mean curve keeps the finished
    runs' whole time range."""
    import pandas as pd
    import yaml

    def write(run_id, seed, status, times):
        run = tmp_path / "shf_fig2_usps" / run_id
        run.mkdir(parents=True)
        cfg = {
            "profile": "paper",
            "seed": seed,
            "dataset": {"name": "usps"},
            "optimizer": {"name": "shf_lsmr"},
        }
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
        rows = [
            {
                "step": i + 1,
                "algo_time_s": t,
                "train/E_sq": 10.0 / (i + 1),
                "val/E_sq": 12.0 / (i + 1),
                "test/E_sq": 12.0 / (i + 1),
            }
            for i, t in enumerate(times)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = {
            "status": status,
            "profile": "paper",
            "seed": seed,
            "run_id": run_id,
            "optimizer": "shf_lsmr",
        }
        (run / "summary.json").write_text(json.dumps(summary))

    write("shf_lsmr_paper_s0", 0, "completed", [1.0, 2.0, 3.0, 4.0])
    write("shf_lsmr_paper_s1", 1, "interrupted", [1.0])
    png = figures.fig2(tmp_path, ["usps"], "paper", tmp_path / "fig2.png")
    curve = pd.read_csv(png.with_suffix(".csv"))
    test = curve[(curve["method"] == "shf_lsmr") & (curve["split"] == "test")]
    assert (test["seeds"] == 1).all()
    assert test["algo_time_s"].max() == pytest.approx(4.0)  # not cut at the in-progress run's 1 s


def test_work_comparison_reads_both_methods_at_equal_curvature_work():
    """Hand-worked: work = Σ inner_iters × batch_size; the test error is interpolated at the
    smallest final work over completed runs, averaged over seeds; unfinished runs are left out."""
    import pandas as pd

    from experiments.shf.work import work_comparison

    def run(method, run_id, inner, batch, test, cpu, status="completed"):
        return pd.DataFrame(
            {
                "optimizer": method,
                "run_id": run_id,
                "profile": "paper",
                "status": status,
                "step": range(1, len(inner) + 1),
                "inner_iters": inner,
                "batch_size": batch,
                "test/E_sq": test,
                "algo_time_s": [cpu * (i + 1) / len(inner) for i in range(len(inner))],
            }
        )

    runs = pd.concat(
        [
            # work 100, 300, 600; evaluated at steps 1 and 3 only
            run("shf_lsmr", "shf_lsmr_paper_s0", [1, 2, 3], [100] * 3, [10.0, None, 4.0], cpu=6.0),
            run("shf_lsmr", "shf_lsmr_paper_s1", [2, 4], [100] * 2, [8.0, 2.0], cpu=12.0),  # work 200, 600
            run("hf_cg", "hf_cg_paper_s0", [4, 4], [100] * 2, [6.0, 5.0], cpu=1.6),  # work 400, 800
            run("hf_cg", "hf_cg_paper_s9", [1], [100], [99.0], cpu=1.0, status="running_or_killed"),
        ],
        ignore_index=True,
    )
    res = work_comparison(runs, "paper")
    assert set(res["per_run"]) == {"shf_lsmr_paper_s0", "shf_lsmr_paper_s1", "hf_cg_paper_s0"}
    assert res["common_work"] == 600.0
    # SHF: s0 at 600 -> 4.0, s1 at 600 -> 2.0; HF-CG at 600: halfway between 6 (400) and 5 (800) -> 5.5
    assert res["test_E_sq_at_common_work"] == pytest.approx({"shf_lsmr": 3.0, "hf_cg": 5.5})
    assert res["ratio"] == pytest.approx(3.0 / 5.5)
    assert res["per_run"]["hf_cg_paper_s0"]["cpu_s_per_million_products"] == pytest.approx(1e6 * 1.6 / 800)
    assert work_comparison(runs[runs["optimizer"] == "hf_cg"], "paper")["ratio"] is None
    assert work_comparison(runs.drop(columns="inner_iters"), "paper")["ratio"] is None
