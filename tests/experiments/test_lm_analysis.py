"""RACS/Alice LLM analysis from run records: speed-up to Adam's final ppl, effective
throughput, the Table 2 layout next to the paper's numbers, and the figures' files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from experiments.alice_llm import basis_stability as basis
from experiments.alice_llm import figures, memory, specs


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one thread is as fast, and threaded EVD/QR crawls when other processes share
    the 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _fake_run(
    root: Path, experiment: str, key: str, ppl: list[float], tps: float, status: str = "completed"
) -> None:
    m = specs.method_by_key(key)
    run = root / experiment / f"{m.optimizer}_quick_s0{'_' + m.suffix if m.suffix else ''}"
    run.mkdir(parents=True)
    steps = [25 * i for i in range(len(ppl))]
    rows = [{"step": s, "val/ppl": p, "val/ppl_galore": p * 0.9} for s, p in zip(steps, ppl)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text(
        yaml.safe_dump({"profile": "quick", "tag": key, "seed": 0, "optimizer": {"name": m.optimizer}})
    )
    summary = {
        "status": status,
        "profile": "quick",
        "tag": key,
        "tokens_per_s": tps,
        "peak_mem_bytes": 1e9,
        "device": "cpu",
        "device_name": "testcpu",
    }
    (run / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def results(tmp_path):
    adam = [1000, 400, 300, 250, 220, 200, 190, 185, 180]
    _fake_run(tmp_path, "alice_c4", "adam", adam, 1000.0)
    _fake_run(tmp_path, "alice_c4", "alice", [1000, 300, 200, 179, 170, 160, 150, 140, 130], 800.0)
    _fake_run(tmp_path, "alice_c4", "racs", [1000, 350, 250, 200, 185, 181, 180, 175, 170], 950.0)
    _fake_run(tmp_path, "alice_c4", "galore", [1000, 500, 400, 350, 300, 280, 260, 250, 240], 900.0)
    return tmp_path


def test_speedup_reads_the_eval_grid():
    adam = (np.array([0, 25, 50, 75, 100.0]), np.array([900, 300, 200, 150, 120.0]))
    method = (np.array([0, 25, 50, 75, 100.0]), np.array([900, 200, 119, 100, 90.0]))
    assert figures.speedup(adam, method) == pytest.approx(100 / 50)
    never = (method[0], np.array([900, 300, 200, 150, 121.0]))
    assert math.isnan(figures.speedup(adam, never))
    # the step-0 evaluation never counts, even if it is (absurdly) below the target
    assert figures.steps_to_reach(np.array([0, 10.0]), np.array([1.0, 5.0]), 2.0) != 0


def test_table2_frame_speedup_and_effective_tp(results):
    df = figures.table2_frame(results, "quick").set_index("method")
    assert df.loc["adam", "ppl"] == 180 and df.loc["adam", "speedup"] == pytest.approx(1.0)
    assert df.loc["alice", "speedup"] == pytest.approx(200 / 75)  # 179 <= 180 at step 75
    assert df.loc["alice", "effective_tp"] == pytest.approx(800 * 200 / 75)
    assert df.loc["alice", "tp_vs_adam"] == pytest.approx(0.8)
    assert df.loc["racs", "speedup"] == pytest.approx(200 / 150)
    assert math.isnan(df.loc["galore", "speedup"]) and df.loc["galore", "effective_tp"] == 0.0
    assert df.loc["fira", "status"] == "missing"
    assert df.loc["alice", "ppl_galore_eval"] == pytest.approx(130 * 0.9)


def test_table2_markdown_has_paper_numbers(results, tmp_path):
    path = figures.table2(results, "quick", None, tmp_path / "out")
    text = path.read_text()
    assert "| Alice |" in text and "130.00" in text and "Speed-up in steps (Alice)" in text
    # paper column only at paper sizes: the quick (tiny) size has no paper numbers
    assert "(28.69)" not in text
    df = figures.paper_numbers()
    assert figures.paper_value("table2", "alice", "60m", "method", "ppl") == 28.69
    assert figures.paper_value("table2", "racs", "1b", "adam", "eff_tp") == 129817
    assert len(df[(df["table"] == "table2") & (df["metric"] == "ppl")]) == 52


def test_figures_write_png_and_csv(results, tmp_path):
    out = tmp_path / "figs"
    for path in (
        figures.fig_curves(results, "quick", None, out, "fig2"),
        figures.fig3(results, "quick", None, out),
        figures.fig5(results, "quick", "tiny", out),
        figures.fig4(results, "quick", out),
        figures.fig6(results, "quick", out),
    ):
        assert path.exists() and path.stat().st_size > 1000
        assert path.with_suffix(".csv").exists()
    curve = (out / "alice_fig2_quick.png").with_suffix(".csv").read_text()
    assert "alice" in curve and "racs" in curve


def test_run_specs_are_consistent():
    keys = [m.key for m in specs.TABLE2_METHODS]
    assert len(keys) == len(set(keys)) == 10
    head = [m for m in specs.TABLE2_METHODS if m.head == "adam" and m.low_rank]
    assert {m.suffix for m in head} == {"head_adam"}
    alice = specs.method_by_key("alice")
    assert f"{specs.HEAD_KEY}=true" in alice.run_overrides() and "tag=alice" in alice.run_overrides()
    assert specs.experiment_for("tiny") == "alice_c4" and specs.experiment_for("130m") == "alice_c4_130m"


def _tiny_lm():
    from curvopt.models.llama import llama_lm

    torch.manual_seed(0)
    return llama_lm("tiny")


@pytest.mark.parametrize("method", ["adam", "racs"])
def test_layerwise_updates_equal_normal_steps(method):
    from curvopt.objective import mean_loss
    from curvopt.optim.grouping import build_optimizer

    x = torch.randint(3, 256, (2, 16))
    params = []
    for layerwise in (False, True):
        model = _tiny_lm()
        opt = build_optimizer(model, method, lr=0.01)
        if layerwise:
            handles = memory.make_layerwise(opt)
            assert len(handles) == sum(1 for _ in model.parameters())
        for _ in range(3):
            mean_loss(model(x), x[:, 1:], "cross_entropy").backward()
            if not layerwise:
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())  # freed as soon as used
        params.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_basis_recorder_sees_every_refresh():
    from curvopt.objective import mean_loss
    from curvopt.optim.grouping import build_optimizer

    model = _tiny_lm()
    opt = build_optimizer(model, "alice", lr=0.01, rank=16, leading=8, update_interval=2, switch="none")
    name = basis.target_param_name(model)
    assert name.endswith("layers.1.mlp.down_proj.weight")
    rows: list = []
    basis.attach_recorder(opt, dict(model.named_parameters())[name], name, rows, "v")
    x = torch.randint(3, 256, (2, 16))
    for _ in range(6):
        mean_loss(model(x), x[:, 1:], "cross_entropy").backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert sorted({r["step"] for r in rows}) == [2, 4, 6]  # t = 1 has no previous basis
    assert {r["index"] for r in rows} == {1, 2, 4, 8}
    assert all(0.0 <= r["abs_cos"] <= 1.0 + 1e-6 for r in rows)
