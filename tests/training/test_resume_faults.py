"""Resume and run-directory faults of issue 43: every one named before training (exit 2), nothing
lost. A deleted or shortened metrics.jsonl, a park killed half-way, a moved run, a pause step already
passed, another optimizer, a results directory that cannot be written, a learning rate no float32
holds."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import pytest

from curvopt.errors import EXIT_BAD_INPUT, BadInputError, ConfigError, RunExistsError
from curvopt.training.loop import comparable_rows
from curvopt.training.records import read_metrics
from tests.training.test_faults import TINY, _run

ROOT = Path(__file__).resolve().parents[2]


def _finished(tmp_path: Path, run_id: str, steps: int = 4, cli: bool = False) -> Path:
    args = [
        "optimizer=adam",
        f"run_id={run_id}",
        f"trainer.max_steps={steps}",
        "trainer.keep_checkpoint=true",
    ]
    return Path(_run(tmp_path, args, cli=args if cli else None)["run_dir"])


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file() and p.name != "run.lock"}


@pytest.mark.parametrize("damage", ["deleted", "shortened"])
def test_resume_over_a_deleted_or_shortened_metrics_file_is_refused(tmp_path, damage):
    """Before: the resume appended its rows to what was left and its summary said completed; the
    rows up to the checkpoint were silently missing."""
    run_dir = _finished(tmp_path, "g")
    metrics = run_dir / "metrics.jsonl"
    if damage == "deleted":
        metrics.unlink()
    else:
        metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:2]))
    before = _snapshot(run_dir)
    match = (
        "metrics.jsonl is missing" if damage == "deleted" else r"metrics.jsonl is shortened: .* lacks step 4"
    )
    with pytest.raises(RunExistsError, match=match + r".*restore it .*trainer.restart=true"):
        _run(tmp_path, ["optimizer=adam", "run_id=g", "trainer.max_steps=6", "trainer.resume=true"])
    assert _snapshot(run_dir) == before  # nothing changed


def test_a_run_whose_park_was_killed_resumes_with_every_row(tmp_path):
    """`pack --park` killed between writing metrics.jsonl.gz and deleting metrics.jsonl leaves both,
    with the same rows. Before: the resume stopped with a FileExistsError traceback (exit 1)."""
    plain = _finished(tmp_path, "plain")
    run_dir = _finished(tmp_path, "p")
    rows = (run_dir / "metrics.jsonl").read_bytes()
    (run_dir / "metrics.jsonl.gz").write_bytes(gzip.compress(rows))  # the park's copy, the original kept
    more = ["optimizer=adam", "trainer.max_steps=6", "trainer.resume=true"]
    longer = _run(tmp_path, [*more, "run_id=p"])
    _run(tmp_path, [*more, "run_id=plain"])
    assert longer["status"] == "completed" and not (run_dir / "metrics.jsonl.gz").exists()
    assert comparable_rows(read_metrics(run_dir / "metrics.jsonl")) == comparable_rows(
        read_metrics(plain / "metrics.jsonl")
    )


def test_a_run_moved_with_pack_move_resumes_under_its_new_name(tmp_path):
    """Before: the moved run's config.yaml kept its old experiment_name, and the resume was refused
    unless trainer.allow_config_change=true."""
    from curvopt.analysis import pack

    run_dir = _finished(tmp_path, "m", cli=True)
    rows = comparable_rows(read_metrics(run_dir / "metrics.jsonl"))
    pack.move_run(run_dir, tmp_path / "t2" / "m2")
    args = ["optimizer=adam", "experiment_name=t2", "run_id=m2", "trainer.max_steps=6", "trainer.resume=true"]
    longer = _run(tmp_path, args, cli=args)
    assert longer["status"] == "completed" and longer["steps"] == 6
    got = comparable_rows(read_metrics(tmp_path / "t2" / "m2" / "metrics.jsonl"))
    assert got[: len(rows)] == rows and sorted({r["step"] for r in got}) == list(range(7))


def test_a_pause_step_already_passed_is_refused(tmp_path):
    """Before: the resumed run stopped at once at its checkpoint's step, status interrupted, exit 0."""
    args = ["optimizer=adam", "run_id=p", "trainer.max_steps=10"]
    _run(tmp_path, [*args, "trainer.pause_at_step=6"])
    run_dir = tmp_path / "t" / "p"
    before = _snapshot(run_dir)
    for pause in (3, 6):
        with pytest.raises(ConfigError, match=rf"trainer.pause_at_step={pause}: .* resumes at step 6"):
            _run(tmp_path, [*args, "trainer.resume=true", f"trainer.pause_at_step={pause}"])
    assert _snapshot(run_dir) == before
    assert _run(tmp_path, [*args, "trainer.resume=true", "trainer.pause_at_step=8"])["steps"] == 8


@pytest.mark.parametrize("started_with", [["optimizer=adam"], []], ids=["chosen", "default"])
@pytest.mark.parametrize("allow", [False, True], ids=["refused", "allow_config_change"])
def test_another_optimizer_on_resume_names_the_changed_group(tmp_path, started_with, allow):
    """Before: with trainer.allow_config_change, `optimizer=sgd` on an Adam run failed with
    `SGD.__init__() got an unexpected keyword argument 'betas'`; on a run that took the experiment's
    default optimizer the choice was ignored and the run went on with Adam."""
    first = [*started_with, "run_id=s", "trainer.max_steps=4", "trainer.keep_checkpoint=true"]
    _run(tmp_path, first, cli=first)
    before = _snapshot(tmp_path / "t" / "s")
    args = ["optimizer=sgd", "run_id=s", "trainer.max_steps=6", "trainer.resume=true"]
    if allow:
        args.append("trainer.allow_config_change=true")
    with pytest.raises(
        ConfigError,
        match=r"optimizer(: adam -> sgd|=sgd \(optimizer.name: 'adam' -> 'sgd'\)|=adam -> optimizer=sgd)",
    ):
        _run(tmp_path, args, cli=args)
    assert _snapshot(tmp_path / "t" / "s") == before


def test_a_learning_rate_no_float32_holds_is_refused_before_training(tmp_path):
    """Before: `optimizer.lr=1e300` failed inside the first step (RuntimeError: value cannot be
    converted to type float without overflow; status failed, exit 1)."""
    for opt in ("sgd", "adam"):
        with pytest.raises(ConfigError, match=r"optimizer.lr=1e\+300: larger than the largest float32"):
            _run(tmp_path, [f"optimizer={opt}", "run_id=lr", "optimizer.lr=1e300"])
    assert not (tmp_path / "t").exists()


def test_a_results_directory_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """Before: NotADirectoryError / PermissionError tracebacks, exit 1."""
    from curvopt.training import records

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(
        ConfigError, match=r"cannot write the run directory .*NotADirectoryError.*paths.results_dir"
    ):
        _run(not_a_dir, ["optimizer=adam", "run_id=r"])
    real_open = records.os.open

    def read_only(path, flags, *args):  # what a read-only folder does for a user who is not root
        if str(path).endswith("run.lock") and flags & records.os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(records.os, "open", read_only)
    with pytest.raises(
        ConfigError, match=r"cannot write the run directory .*PermissionError: Permission denied"
    ):
        _run(tmp_path / "ro", ["optimizer=adam", "run_id=r"])
    assert not (tmp_path / "ro").exists()  # the directory it made is gone again


def test_train_py_names_a_results_path_that_is_a_file_and_exits_2(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    proc = subprocess.run(
        [sys.executable, "src/train.py", *TINY, f"paths.results_dir={not_a_dir}", "optimizer=adam"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-2000:]
    assert "cannot write the run directory" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert not_a_dir.read_text() == "x"


def test_a_half_written_runs_jsonl_stops_train_py_with_its_name(tmp_path):
    from curvopt.analysis import pack

    _finished(tmp_path, "a")
    pack.pack_experiment(tmp_path / "t")
    runs = tmp_path / "t" / "runs.jsonl"
    cut = runs.read_text()[:-30]
    runs.write_text(cut)
    with pytest.raises(BadInputError, match=r"runs.jsonl is not a valid pack"):
        _run(tmp_path, ["optimizer=adam", "run_id=a", "trainer.max_steps=6", "trainer.resume=true"])
    assert runs.read_text() == cut  # left as it is


def test_a_portable_data_dir_in_the_saved_config_is_the_same_folder(tmp_path):
    """config.yaml saves dataset.data_dir as $CURVOPT_DATA_DIR; a resume whose config names that
    folder by its absolute path changes nothing, another folder is a change."""
    from omegaconf import OmegaConf

    from curvopt.errors import ConfigError
    from curvopt.training.rundir import resume_config

    data = tmp_path / "data"
    data.mkdir()
    saved = {"paths": {"data_dir": "$CURVOPT_DATA_DIR"}, "dataset": {"data_dir": "$CURVOPT_DATA_DIR/mnist"}}
    fresh = OmegaConf.create({"paths": {"data_dir": str(data)}, "dataset": {"data_dir": str(data / "mnist")}})
    plan = resume_config(saved, fresh)
    assert OmegaConf.select(plan.config, "dataset.data_dir") == str(data / "mnist")
    other = OmegaConf.create(
        {"paths": {"data_dir": str(data)}, "dataset": {"data_dir": str(tmp_path / "elsewhere")}}
    )
    with pytest.raises(ConfigError, match="dataset.data_dir"):
        resume_config(saved, other)
