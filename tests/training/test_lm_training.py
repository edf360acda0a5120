"""LLM training pieces: the warmup-cosine schedule, label alignment of the LLaMA wrapper,
token-weighted perplexity (and GaLore's off-by-one value), gradient accumulation, and resume
equality of a tiny LLaMA on the C4 sample (in memory and streaming)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from curvopt.models.causal_lm import causal_lm
from curvopt.objective import Objective, mean_loss
from curvopt.training.algorithm import TorchOptimizerAlgorithm
from curvopt.training.build import run_from_config
from curvopt.training.evaluation import evaluate_split
from curvopt.training.loop import TIMING_FIELDS
from curvopt.training.records import read_metrics
from curvopt.training.schedules import warmup_cosine, warmup_cosine_factor
from tests.conftest import compose

TINY_LLAMA = {
    "_target_": "curvopt.models.causal_lm.causal_lm",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
    "loss": "cross_entropy",
}


# -- schedule -------------------------------------------------------------------------------------
def test_warmup_cosine_values():
    f = lambda s: warmup_cosine_factor(s, total_steps=100, warmup_steps=10, min_lr_ratio=0.1)  # noqa: E731
    assert f(0) == 0.0 and f(5) == pytest.approx(0.5) and f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert f(100) == pytest.approx(0.1) and f(150) == pytest.approx(0.1)
    # GaLore's formula at an arbitrary point
    p = (73 - 10) / 90
    assert f(73) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
    assert all(f(s) >= f(s + 1) for s in range(10, 100))  # monotone after warmup


def test_scheduler_lr_used_per_update():
    w, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 1e-3}], lr=0.02)  # 2 groups, 2 peaks
    sched = warmup_cosine(opt, total_steps=20, warmup_fraction=0.1)
    lrs = []
    for _ in range(20):
        lrs.append((opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]))
        opt.step()
        sched.step()
    assert lrs[0] == (0.0, 0.0) and lrs[1] == pytest.approx((0.01, 5e-4))
    assert lrs[2] == pytest.approx((0.02, 1e-3))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.002)  # 0.1 x peak after the last update


# -- model ----------------------------------------------------------------------------------------
def test_wrapper_loss_equals_hf_loss():
    torch.manual_seed(0)
    model = causal_lm(**{k: v for k, v in TINY_LLAMA.items() if k not in ("_target_", "loss")}).double()
    x = torch.randint(3, 256, (3, 10))
    x[0, 7:] = 0  # padding
    labels = x.clone()
    labels[0, 7:] = -100
    out = model(x)
    assert out.shape == (3, 9, 256)
    ours = float(mean_loss(out, labels[:, 1:], "cross_entropy").detach())
    full = model.lm(input_ids=x).logits  # HF's own (B, T, V) logits, float64 here
    ref = torch.nn.functional.cross_entropy(full[:, :-1].reshape(-1, 256), labels[:, 1:].reshape(-1))
    assert ours == pytest.approx(float(ref.detach()), rel=1e-12)
    assert ours == pytest.approx(float(model.hf_loss(x, labels)), rel=1e-6)  # HF upcasts to fp32 only


def test_sequence_longer_than_positions_is_refused_with_a_message():
    model = causal_lm(**{k: v for k, v in TINY_LLAMA.items() if k not in ("_target_", "loss")})
    with pytest.raises(ValueError, match="max_length"):
        model(torch.zeros(1, 65, dtype=torch.long))


# -- evaluation -----------------------------------------------------------------------------------
class _FixedLogits(torch.nn.Module):
    """Logits that make token t's CE equal to a known value."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table  # (N, T, V)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx]


def test_eval_token_weighted_mean_and_galore_value():
    torch.manual_seed(0)
    n, t, v = 5, 4, 7
    logits = torch.randn(n, t, v, dtype=torch.float64)
    y = torch.randint(0, v, (n, t))
    y[0, 1:] = -100  # 1 token
    y[3, 2:] = -100  # 2 tokens
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, v), y.reshape(-1), reduction="none", ignore_index=-100
    )
    mask = (y != -100).reshape(-1)
    expected = float(ce[mask].sum() / mask.sum())
    obj = Objective(_FixedLogits(logits), "cross_entropy")
    m = evaluate_split(obj, torch.arange(n), y, batch_size=2, galore_compat=True)
    assert m["loss"] == pytest.approx(expected, rel=1e-12)
    assert m["ppl"] == pytest.approx(math.exp(expected), rel=1e-12)
    assert m["tokens"] == float(mask.sum())
    # GaLore: sum of per-batch means / (batches + 1); batches of 2, 2, 1 examples
    ce2 = ce.view(n, t)
    means = [float(ce2[s : s + 2][y[s : s + 2] != -100].mean()) for s in (0, 2, 4)]
    assert m["loss_galore"] == pytest.approx(sum(means) / 4, rel=1e-12)
    # a plain (unweighted) mean of batch means would differ: the test can tell them apart
    assert abs(sum(means) / 3 - expected) > 1e-6


# -- gradient accumulation ------------------------------------------------------------------------
def test_accumulation_equals_full_batch_for_token_means():
    torch.manual_seed(0)
    cfg = {k: v for k, v in TINY_LLAMA.items() if k not in ("_target_", "loss")}
    x = torch.randint(3, 256, (8, 12))
    y = x[:, 1:].clone()
    # equal token counts per micro-batch so the mean of micro-batch means is the full-batch mean
    results = []
    for micro in (None, 2):
        torch.manual_seed(1)
        model = causal_lm(**cfg).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        algo = TorchOptimizerAlgorithm(Objective(model, "cross_entropy"), opt, micro_batch_size=micro)
        out = algo.step((x, y))
        results.append((out["loss"], [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-12)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# -- end to end: records and resume ---------------------------------------------------------------
def _lm_cfg(tmp_path: Path, extra: list[str], streaming: bool = False):
    cfg = compose(
        [
            "dataset=c4_stream" if streaming else "dataset=c4",
            "model=tiny_mlp",
            "logger=none",
            f"paths.results_dir={tmp_path}",
            "experiment_name=lm",
            "dataset.max_length=24",
            "dataset.num_train_docs=40",
            "dataset.num_val_docs=6",
            "dataset.val_tokens=null",
            "dataset.vocab_limit=256",
            "dataset.shuffle_buffer=100",
            "trainer.batch_size=8",
            "trainer.micro_batch_size=4",
            "trainer.eval_every=5",
            "trainer.eval_batch_size=4",
            "trainer.eval_splits=[val]",
            "trainer.eval_galore_compat=true",
            "trainer.progress=false",
            "trainer.deterministic=false",
            *extra,
        ]
    )
    with open_dict(cfg):
        cfg.model = OmegaConf.create(TINY_LLAMA)
        cfg.optimizer.scheduler = OmegaConf.create(
            {"_target_": "curvopt.training.schedules.warmup_cosine", "total_steps": 12}
        )
    return cfg


def _rows(summary):
    rows = read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]


@pytest.fixture(scope="module")
def _has_c4():
    from tests.conftest import data_dir

    if not (data_dir() / "c4" / "train.jsonl.gz").exists():
        pytest.skip("no C4 sample")


# the streaming variant re-reads the stream on resume (~2x the in-memory one); the data-level
# exact-resume test (test_lm_data.test_stream_resume_is_exact) stays in the default suite
@pytest.mark.parametrize("streaming", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_lm_run_records_and_resume(tmp_path, _has_c4, streaming):
    full = run_from_config(_lm_cfg(tmp_path, ["trainer.max_steps=12", "run_id=full"], streaming))
    run_from_config(_lm_cfg(tmp_path, ["trainer.max_steps=5", "run_id=part"], streaming))
    (tmp_path / "lm" / "part" / "summary.json").unlink()
    resumed = run_from_config(
        _lm_cfg(tmp_path, ["trainer.max_steps=12", "run_id=part", "trainer.resume=true"], streaming)
    )
    r_full, r_res = _rows(full), _rows(resumed)
    assert r_full == r_res
    last = r_full[-1]
    assert {"val/ppl", "val/loss_galore", "val/ppl_galore", "tokens", "tokens_seen"} <= set(last)
    assert last["val/ppl"] == pytest.approx(math.exp(last["val/loss"]))
    assert last["val/loss_galore"] < last["val/loss"]  # the off-by-one divides by one batch more
    assert r_full[1]["lr"] == 0.0 and r_full[-1]["loss"] < r_full[1]["loss"]
    assert full["tokens_per_s"] > 0 and full["tokens_seen"] == last["tokens_seen"]
    assert sum(r["tokens"] for r in r_full if "tokens" in r) == last["tokens_seen"]


def test_lm_divergence_keeps_records(tmp_path, _has_c4):
    cfg = _lm_cfg(tmp_path, ["optimizer=sgd", "optimizer.lr=1e38", "trainer.max_steps=12", "run_id=boom"])
    with open_dict(cfg):
        cfg.optimizer.pop("scheduler")
    summary = run_from_config(cfg)
    assert summary["status"] == "diverged" and summary["stop_reason"] == "non_finite_loss"
    rows = read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")
    assert rows[-1]["step"] == summary["steps"] < 12 and (Path(summary["run_dir"]) / "summary.json").exists()


@pytest.mark.parametrize(
    ("size", "steps", "rank", "adam_lr", "alice_alpha"),
    [
        ("60m", 10000, 128, 1e-3, 0.3),
        ("130m", 20000, 256, 1e-3, 0.3),
        ("350m", 60000, 256, 1e-3, 0.3),
        ("1b", 100000, 512, 7e-4, 0.25),
    ],
)
def test_paper_configs_follow_the_spec_tables(size, steps, rank, adam_lr, alice_alpha):
    def cfg(optimizer):
        return compose([f"experiment=alice_c4_{size}_paper", f"optimizer={optimizer}"])

    alice, adam, racs = cfg("alice"), cfg("adam"), cfg("racs")
    assert alice.profile == "paper" and alice.experiment_name == f"alice_c4_{size}"
    assert (
        alice.trainer.max_steps == steps
        and alice.trainer.batch_size == 512
        and alice.trainer.eval_every == 500
    )
    assert alice.optimizer.scheduler.total_steps == steps and alice.optimizer.scheduler.warmup_fraction == 0.1
    assert (
        alice.optimizer.rank == rank and alice.optimizer.alpha == alice_alpha and alice.optimizer.lr == 0.02
    )
    assert adam.optimizer.lr == pytest.approx(adam_lr)
    assert racs.optimizer.alpha == (0.02 if size == "1b" else 0.05)
    assert (
        alice.dataset.max_length == 256 and alice.dataset.streaming and alice.dataset.val_tokens == 10_000_000
    )
    assert alice.dataset.vocab_limit is None and alice.trainer.dtype == "bfloat16"
    assert alice.model.size == size
