"""FGN / SGN / Adam through the shared loop on a shrunken fgn_cars196 experiment."""

from __future__ import annotations

import json

import pytest
import torch

from curvopt.training.build import run_from_config
from tests.conftest import compose

SMALL = [
    "dataset.num_train=600",
    "dataset.num_test=300",
    "dataset.dim=64",
    "dataset.num_classes=20",
    "dataset.num_makes=5",
    "dataset.make_scale=1.5",
    "dataset.model_scale=1.0",
    "dataset.latent_dim=16",
    "model.in_features=64",
    "model.num_classes=20",
    "trainer.max_steps=30",
    "trainer.eval_every=10",
    "logger=none",
]


@pytest.mark.parametrize("optimizer", ["fgn", "sgn", "adam"])
def test_cars196_experiment_trains_and_logs(optimizer, tmp_path):
    cfg = compose(
        [
            "experiment=fgn_cars196",
            f"optimizer={optimizer}",
            f"paths.results_dir={tmp_path}",
            "run_id=r",
            *SMALL,
        ]
    )
    assert cfg.trainer.sampling == "static_padded" and cfg.trainer.batch_size == 128
    summary = run_from_config(cfg)
    assert summary["status"] == "completed" and summary["synthetic_data"] is True
    rows = [
        json.loads(line)
        for line in (tmp_path / "fgn_cars196" / "r" / "metrics.jsonl").read_text().splitlines()
    ]
    evals = [r for r in rows if "test/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 10, 20, 30]
    assert evals[-1]["test/loss"] < evals[0]["test/loss"]
    if optimizer != "adam":  # Adam at lr 3e-4 moves little in 30 steps; the Newton-type steps do
        assert evals[-1]["test/loss"] < evals[0]["test/loss"] - 0.2
        assert evals[-1]["test/accuracy"] > 3 * evals[0]["test/accuracy"]
    steps = [r for r in rows if "loss" in r]
    if optimizer != "adam":
        assert all(1 <= r["cg_iters"] <= 5 and r["cg_breakdown"] == 0 for r in steps)
        assert all(0 <= r["xi_mean"] <= 1 for r in steps)
    if optimizer == "fgn":
        assert {r["implementation"] for r in steps} == {"affine"}
    if optimizer == "adam":
        assert steps[0]["lr"] == pytest.approx(3e-4)  # the experiment's Adam variant


def test_static_padded_sampler_repeats_the_same_padded_batches_every_epoch():
    """The paper's static batching: one permutation, ceil(n/b) batches per epoch, the last one
    padded by wrap-around to the start, identical batches every epoch (8,144 / 128 -> 64 steps)."""
    from curvopt.training.sampler import BatchSampler

    sampler = BatchSampler(10, "static_padded", seed=3)
    perm = sampler._perm.tolist()
    epoch = [sampler.next_indices(4).tolist() for _ in range(3)]
    assert epoch == [perm[0:4], perm[4:8], perm[8:10] + perm[0:2]]
    assert [sampler.next_indices(4).tolist() for _ in range(3)] == epoch  # same batches again
    state = sampler.state_dict()
    nxt = sampler.next_indices(4).tolist()
    again = BatchSampler(10, "static_padded", seed=99)
    again.load_state_dict(state)
    assert again.next_indices(4).tolist() == nxt == perm[0:4]
    cars = BatchSampler(8144, "static_padded", seed=0)
    seen = [cars.next_indices(128) for _ in range(64)]
    assert len(torch.cat(seen).unique()) == 8144 and cars.next_indices(128).equal(seen[0])
