"""Faults around packed records (issue 43): a resume racing the packer, damaged packs, parked runs,
an interrupted ``--unpack``, column types kept across repacking."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from curvopt.analysis import pack
from curvopt.analysis.records import read_run_metrics
from curvopt.errors import RunInUseError
from curvopt.training.records import RunLock, RunRecorder, read_metrics
from tests.analysis.test_pack import write_run

CONFIG = {"seed": 0, "profile": "quick", "optimizer": {"name": "adam", "lr": 0.1}}


def finished_run(exp: Path, run_id: str = "adam_s0", steps: int = 5) -> Path:
    rows = [{"step": s, "train/loss": 1.0 / (s + 1)} for s in range(steps)]
    return write_run(exp, run_id, rows, {"status": "completed", "steps": steps - 1}, CONFIG)


def test_a_resume_started_while_the_packer_works_is_refused_and_no_row_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packer holds each run's lock from its scan to the delete of its files. Before, it only
    looked for run.lock at the scan: a resume of a finished run that started between the packer's
    check and its delete appended its rows to a metrics.jsonl the packer then deleted."""
    exp = tmp_path / "exp"
    run = finished_run(exp)
    real_verify = pack._verify
    resumed: dict = {}

    def slow_verify(exp_dir: Path, run_dirs: list[Path]) -> None:
        real_verify(exp_dir, run_dirs)
        # a large experiment's pack takes a while: `trainer.resume=true trainer.max_steps=7` starts now
        lock = RunLock(run)
        try:
            lock.acquire()
        except RunInUseError as err:
            resumed["refused"] = str(err)
            return
        recorder = RunRecorder(run, resume_step=4)
        recorder.log({"step": 5, "train/loss": 0.1})
        resumed.update(lock=lock, recorder=recorder)

    monkeypatch.setattr(pack, "_verify", slow_verify)
    pack.pack_experiment(exp)
    if "recorder" in resumed:  # the resumed run goes on and ends as it would
        resumed["recorder"].log({"step": 6, "train/loss": 0.05})
        resumed["recorder"].write_summary({"status": "completed", "steps": 6})
        resumed["recorder"].close()
        resumed["lock"].release()
    assert "is in use" in resumed.get("refused", ""), "the resume was not refused while the packer held the run"
    assert list(read_run_metrics(run)["step"]) == [0, 1, 2, 3, 4]  # the whole run, packed
    assert not (run / "run.lock").exists() and not run.exists()


def test_a_run_resumed_before_the_packer_reaches_it_is_skipped(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    run = finished_run(exp)
    lock = RunLock(run)
    lock.acquire()
    try:
        res = pack.pack_experiment(exp)
    finally:
        lock.release()
    assert res.skipped == ["adam_s0"] and res.runs == 0
    assert len(read_metrics(run / "metrics.jsonl")) == 5
