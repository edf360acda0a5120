"""Faults and bad inputs (docs/resume.md): a stop signal mid-step resumes exactly, every way a run
ends leaves a valid summary, run directories refuse to be overwritten, bad values fail before
anything is loaded or created. Fast (tiny synthetic problems, in-process); the versions with real
signals, processes and a full disk are in tests/training/test_faults_slow.py."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from curvopt.errors import (
    EXIT_BAD_INPUT,
    EXIT_COMPLETED,
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    RunExistsError,
    RunInUseError,
    exit_code,
)
from curvopt.training import loop
from curvopt.training.build import run_from_config
from curvopt.training.loop import Trainer, comparable_rows
from curvopt.training.records import read_metrics
from curvopt.training.rundir import CommandLine
from tests.conftest import TINY_RUN, compose

TINY = [*TINY_RUN, "experiment_name=t"]
GROUPS = ("dataset", "model", "optimizer", "trainer", "logger", "paths", "experiment")
# tiny problems for each optimizer the resume guarantee covers
PROBLEMS = {
    "adam": ["optimizer=adam"],
    "fosi": [
        "optimizer=fosi_heavy_ball",
        "optimizer.k=2",
        "optimizer.ese_period=4",
        "optimizer.ese_warmup=2",
        "optimizer.hvp_mode=reverse_over_reverse",  # no linearize tracing: 10x faster here
    ],
    "alice": ["optimizer=alice", "optimizer.rank=4", "optimizer.leading=2", "optimizer.update_interval=3"],
    "shf_lsmr": [
        "dataset=synthetic_images",
        "model=tiny_autoencoder",
        "optimizer=shf_lsmr",
        "trainer.sampling=independent",
        "optimizer.batch_size=64",
        "optimizer.maxiter=10",
        "optimizer.miniter=2",
    ],
    "hf_cg": [
        "dataset=synthetic_images",
        "model=tiny_autoencoder",
        "optimizer=hf_cg",
        "optimizer.cg_maxiter=10",
    ],
}


def _run(tmp_path: Path, extra: list[str], cli: list[str] | None = None) -> dict:
    overrides = [*TINY, f"paths.results_dir={tmp_path}", *extra]
    return run_from_config(compose(overrides), CommandLine.parse(cli, GROUPS) if cli is not None else None)


def _rows(summary: dict) -> list[dict]:
    return comparable_rows(read_metrics(Path(summary["run_dir"]) / "metrics.jsonl"))


def _strict_json(path: Path) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name} in {path}")

    return json.loads(path.read_text(), parse_constant=refuse)


def _signal_after_draw(sig: int, at: int):
    """A ``Trainer._next_batch`` that raises ``sig`` right after the batch of step ``at + 1`` is
    drawn (before it is stepped): where a Ctrl-C used to checkpoint a drawn-but-unstepped batch."""
    original = Trainer._next_batch

    def draw(trainer: Trainer):
        out = original(trainer)
        if trainer.step == at:
            signal.raise_signal(sig)
        return out

    return draw


@pytest.fixture
def sigterm_raises():
    """A SIGTERM the loop does not handle fails the test instead of killing pytest."""

    def handler(signum, frame):
        raise RuntimeError("SIGTERM reached the default handler")

    previous = signal.signal(signal.SIGTERM, handler)
    yield
    signal.signal(signal.SIGTERM, previous)


# -- 1, 4: a stop signal mid-step; resume equals the uninterrupted run -----------------------------
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_signal_between_draw_and_step_resumes_exactly(tmp_path, monkeypatch, sigterm_raises, sig):
    full = _run(tmp_path, ["optimizer=adam", "run_id=full", "trainer.max_steps=15"])
    monkeypatch.setattr(Trainer, "_next_batch", _signal_after_draw(sig, at=7))
    part = _run(tmp_path, ["optimizer=adam", "run_id=part", "trainer.max_steps=15"])
    name = "sigint" if sig == signal.SIGINT else "sigterm"
    assert part["status"] == "interrupted" and part["stop_reason"] == name
    assert part["steps"] == 8 and part["checkpoint_step"] == 8  # the drawn batch was stepped
    assert exit_code(part) == (EXIT_SIGINT if sig == signal.SIGINT else EXIT_SIGTERM)
    saved = _strict_json(Path(part["run_dir"]) / "summary.json")
    assert saved["status"] == "interrupted" and saved["checkpoint_step"] == 8
    monkeypatch.undo()
    resumed = _run(tmp_path, ["optimizer=adam", "run_id=part", "trainer.max_steps=15", "trainer.resume=true"])
    assert resumed["status"] == "completed"
    assert _rows(resumed) == _rows(full)


@pytest.mark.parametrize("problem", ["fosi", "alice", "shf_lsmr", "hf_cg"])
def test_each_optimizer_resumes_exactly_after_a_signal(tmp_path, monkeypatch, problem):
    extra = PROBLEMS[problem]
    full = _run(tmp_path, [*extra, "run_id=full", "trainer.max_steps=8"])
    monkeypatch.setattr(Trainer, "_next_batch", _signal_after_draw(signal.SIGINT, at=4))
    part = _run(tmp_path, [*extra, "run_id=part", "trainer.max_steps=8"])
    assert part["status"] == "interrupted" and part["steps"] == 5
    monkeypatch.undo()
    resumed = _run(tmp_path, [*extra, "run_id=part", "trainer.max_steps=8", "trainer.resume=true"])
    assert _rows(resumed) == _rows(full)


def test_second_signal_stops_at_once_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    original = Trainer._next_batch

    def twice(trainer):
        out = original(trainer)
        if trainer.step == 6:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # the second one interrupts right here
        return out

    monkeypatch.setattr(Trainer, "_next_batch", twice)
    part = _run(
        tmp_path, ["optimizer=adam", "run_id=p", "trainer.max_steps=15", "trainer.checkpoint_every=5"]
    )
    run_dir = Path(part["run_dir"])
    assert part["status"] == "interrupted" and part["stop_reason"] == "keyboard_interrupt"
    assert part["checkpoint_step"] == 5 and not (run_dir / "checkpoint.tmp").exists()
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(7))
    monkeypatch.undo()
    full = _run(tmp_path, ["optimizer=adam", "run_id=full", "trainer.max_steps=15"])
    resumed = _run(
        tmp_path, ["optimizer=adam", "run_id=p", "trainer.max_steps=15", "trainer.resume=true"]
    )  # rows 6 (from before the stop) are recomputed identically
    assert _rows(resumed) == _rows(full)


# -- 3: checkpoints do not change a run ------------------------------------------------------------
@pytest.mark.parametrize(
    "problem",
    ["fosi", *(pytest.param(p, marks=pytest.mark.slow) for p in ("adam", "alice", "shf_lsmr", "hf_cg"))],
)
def test_periodic_checkpoints_do_not_change_a_run(tmp_path, problem):
    """FOSI's state_dict() used to perturb its momentum: a run with checkpoint_every differed."""
    a = _run(tmp_path, [*PROBLEMS[problem], "run_id=a", "trainer.max_steps=12"])
    b = _run(tmp_path, [*PROBLEMS[problem], "run_id=b", "trainer.max_steps=12", "trainer.checkpoint_every=1"])
    assert _rows(a) == _rows(b)


# -- 5: a full disk at the final checkpoint -------------------------------------------------------
def test_full_disk_at_the_final_checkpoint_keeps_every_record(tmp_path, monkeypatch):
    def full_disk(obj, f, *args, **kwargs):
        f.write(b"\0" * 4096)  # a partial file, then torch's own error for a full disk
        raise RuntimeError(
            "[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file"
        )

    monkeypatch.setattr(loop.torch, "save", full_disk)
    summary = _run(tmp_path, ["optimizer=adam", "run_id=d", "trainer.max_steps=6"])
    run_dir = Path(summary["run_dir"])
    saved = _strict_json(run_dir / "summary.json")
    assert saved["status"] == "completed" and saved["steps"] == 6 and saved["checkpoint_step"] is None
    assert "could not write the checkpoint" in saved["checkpoint_error"]
    assert str(run_dir / "checkpoint.pt") in saved["checkpoint_error"]
    assert "free disk space" in saved["checkpoint_error"]
    assert not (run_dir / "checkpoint.tmp").exists() and not (run_dir / "checkpoint.pt").exists()
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(7))


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    calls = []
    real_save = torch.save

    def fails_second(obj, f, *args, **kwargs):
        calls.append(obj["step"])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(loop.torch, "save", fails_second)
    summary = _run(
        tmp_path, ["optimizer=adam", "run_id=d", "trainer.max_steps=9", "trainer.checkpoint_every=3"]
    )
    assert calls == [3, 6, 9] and summary["status"] == "completed" and summary["checkpoint_step"] == 9
    assert "No space left on device" in summary["checkpoint_error"]


# -- 6: one process per run directory --------------------------------------------------------------
def test_a_second_run_with_the_same_id_refuses_while_the_first_lives(tmp_path):
    run_dir = tmp_path / "t" / "same"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, 'src'); from curvopt.training.records import RunLock; "
            f"lock = RunLock({str(run_dir)!r}); lock.acquire(); print('held', flush=True); time.sleep(60)",
        ],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunInUseError, match=f"in use by process {holder.pid}"):
            _run(tmp_path, ["optimizer=adam", "run_id=same", "trainer.max_steps=2"])
        assert sorted(p.name for p in run_dir.iterdir()) == ["run.lock"]  # nothing of the refused run
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing: its lock is stale and the run may start
    assert _run(tmp_path, ["optimizer=adam", "run_id=same", "trainer.max_steps=2"])["status"] == "completed"


def test_run_lock_is_held_during_the_run(tmp_path, monkeypatch):
    from curvopt.training.records import RunLock

    seen = []
    original = Trainer._next_batch

    def probe(trainer):
        with pytest.raises(RunInUseError):
            RunLock(trainer.run_dir).check()
        seen.append(trainer.step)
        return original(trainer)

    monkeypatch.setattr(Trainer, "_next_batch", probe)
    _run(tmp_path, ["optimizer=adam", "run_id=l", "trainer.max_steps=2"])
    assert seen == [0, 1]


# -- 7: every way a run ends leaves a summary; what may be re-run ----------------------------------
def test_a_crash_is_recorded_as_failed_and_needs_a_flag_to_rerun(tmp_path, monkeypatch):
    from curvopt.training import algorithm

    original = algorithm.TorchOptimizerAlgorithm.step

    def crash(self, batch):
        if getattr(self, "_calls", 0) == 3:
            raise RuntimeError("simulated crash")
        self._calls = getattr(self, "_calls", 0) + 1
        return original(self, batch)

    monkeypatch.setattr(algorithm.TorchOptimizerAlgorithm, "step", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(tmp_path, ["optimizer=adam", "run_id=c", "trainer.max_steps=8"])
    run_dir = tmp_path / "t" / "c"
    saved = _strict_json(run_dir / "summary.json")
    assert saved["status"] == "failed" and saved["steps"] == 3
    assert saved["error"] == "RuntimeError: simulated crash" and exit_code(saved) == EXIT_FAILED
    monkeypatch.undo()
    with pytest.raises(RunExistsError, match="unfinished run .*no checkpoint.*trainer.restart=true"):
        _run(tmp_path, ["optimizer=adam", "run_id=c", "trainer.max_steps=8"])
    with pytest.raises(NoCheckpointError, match="trainer.restart=true"):
        _run(tmp_path, ["optimizer=adam", "run_id=c", "trainer.max_steps=8", "trainer.resume=true"])
    again = _run(tmp_path, ["optimizer=adam", "run_id=c", "trainer.max_steps=8", "trainer.restart=true"])
    assert again["status"] == "completed" and again["steps"] == 8
    aside = list((tmp_path / "t").glob("c.failed-*"))
    assert len(aside) == 1 and _strict_json(aside[0] / "summary.json")["status"] == "failed"
    assert (aside[0] / "metrics.jsonl").exists()  # the old records are kept


def test_a_killed_run_is_not_silently_overwritten(tmp_path):
    _run(tmp_path, ["optimizer=adam", "run_id=k", "trainer.max_steps=4"])
    (tmp_path / "t" / "k" / "summary.json").unlink()  # SIGKILL: no summary
    with pytest.raises(RunExistsError, match="status killed, a checkpoint.*trainer.resume=true"):
        _run(tmp_path, ["optimizer=adam", "run_id=k", "trainer.max_steps=4"])


def test_finished_run_can_be_extended_or_restarted(tmp_path):
    _run(tmp_path, ["optimizer=adam", "run_id=f", "trainer.max_steps=4"])
    with pytest.raises(RunExistsError, match="already holds a finished run .*trainer.restart=true"):
        _run(tmp_path, ["optimizer=adam", "run_id=f", "trainer.max_steps=4"])
    longer = _run(tmp_path, ["optimizer=adam", "run_id=f", "trainer.max_steps=6", "trainer.resume=true"])
    assert longer["steps"] == 6


def test_a_parked_run_resumes_with_every_row(tmp_path, capsys):
    """A paused run committed with gzipped metrics (``pack --park``) resumes with its rows
    unparked: the finished file equals that of the same run extended without parking; a run dir
    holding both files is refused before anything changes."""
    from experiments.pack import main as pack_main

    _run(tmp_path, ["optimizer=adam", "run_id=plain", "trainer.max_steps=4"])
    plain = _run(tmp_path, ["optimizer=adam", "run_id=plain", "trainer.max_steps=8", "trainer.resume=true"])
    part = _run(tmp_path, ["optimizer=adam", "run_id=p", "trainer.max_steps=4"])
    run_dir = Path(part["run_dir"])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert pack_main(["--park", str(run_dir)]) == 0 and "parked" in capsys.readouterr().out
    assert not (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl.gz").exists()
    assert read_metrics(run_dir / "metrics.jsonl") == rows  # readers see the parked rows
    assert pack_main(["--park", str(run_dir)]) == 2  # nothing left to park: a clear error
    assert "does not exist" in capsys.readouterr().err
    longer = _run(tmp_path, ["optimizer=adam", "run_id=p", "trainer.max_steps=8", "trainer.resume=true"])
    assert not (run_dir / "metrics.jsonl.gz").exists()
    assert _rows(longer) == _rows(plain) and len(_rows(longer)) > len(rows)

    (run_dir / "metrics.jsonl.gz").write_bytes(b"")  # both files: which rows are the run's?
    with pytest.raises(FileExistsError, match="holds both"):
        _run(tmp_path, ["optimizer=adam", "run_id=p", "trainer.max_steps=10", "trainer.resume=true"])
    assert read_metrics(run_dir / "metrics.jsonl") == read_metrics(Path(longer["run_dir"]) / "metrics.jsonl")


def test_an_unreadable_checkpoint_is_named_and_changes_nothing(tmp_path):
    part = _run(tmp_path, ["optimizer=adam", "run_id=u", "trainer.max_steps=4"])
    run_dir = Path(part["run_dir"])
    ckpt = run_dir / "checkpoint.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(CorruptCheckpointError, match=str(ckpt)):
        _run(tmp_path, ["optimizer=adam", "run_id=u", "trainer.max_steps=8", "trainer.resume=true"])
    assert (run_dir / "metrics.jsonl").read_text() == before


# -- 8: diverged runs: valid JSON, their own exit code ----------------------------------------------
def test_divergence_leaves_standard_json_and_exit_code_3(tmp_path):
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
    saved = _strict_json(Path(summary["run_dir"]) / "summary.json")
    assert saved["status"] == "diverged" and exit_code(saved) == EXIT_DIVERGED
    assert any(v in ("nan", "inf", "-inf") for v in saved["final"].values())
    for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"bare {name} in metrics.jsonl"))


def test_a_non_finite_gradient_is_a_divergence(tmp_path, monkeypatch):
    from curvopt.errors import NonFiniteError
    from curvopt.training import algorithm

    original = algorithm.TorchOptimizerAlgorithm.step

    def nan_grad(self, batch):
        if getattr(self, "_calls", 0) == 2:
            raise NonFiniteError("the gradient of parameter #0 holds NaN or inf values")
        self._calls = getattr(self, "_calls", 0) + 1
        return original(self, batch)

    monkeypatch.setattr(algorithm.TorchOptimizerAlgorithm, "step", nan_grad)
    summary = _run(tmp_path, ["optimizer=adam", "run_id=n", "trainer.max_steps=8"])
    assert summary["status"] == "diverged" and summary["stop_reason"] == "non_finite_gradient"
    assert summary["steps"] == 2 and "NaN or inf" in summary["error"]


def test_exit_codes_tell_the_endings_apart():
    assert exit_code({"status": "completed"}) == EXIT_COMPLETED == 0
    assert exit_code({"status": "diverged"}) == EXIT_DIVERGED == 3
    assert exit_code({"status": "failed"}) == EXIT_FAILED == 1
    assert exit_code({"status": "interrupted", "stop_reason": "sigint"}) == EXIT_SIGINT == 130
    assert exit_code({"status": "interrupted", "stop_reason": "sigterm"}) == EXIT_SIGTERM == 143
    assert exit_code({"status": "interrupted", "stop_reason": "sigterm_forced"}) == EXIT_SIGTERM
    assert exit_code({"status": "interrupted", "stop_reason": "keyboard_interrupt"}) == EXIT_SIGINT
    assert EXIT_BAD_INPUT == 2


# -- 9: every trainer value checked before anything is loaded or created ---------------------------
@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("trainer.max_steps=-5", r"trainer.max_steps=-5: must be >= 0"),
        ("trainer.batch_size=0", r"trainer.batch_size=0: must be positive"),
        ("trainer.eval_every=0", r"trainer.eval_every=0: must be positive"),
        ("trainer.eval_batch_size=-1", r"trainer.eval_batch_size=-1"),
        ("trainer.log_every=0", r"trainer.log_every=0"),
        ("trainer.checkpoint_every=-1", r"trainer.checkpoint_every=-1"),
        ("trainer.checkpoint_every_s=-5", r"trainer.checkpoint_every_s=-5"),
        ("trainer.max_epochs=0", r"trainer.max_epochs=0"),
        ("trainer.max_algo_time_s=nan", r"trainer.max_algo_time_s=nan"),
        ("trainer.patience_evals=0", r"trainer.patience_evals=0"),
        ("trainer.pause_at_step=0", r"trainer.pause_at_step=0"),
        ("trainer.dtype=float16", r"trainer.dtype='float16' is not supported; choose one of float32"),
        ("trainer.device=gpu", r"trainer.device='gpu'"),
        ("trainer.sampling=random", r"trainer.sampling='random'"),
        ("trainer.eval_splits=[train,dev]", r"trainer.eval_splits has \['dev'\]"),
        ("trainer.micro_batch_size=0", r"trainer.micro_batch_size=0"),
        ("trainer.clock=gpu", r"trainer.clock must be 'wall' or 'process'"),
        ("optimizer.lr=nan", r"optimizer.lr=nan: not a number"),
        ("optimizer.lr=inf", r"optimizer.lr=inf: must be a finite non-negative number"),
        ("optimizer.eps=-1e-8", r"optimizer=adam: Invalid epsilon value: -1e-08"),
        ("seed=abc", r"seed='abc': expected a non-negative whole number"),
        ("+dataset.colour=red", r"dataset=gaussian_classification: .*colour"),
        ("model.sizes=[20,-3,5]", r"model \(curvopt.models.mlp.mlp\): "),
    ],
)
def test_bad_values_fail_before_anything_is_created(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        _run(tmp_path, ["optimizer=adam", "run_id=bad", override])
    assert not (tmp_path / "t").exists()  # no orphan run directory


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("trainer.max_steps=abc", r"trainer.max_steps=abc"),
        ("trainer.resume=maybe", r"trainer.resume=maybe"),
        ("trainer.num_threads=two", r"trainer.num_threads=two"),
    ],
)
def test_wrong_types_fail_when_hydra_composes(tmp_path, override, match):
    """The trainer schema (curvopt.training.schema) types every key: a wrong type fails at compose
    time, before a run directory can exist (src/train.py exits 2, tests/test_configs.py)."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=match):
        _run(tmp_path, ["optimizer=adam", "run_id=bad", override])
    assert not (tmp_path / "t").exists()


def test_bad_optimizer_values_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"optimizer=fosi_heavy_ball: ese_period must be a positive"):
        _run(tmp_path, [*PROBLEMS["fosi"], "optimizer.ese_period=-5", "run_id=bad"])
    with pytest.raises(ConfigError, match=r"optimizer=alice: Alice: rank=128 exceeds the projected side"):
        _run(tmp_path, ["optimizer=alice", "run_id=bad"])
    assert not (tmp_path / "t").exists()


# -- 2: resume continues with the run's saved config ------------------------------------------------
def test_resume_a_run_started_without_a_run_id(tmp_path):
    """A run started without ``run_id=`` gets a generated id; its config.yaml records that id, and
    ``run_id=<id> trainer.resume=true`` continues it (it used to be refused: saved run_id was null).
    A config saved with ``run_id: null`` (before the fix) resumes too."""
    first = ["optimizer=adam", "trainer.max_steps=6", "trainer.eval_every=3"]
    run_dir = Path(_run(tmp_path, first, cli=first)["run_dir"])
    assert f"run_id: {run_dir.name}" in (run_dir / "config.yaml").read_text()
    for legacy in (False, True):
        (run_dir / "summary.json").unlink()  # killed at the end
        if legacy:
            saved = run_dir / "config.yaml"
            saved.write_text(saved.read_text().replace(f"run_id: {run_dir.name}", "run_id: null"))
        again = ["optimizer=adam", f"run_id={run_dir.name}", "trainer.resume=true"]
        resumed = _run(tmp_path, again, cli=again)
        assert resumed["status"] == "completed" and resumed["steps"] == 6, legacy


def test_resume_keeps_the_saved_config(tmp_path):
    """README's example: the run was started with max_steps=6; resuming without repeating it
    used to turn it into a run of the config's default length (and rewrite config.yaml)."""
    first = ["optimizer=adam", "run_id=r", "trainer.max_steps=6", "trainer.eval_every=3"]
    _run(tmp_path, first, cli=first)
    run_dir = tmp_path / "t" / "r"
    (run_dir / "summary.json").unlink()  # killed at the end
    again = ["optimizer=adam", "run_id=r", "trainer.resume=true"]
    resumed = _run(tmp_path, again, cli=again)
    assert resumed["steps"] == 6
    saved = (run_dir / "config.yaml").read_text()
    assert "max_steps: 6" in saved and "eval_every: 3" in saved


def test_resume_refuses_a_change_and_says_what_differs(tmp_path):
    first = ["optimizer=adam", "run_id=r", "trainer.max_steps=4"]
    _run(tmp_path, first, cli=first)
    changed = [
        "optimizer=adam",
        "run_id=r",
        "trainer.resume=true",
        "optimizer.lr=0.5",
        "trainer.batch_size=16",
    ]
    with pytest.raises(ConfigError) as err:
        _run(tmp_path, changed, cli=changed)
    text = str(err.value)
    assert "optimizer.lr: 0.001 -> 0.5" in text and "trainer.batch_size: 32 -> 16" in text
    assert "trainer.allow_config_change=true" in text and "trainer.max_steps" in text
    other = ["optimizer=sgd", "run_id=r", "trainer.resume=true"]
    with pytest.raises(ConfigError, match="optimizer: adam -> sgd"):
        _run(tmp_path, other, cli=other)
    forced = [*changed, "trainer.allow_config_change=true", "trainer.max_steps=6"]
    summary = _run(tmp_path, forced, cli=forced)
    assert summary["steps"] == 6
    saved = (tmp_path / "t" / "r" / "config.yaml").read_text()
    assert "lr: 0.5" in saved and "batch_size: 16" in saved


def test_resume_accepts_overrides_that_extend_the_run(tmp_path):
    first = ["optimizer=adam", "run_id=r", "trainer.max_steps=4"]
    _run(tmp_path, first, cli=first)
    more = [
        "optimizer=adam",
        "run_id=r",
        "trainer.resume=true",
        "trainer.max_steps=8",
        "trainer.checkpoint_every=2",
        "trainer.progress_log_every_s=5",
        "logger=none",
    ]
    assert _run(tmp_path, more, cli=more)["steps"] == 8
    assert "max_steps: 8" in (tmp_path / "t" / "r" / "config.yaml").read_text()


def test_drivers_resume_with_their_same_overrides(tmp_path):
    """runs.py resumes a killed run with the very command line that started it."""
    first = ["optimizer=adam", "run_id=d", "trainer.max_steps=6", "trainer.checkpoint_every=3", "seed=0"]
    _run(tmp_path, first, cli=first)
    (tmp_path / "t" / "d" / "summary.json").unlink()
    again = [*first, "trainer.resume=true"]
    assert _run(tmp_path, again, cli=again)["status"] == "completed"


def test_resume_follows_the_data_directory_of_this_machine(tmp_path):
    """dataset.data_dir is ${paths.data_dir}: a run resumed on another machine reads its data
    from that machine's directory, not the saved one."""
    from curvopt.training.rundir import resume_config

    first = compose([*TINY, "optimizer=adam", "paths.data_dir=/old/machine"])
    saved = compose([*TINY, "optimizer=adam", "paths.data_dir=/old/machine"])
    fresh = compose([*TINY, "optimizer=adam", "paths.data_dir=/new/machine", "trainer.resume=true"])
    del first
    plan = resume_config(saved, fresh, CommandLine.parse(["trainer.resume=true"], GROUPS))
    assert plan.config.paths.data_dir == "/new/machine" and plan.config.trainer.resume is True


def test_interrupt_before_training_leaves_nothing(tmp_path, monkeypatch):
    from curvopt.training import build

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "build_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, ["optimizer=adam", "run_id=i"])
    assert not (tmp_path / "t").exists()


def test_records_never_hold_bare_nan(tmp_path):
    from curvopt.training.records import RunRecorder

    rec = RunRecorder(tmp_path / "r")
    rec.log({"step": 0, "loss": math.nan, "x": torch.tensor(math.inf)})
    rec.write_summary({"status": "diverged", "final": {"val/loss": math.nan}, "best": {"v": [math.inf, 1.0]}})
    rec.close()
    row = json.loads((tmp_path / "r" / "metrics.jsonl").read_text(), parse_constant=pytest.fail)
    assert row == {"step": 0, "loss": "nan", "x": "inf"}
    saved = _strict_json(tmp_path / "r" / "summary.json")
    assert saved["final"]["val/loss"] == "nan" and saved["best"]["v"] == ["inf", 1.0]


def test_train_py_exit_code_for_bad_input(tmp_path):
    """src/train.py prints the message (no traceback) and exits 2 before creating anything."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "src/train.py", *TINY, f"paths.results_dir={tmp_path}", "trainer.max_steps=abc"],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-2000:]
    assert "trainer.max_steps=abc" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "t").exists() and time.perf_counter() - t0 < 300


def test_runs_moved_aside_are_not_loaded_as_runs(tmp_path):
    from curvopt.analysis.records import load_summaries

    _run(tmp_path, ["optimizer=adam", "run_id=a", "trainer.max_steps=2"])
    _run(tmp_path, ["optimizer=adam", "run_id=a", "trainer.max_steps=3", "trainer.restart=true"])
    assert len(list((tmp_path / "t").glob("a.completed-*"))) == 1
    sums = load_summaries(tmp_path, "t")
    assert list(sums["run_id"]) == ["a"] and list(sums["steps"]) == [3]


def test_a_packed_run_is_refused_until_unpacked_then_extended_with_every_row(tmp_path):
    """A finished run that kept its checkpoint, then packed: continuing it in place would write only
    its new rows, which packing again would put in place of the packed ones. train.py refuses the
    run id (resume, restart or a new run) with the unpack command; after ``--unpack`` the extended
    run's records hold every row."""
    from curvopt.analysis import pack
    from experiments import pack as pack_cli

    first = ["optimizer=adam", "run_id=r", "trainer.max_steps=4"]
    _run(tmp_path, first, cli=first)
    exp = tmp_path / "t"
    rows_before = comparable_rows(read_metrics(exp / "r" / "metrics.jsonl"))
    assert pack.pack_experiment(exp).runs == 1 and (exp / "r" / "checkpoint.pt").exists()
    more = ["optimizer=adam", "run_id=r", "trainer.max_steps=8"]
    for flags in (["trainer.resume=true"], ["trainer.restart=true"], []):
        with pytest.raises(RunExistsError, match=r"--unpack .*t/r"):  # a BadInputError: exit 2
            _run(tmp_path, more + flags, cli=more + flags)
    assert [r["run_id"] for r in pack.read_packed_runs(exp)] == ["r"]  # nothing was written
    assert pack_cli.main(["--unpack", str(exp / "r")]) == 0
    extend = more + ["trainer.resume=true"]
    assert _run(tmp_path, extend, cli=extend)["steps"] == 8
    pack.pack_experiment(exp)
    assert pack_cli.main(["--unpack", str(exp / "r")]) == 0  # the packed rows, as the run wrote them
    rows = comparable_rows(read_metrics(exp / "r" / "metrics.jsonl"))
    assert sorted({r["step"] for r in rows}) == list(range(9))
    assert rows[: len(rows_before)] == rows_before


@pytest.mark.parametrize("problem", ["fosi", "adam"])
def test_a_run_paused_at_a_step_resumes_into_the_uninterrupted_run(tmp_path, problem):
    """``trainer.pause_at_step`` splits a long run between sessions: it stops there as a signal
    would (checkpoint, status interrupted, exit code 0, no extra evaluation), the pack leaves it
    alone, and resuming without the flag gives the rows of a run made in one go. FOSI is paused
    just before an ESE (ese_warmup 2 + ese_period 4: step 6), where its checkpoint has no basis."""
    from curvopt.analysis import pack
    from curvopt.training.checkpoint import read_checkpoint

    extra = [*PROBLEMS[problem], "trainer.max_steps=10"]
    full = _rows(_run(tmp_path, [*extra, "run_id=full"]))
    part = _run(tmp_path, [*extra, "run_id=part", "trainer.pause_at_step=6"])
    assert (part["status"], part["stop_reason"], part["steps"]) == ("interrupted", "paused", 6)
    assert exit_code(part) == EXIT_COMPLETED and part["checkpoint_step"] == 6
    run_dir = Path(part["run_dir"])
    assert max(r["step"] for r in read_metrics(run_dir / "metrics.jsonl")) == 6
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "val/loss" in r] == [0, 5]
    if problem == "fosi":
        fosi = read_checkpoint(run_dir / "checkpoint.pt", torch.device("cpu"))["algorithm"]["fosi"]["fosi"]
        assert fosi["basis_dropped_before_ese"] and fosi["V"] is None and fosi["ese_count"] == 1
    assert "part" in pack.pack_experiment(run_dir.parent).skipped
    resumed = _run(tmp_path, [*extra, "run_id=part", "trainer.resume=true"])
    assert resumed["status"] == "completed" and _rows(resumed) == full
