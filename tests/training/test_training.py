"""The loop: records, resume equality, divergence, missing/corrupt data, wandb offline."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch

from curvopt.data.mnist import load_mnist, parse_idx
from curvopt.errors import CorruptDataError, DataNotFoundError
from curvopt.training.build import run_from_config
from curvopt.training.loop import TIMING_FIELDS
from curvopt.training.records import read_metrics
from tests.conftest import TINY_RUN, compose

TINY = TINY_RUN


def _run(tmp_path: Path, extra: list[str]) -> dict:
    cfg = compose([*TINY, f"paths.results_dir={tmp_path}", "experiment_name=t", *extra])
    return run_from_config(cfg)


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]


def test_run_writes_records(tmp_path):
    summary = _run(tmp_path, ["optimizer=adam", "trainer.max_steps=12", "run_id=a"])
    run_dir = Path(summary["run_dir"])
    assert {p.name for p in run_dir.iterdir()} >= {
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
        "checkpoint.pt",
    }
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(13))
    assert {"train/loss", "val/accuracy", "test/loss"} <= set(rows[0])
    assert rows[-1]["algo_time_s"] > 0 and rows[-1]["wall_time_s"] >= rows[-1]["algo_time_s"]
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["status"] == "completed" and saved["steps"] == 12
    assert saved["final"]["val/accuracy"] == rows[-1]["val/accuracy"]
    assert saved["best"]["step"] in (0, 5, 10, 12)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]  # Adam learns the clusters


def test_same_seed_same_curve(tmp_path):
    a = _run(tmp_path, ["optimizer=heavy_ball", "trainer.max_steps=8", "run_id=a"])
    b = _run(tmp_path, ["optimizer=heavy_ball", "trainer.max_steps=8", "run_id=b"])
    ra = _comparable(read_metrics(Path(a["run_dir"]) / "metrics.jsonl"))
    rb = _comparable(read_metrics(Path(b["run_dir"]) / "metrics.jsonl"))
    assert ra == rb


@pytest.mark.parametrize("optimizer", ["adam", "heavy_ball"])
def test_resume_equals_uninterrupted(tmp_path, optimizer):
    full = _run(tmp_path, [f"optimizer={optimizer}", "trainer.max_steps=20", "run_id=full"])
    # stop after 10 steps (a scheduled evaluation, so the rows are the same), as if killed
    # after the checkpoint, then resume to 20 in the same run directory
    _run(tmp_path, [f"optimizer={optimizer}", "trainer.max_steps=10", "run_id=part"])
    (Path(tmp_path) / "t" / "part" / "summary.json").unlink()
    resumed = _run(
        tmp_path, [f"optimizer={optimizer}", "trainer.max_steps=20", "run_id=part", "trainer.resume=true"]
    )
    r_full = _comparable(read_metrics(Path(full["run_dir"]) / "metrics.jsonl"))
    r_res = _comparable(read_metrics(Path(resumed["run_dir"]) / "metrics.jsonl"))
    assert [r["step"] for r in r_res] == list(range(21))
    assert r_res == r_full  # every logged value, exactly
    assert resumed["status"] == "completed" and resumed["steps"] == 20
    assert resumed["best"] == full["best"] | {"algo_time_s": resumed["best"]["algo_time_s"]}


def test_resume_without_checkpoint_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="needs run_id=<existing run>"):
        _run(tmp_path, ["optimizer=adam", "run_id=nothing", "trainer.resume=true"])


def test_finished_run_is_not_overwritten(tmp_path):
    _run(tmp_path, ["optimizer=adam", "trainer.max_steps=2", "run_id=x"])
    with pytest.raises(FileExistsError, match="already holds a finished run"):
        _run(tmp_path, ["optimizer=adam", "trainer.max_steps=2", "run_id=x"])


def test_divergence_is_recorded(tmp_path):
    summary = _run(
        tmp_path,
        [
            "dataset=synthetic_images",
            "model=tiny_autoencoder",
            "model.output_activation=null",
            "model.activation=tanh",
            "model.code_activation=null",
            "optimizer=sgd",
            "optimizer.lr=50",
            "trainer.max_steps=200",
            "run_id=boom",
        ],
    )
    assert summary["status"] == "diverged"
    assert summary["stop_reason"] == "non_finite_loss"
    rows = read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")
    assert rows and rows[-1]["step"] == summary["steps"] < 50
    last_loss = rows[-1]["loss"]
    assert isinstance(last_loss, str) or not math.isfinite(last_loss)


def test_wandb_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    summary = _run(
        tmp_path,
        ["optimizer=adam", "trainer.max_steps=3", "run_id=w", "logger=wandb", f"paths.output_dir={tmp_path}"],
    )
    assert summary["status"] == "completed"
    assert (Path(summary["run_dir"]) / "metrics.jsonl").exists()
    offline = list((tmp_path / "wandb").glob("offline-run-*"))
    assert offline, "wandb offline run directory was not created"


def test_wandb_failure_only_warns(tmp_path, monkeypatch):
    import wandb

    def broken_init(*args, **kwargs):
        raise RuntimeError("no service")

    monkeypatch.setattr(wandb, "init", broken_init)
    with pytest.warns(UserWarning, match="local run records only"):
        summary = _run(tmp_path, ["optimizer=adam", "trainer.max_steps=2", "run_id=wf", "logger=wandb"])
    assert summary["status"] == "completed"


def test_missing_mnist_message(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        load_mnist(str(tmp_path), allow_download=False)
    text = str(err.value)
    assert (
        "train-images-idx3-ubyte.gz" in text and str(tmp_path.resolve()) in text and "How to get them" in text
    )


def test_missing_data_stops_before_training(tmp_path):
    cfg = compose(
        [
            "experiment=mnist_autoencoder",
            "logger=none",
            f"paths.results_dir={tmp_path}",
            f"paths.data_dir={tmp_path / 'nowhere'}",
            "dataset.allow_download=false",
        ]
    )
    with pytest.raises(DataNotFoundError):
        run_from_config(cfg)
    assert not (tmp_path / "mnist_autoencoder").exists()


def test_corrupt_mnist_is_reported(tmp_path, shared_data_dir):
    target = tmp_path / "mnist"
    target.mkdir()
    for f in (shared_data_dir / "mnist").glob("*.gz"):
        (target / f.name).write_bytes(f.read_bytes())
    raw = bytearray(gzip.decompress((target / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    raw[100] ^= 0xFF
    (target / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(CorruptDataError, match="md5"):
        load_mnist(str(tmp_path), allow_download=False)
    with pytest.raises(CorruptDataError, match="bytes"):
        parse_idx(bytes([0, 0, 8, 1, 0, 0, 0, 9, 1, 2]), "short")


def test_mnist_real_splits(shared_data_dir):
    data = load_mnist(str(shared_data_dir), num_train=1000, num_val=500, num_test=300, target="label")
    assert (
        data.train[0].shape == (1000, 784)
        and data.val[0].shape == (500, 784)
        and data.test[0].shape == (300, 784)
    )
    assert 0.0 <= float(data.train[0].min()) and float(data.train[0].max()) <= 1.0
    assert data.train[1].dtype == torch.int64 and set(data.train[1].unique().tolist()) == set(range(10))
    ae = load_mnist(str(shared_data_dir), num_train=10, num_val=10, num_test=10)
    assert torch.equal(ae.train[0], ae.train[1])


def test_process_clock_counts_cpu_seconds_of_the_step(tmp_path, monkeypatch):
    """trainer.clock=process times steps with time.process_time (shared CPUs); a step that sleeps
    costs wall time but no CPU time, so it must not show up in algo_time_s."""
    import time

    from curvopt.training import algorithm

    original = algorithm.TorchOptimizerAlgorithm.step

    def sleepy_step(self, batch):
        time.sleep(0.05)
        return original(self, batch)

    monkeypatch.setattr(algorithm.TorchOptimizerAlgorithm, "step", sleepy_step)
    threads = torch.get_num_threads()
    try:
        wall = _run(tmp_path, ["optimizer=adam", "trainer.max_steps=4", "run_id=w", "trainer.num_threads=1"])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    cpu = _run(tmp_path, ["optimizer=adam", "trainer.max_steps=4", "run_id=p", "trainer.clock=process"])
    t_wall = read_metrics(Path(wall["run_dir"]) / "metrics.jsonl")[-1]["algo_time_s"]
    t_cpu = read_metrics(Path(cpu["run_dir"]) / "metrics.jsonl")[-1]["algo_time_s"]
    assert t_wall >= 4 * 0.05
    assert t_cpu < 4 * 0.05


def test_unknown_clock_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="trainer.clock must be 'wall' or 'process'"):
        _run(tmp_path, ["optimizer=adam", "trainer.max_steps=1", "run_id=x", "trainer.clock=gpu"])


def test_loop_clipping_on_an_own_algorithm_is_refused(tmp_path):
    """Factories that return their own Algorithm step themselves: the loop cannot clip for them, so a
    `grad_clip_value` there must fail loudly instead of being ignored."""
    cfg = compose(
        [
            "dataset=synthetic_images",
            "model=tiny_autoencoder",
            "optimizer=hf_cg",
            "+optimizer.grad_clip_value=1.0",
            "logger=none",
            f"paths.results_dir={tmp_path}",
        ]
    )
    with pytest.raises(ValueError, match="cannot clip its gradients"):
        run_from_config(cfg)
