"""Reliability and security (issue 27): names that would write outside the results directory,
records that would lie about the run (a resumed lr, an edited config.yaml, a damaged checkpoint,
NaN data), bad input that used to train or traceback, and report entries that hid a broken or
missing summary. Each case fails before anything is written, with a message that names the value
or file and says what to do (src/train.py: exit code 2). Fast: tiny synthetic runs, in-process."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from curvopt.errors import (
    EXIT_BAD_INPUT,
    BadInputError,
    ConfigError,
    CorruptCheckpointError,
    CorruptDataError,
)
from curvopt.training.build import run_from_config
from curvopt.training.checkpoint import CHECKSUM_NAME, file_sha256
from curvopt.training.records import read_metrics
from curvopt.training.rundir import MAX_NAME_BYTES, CommandLine
from tests.conftest import TINY_RUN, compose

REPO = Path(__file__).resolve().parents[2]
TINY = [*TINY_RUN, "experiment_name=t"]
GROUPS = ("dataset", "model", "optimizer", "trainer", "logger", "paths", "experiment")


def _run(results: Path, extra: list[str], edit=None) -> dict:
    """One tiny run; ``extra`` is also its command line (so a resume knows what was typed)."""
    cfg = compose([*TINY, f"paths.results_dir={results}", *extra])
    if edit is not None:
        edit(cfg)
    return run_from_config(cfg, CommandLine.parse(extra, GROUPS))


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its content (what a refused command must leave alone)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- 1-3: run_id and experiment_name are single directory names -----------------------------------
@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("run_id", "../../x", "path separator"),
        ("run_id", "/abs/path", "path separator"),
        ("run_id", "sub/dir", "path separator"),
        ("run_id", "a\\b", "path separator"),
        ("run_id", ".", "starts with '.'"),
        ("run_id", "..", "starts with '.'"),
        ("run_id", ".hidden", "starts with '.'"),
        ("run_id", "a\0b", "control character"),
        ("run_id", "x" * 300, "300 bytes long; at most 200"),
        ("run_id", "x" * 250, "250 bytes long; at most 200"),
        ("run_id", "a.completed-20260101-120000", "moved aside"),
        ("experiment_name", "../../../x", "path separator"),
    ],
)
def test_names_that_leave_the_results_directory_are_refused(tmp_path, key, value, rule):
    results = tmp_path / "res"

    def set_value(cfg):
        cfg[key] = value

    extra = ["optimizer=adam", "trainer.max_steps=2"] + (["run_id=r"] if key != "run_id" else [])
    with pytest.raises(ConfigError, match=rf"{key}=.* {rule}.*single directory name") as err:
        _run(results, extra, edit=set_value)
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []  # nothing written, inside the results directory or out


def test_the_longest_run_id_can_be_restarted(tmp_path):
    """A run_id of MAX_NAME_BYTES still leaves room for <run_id>.<status>-<time> (restart)."""
    rid = "r" * MAX_NAME_BYTES
    _run(tmp_path, ["optimizer=adam", f"run_id={rid}", "trainer.max_steps=1"])
    again = _run(tmp_path, ["optimizer=adam", f"run_id={rid}", "trainer.max_steps=1", "trainer.restart=true"])
    assert again["status"] == "completed"
    assert len(list((tmp_path / "t").glob(f"{rid}.completed-*"))) == 1


def test_restart_with_run_id_dot_moves_nothing_aside(tmp_path):
    for rid in ("a", "b"):
        _run(tmp_path, ["optimizer=adam", f"run_id={rid}", "trainer.max_steps=1"])
    before = _tree(tmp_path)
    for rid in (".", ".."):
        with pytest.raises(ConfigError, match=rf"run_id='\{rid}'"):
            _run(tmp_path, ["optimizer=adam", f"run_id={rid}", "trainer.max_steps=1", "trainer.restart=true"])
    assert _tree(tmp_path) == before
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["a", "b"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run_id=../../x", "run_id='../../x' contains a path separator"),
        ("seed=4294967296", "seed=4294967296"),
    ],
)
def test_train_py_exits_2_with_one_line_and_writes_nothing(tmp_path, override, message):
    results = tmp_path / "a" / "b" / "res"
    proc = subprocess.run(
        [
            sys.executable,
            "src/train.py",
            *TINY,
            f"paths.results_dir={results}",
            f"paths.output_dir={tmp_path / 'hydra'}",
            override,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_BAD_INPUT, out[-2000:]
    assert message in out and "Traceback" not in out
    assert not results.exists() and not (tmp_path / "a" / "x").exists() and not (tmp_path / "x").exists()


# -- 4: a resume that changes the lr trains with the lr it logs -----------------------------------
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_resumed_lr_change_is_the_lr_trained_with(tmp_path, monkeypatch, optimizer):
    from curvopt.training import algorithm

    first = [f"optimizer={optimizer}", "run_id=r", "trainer.max_steps=4"]
    _run(tmp_path, first)
    old_lr = compose([*TINY, f"optimizer={optimizer}"]).optimizer.lr
    used = []
    original = algorithm.TorchOptimizerAlgorithm.step

    def spy(self, batch):
        used.append(self.optimizer.param_groups[0]["lr"])
        return original(self, batch)

    monkeypatch.setattr(algorithm.TorchOptimizerAlgorithm, "step", spy)
    changed = [*first[:2], "trainer.max_steps=6", "trainer.resume=true", "trainer.allow_config_change=true"]
    summary = _run(tmp_path, [*changed, "optimizer.lr=0.5"])
    assert summary["steps"] == 6 and used == [0.5, 0.5]
    rows = read_metrics(tmp_path / "t" / "r" / "metrics.jsonl")
    assert [r["lr"] for r in rows if "lr" in r] == [old_lr] * 4 + [0.5, 0.5]  # logged = trained with
    assert "lr: 0.5" in (tmp_path / "t" / "r" / "config.yaml").read_text()


def test_a_resumed_change_that_cannot_be_applied_is_refused(tmp_path):
    """HF-CG keeps its own state (no param groups): a changed setting would be logged, not used."""
    problem = [
        "dataset=synthetic_images",
        "model=tiny_autoencoder",
        "optimizer=hf_cg",
        "optimizer.cg_maxiter=4",
    ]
    _run(tmp_path, [*problem, "run_id=h", "trainer.max_steps=2"])
    before = _tree(tmp_path)
    resume = ["trainer.resume=true", "trainer.allow_config_change=true", "trainer.max_steps=3"]
    with pytest.raises(ConfigError, match=r"optimizer\.cg_maxiter \(optimizer=hf_cg restores its own state"):
        _run(tmp_path, [*problem[:3], "optimizer.cg_maxiter=6", "run_id=h", *resume])
    assert _tree(tmp_path) == before


# -- 5: a hand-edited config.yaml ------------------------------------------------------------------
def test_a_hand_edited_config_is_refused_or_applied(tmp_path, monkeypatch):
    first = ["optimizer=sgd", "run_id=e", "trainer.max_steps=3"]
    _run(tmp_path, first)
    path = tmp_path / "t" / "e" / "config.yaml"
    text = path.read_text()
    path.write_text(text.replace("lr: 0.01", "lr: 0.3").replace("batch_size: 32", "batch_size: 8"))
    before = _tree(tmp_path)
    with pytest.raises(ConfigError) as err:
        _run(tmp_path, [*first[:2], "trainer.max_steps=4", "trainer.resume=true"])
    assert str(path) in str(err.value)
    assert "optimizer.lr: 0.01 -> 0.3" in str(err.value) and "trainer.batch_size: 32 -> 8" in str(err.value)
    assert _tree(tmp_path) == before
    # allowed: the edited values are the ones trained with (the optimizer state gets lr 0.3 back)
    summary = _run(
        tmp_path,
        [*first[:2], "trainer.max_steps=4", "trainer.resume=true", "trainer.allow_config_change=true"],
    )
    rows = read_metrics(tmp_path / "t" / "e" / "metrics.jsonl")
    assert summary["steps"] == 4 and rows[-1]["lr"] == 0.3 and rows[-1]["batch_size"] == 8


def test_a_broken_config_yaml_is_named(tmp_path):
    first = ["optimizer=adam", "run_id=y", "trainer.max_steps=2"]
    _run(tmp_path, first)
    path = tmp_path / "t" / "y" / "config.yaml"
    path.write_text(path.read_text()[:200] + "\n  : [unclosed\n")
    before = _tree(tmp_path)
    with pytest.raises(ConfigError, match=rf"{path} is not a valid config .*trainer.restart=true"):
        _run(tmp_path, [*first, "trainer.resume=true"])
    assert _tree(tmp_path) == before


# -- 6: checkpoints carry a checksum ---------------------------------------------------------------
def test_a_checkpoint_with_flipped_bytes_is_refused(tmp_path):
    first = ["optimizer=adam", "run_id=c", "trainer.max_steps=3"]
    _run(tmp_path, first)
    ckpt = tmp_path / "t" / "c" / "checkpoint.pt"
    side = ckpt.with_name(CHECKSUM_NAME)
    assert side.read_text() == f"{file_sha256(ckpt)}  checkpoint.pt\n"  # sha256sum -c format
    raw = bytearray(ckpt.read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + 64] = bytes(b ^ 0xFF for b in raw[mid : mid + 64])
    ckpt.write_bytes(bytes(raw))
    before = _tree(tmp_path)
    with pytest.raises(
        CorruptCheckpointError, match=rf"{ckpt} does not match its checksum .*trainer.restart=true"
    ):
        _run(tmp_path, [*first[:2], "trainer.max_steps=5", "trainer.resume=true"])
    assert _tree(tmp_path) == before


def test_an_older_checkpoint_without_checksum_or_config_still_resumes(tmp_path, caplog):
    first = ["optimizer=adam", "run_id=o", "trainer.max_steps=3"]
    _run(tmp_path, first)
    ckpt = tmp_path / "t" / "o" / "checkpoint.pt"
    state = torch.load(ckpt, weights_only=False)
    del state["config_yaml"]  # written before configs and checksums were recorded
    torch.save(state, ckpt)
    ckpt.with_name(CHECKSUM_NAME).unlink()
    with caplog.at_level(logging.WARNING):
        summary = _run(tmp_path, [*first[:2], "trainer.max_steps=5", "trainer.resume=true"])
    assert summary["status"] == "completed" and summary["steps"] == 5
    assert "resuming without a checksum check" in caplog.text
    assert ckpt.with_name(CHECKSUM_NAME).exists()  # the new checkpoint has one


# -- 7: NaN / inf in the data ----------------------------------------------------------------------
@pytest.mark.parametrize(("split", "part", "value"), [("train", 0, float("nan")), ("val", 0, float("inf"))])
def test_non_finite_data_is_named_before_training(tmp_path, monkeypatch, split, part, value):
    from curvopt.data import synthetic

    original = synthetic.gaussian_classification

    def poisoned(**kwargs):
        data = original(**kwargs)
        getattr(data, split)[part][3, 2] = value
        return data

    monkeypatch.setattr(synthetic, "gaussian_classification", poisoned)
    with pytest.raises(
        CorruptDataError, match=rf"dataset=gaussian_classification: the {split} split's inputs hold 1 NaN"
    ):
        _run(tmp_path, ["optimizer=adam", "run_id=n", "trainer.max_steps=2"])
    assert list(tmp_path.iterdir()) == []


# -- 8, 9: empty splits, seeds ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("dataset.num_train=0", r"dataset=gaussian_classification: the training split is empty"),
        (
            "dataset.num_val=0",
            r"trainer.monitor=val/loss but dataset=gaussian_classification has no val split",
        ),
        ("seed=4294967296", r"seed=4294967296: must be at most 4294967295"),
    ],
)
def test_empty_splits_and_seed_overflow_fail_before_anything_is_written(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        _run(tmp_path, ["optimizer=adam", "run_id=z", "trainer.max_steps=2", override])
    assert list(tmp_path.iterdir()) == []


def test_no_val_split_with_a_test_monitor_and_the_largest_seed(tmp_path):
    summary = _run(
        tmp_path,
        [
            "optimizer=adam",
            "run_id=v",
            "trainer.max_steps=5",
            "dataset.num_val=0",
            "trainer.monitor=test/loss",
            "seed=4294967295",
        ],
    )
    rows = read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")
    assert summary["status"] == "completed" and summary["best"]["value"] > 0
    assert not any(k.startswith("val/") for r in rows for k in r)  # no val loss 0.0 over no rows


# -- 10: a model that does not fit the data; USPS splits ------------------------------------------
@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ("[7,16,5]", r"inputs \(20,\) float32.*mat1 and mat2"),
        ("[20,16,3]", r"labels go up to 4 but the model has 3"),
    ],
)
def test_a_model_that_does_not_fit_the_data_is_named(tmp_path, sizes, match):
    with pytest.raises(
        ConfigError,
        match=rf"model \(curvopt.models.mlp.mlp\) does not fit dataset=gaussian_classification .*{match}",
    ):
        _run(tmp_path, ["optimizer=adam", "run_id=m", f"model.sizes={sizes}"])
    assert list(tmp_path.iterdir()) == []


def test_fosi_lr_on_usps_is_a_clear_mismatch(tmp_path, shared_data_dir):
    if not (shared_data_dir / "usps" / "usps_all.mat").exists():
        pytest.skip("no usps_all.mat")
    cfg = compose(["experiment=fosi_lr", "dataset=usps", "logger=none", f"paths.results_dir={tmp_path}"])
    with pytest.raises(
        ConfigError, match=r"does not fit dataset=usps \(inputs \(256,\) float32, targets \(\) int64\)"
    ):
        run_from_config(cfg)
    assert list(tmp_path.iterdir()) == []


def test_usps_splits_are_always_shuffled(shared_data_dir):
    """usps_all.mat is sorted by digit: split_seed=None used to cut it in file order (digits 1-8 in
    train, 9 and 0 in test); it now means the seeded permutation of split_seed=0, the SHF default
    (whose committed records are unchanged)."""
    from curvopt.data.usps import load_usps

    if not (shared_data_dir / "usps" / "usps_all.mat").exists():
        pytest.skip("no usps_all.mat")
    a = load_usps(str(shared_data_dir), target="label", source="roweis", split_seed=None)
    b = load_usps(str(shared_data_dir), target="label", source="roweis", split_seed=0)
    for split in ("train", "val", "test"):
        assert torch.equal(getattr(a, split)[1], getattr(b, split)[1])
        assert set(getattr(a, split)[1].tolist()) == set(range(10))
    assert a.meta["split_seed"] == 0


# -- 11: the report names broken and missing summaries ---------------------------------------------
def test_the_report_names_a_broken_summary_and_lists_running_runs(tmp_path):
    from curvopt.analysis.records import RecordError, load_summaries
    from experiments.report import core

    for rid in ("a", "b", "c"):
        _run(tmp_path, ["optimizer=adam", f"run_id={rid}", "trainer.max_steps=1", f"seed={ord(rid) - 97}"])
    (tmp_path / "t" / "c" / "summary.json").unlink()  # killed, or still running
    finished = core.finished_summaries(tmp_path, "t")
    assert list(finished["run_id"]) == ["a", "b"]
    line = core.provenance(finished)
    assert "seeds 0,1 (2 runs)" in line and "running or killed, not counted (no summary.json): c" in line

    summary = tmp_path / "t" / "b" / "summary.json"
    summary.write_text(summary.read_text()[:40])  # half-written
    with pytest.raises(RecordError, match=rf"{summary} is not valid .*run directory {summary.parent}"):
        load_summaries(tmp_path, "t")
    item = core.Item(
        "x",
        "y",
        "Table 1: t",
        "make t",
        lambda ctx: core.ItemResult(
            core.QUALITATIVE, provenance=core.provenance(core.finished_summaries(ctx.results, "t"))
        ),
    )
    result = core.evaluate(item, core.Context(tmp_path, {}))
    assert result.status == core.ERROR and str(summary) in result.notes[0]


def test_every_error_above_is_bad_input_exit_code_2():
    """src/train.py exits EXIT_BAD_INPUT (2) on every BadInputError, without a traceback."""
    from curvopt.analysis.records import RecordError

    for cls in (ConfigError, CorruptCheckpointError, CorruptDataError):
        assert issubclass(cls, BadInputError)
    assert EXIT_BAD_INPUT == 2 and issubclass(RecordError, ValueError)  # the report's: an error entry
