"""Moving a run's records (curvopt.analysis.pack.move_run): loose or packed, the records read back
the same under the new experiment and run id, and the source no longer holds the run."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from curvopt.analysis import pack
from curvopt.analysis.records import load_summaries, read_run_metrics
from curvopt.errors import RunInUseError
from curvopt.training.records import RunLock


def write_run(exp: Path, run_id: str, rows: list[dict], status: str = "completed") -> Path:
    run = exp / run_id
    run.mkdir(parents=True)
    config = {"run_id": run_id, "seed": 1, "optimizer": {"name": "shf_lsmr", "damping_center": "zero"}}
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"status": status, "run_id": run_id, "steps": len(rows)}))
    (run / "overrides.yaml").write_text(f"overrides:\n- run_id={run_id}\n")
    return run


ROWS = [
    {"step": 1, "loss": 2.5, "batch_size": 200, "stop": "ftol"},
    {"step": 2, "loss": "inf", "batch_size": 210, "eigs": [1.0, 2.0]},
    {"step": 3, "loss": 1.5, "batch_size": 220, "val/f": 3.0},
]


def frame_without_run_id(run_dir: Path) -> pd.DataFrame:
    return read_run_metrics(run_dir).reset_index(drop=True)


@pytest.mark.parametrize("packed", [False, True])
def test_move_run_keeps_records_and_renames(tmp_path: Path, packed: bool) -> None:
    audit, main = tmp_path / "audit" / "exp", tmp_path / "main" / "exp"
    write_run(audit, "shf_s1_center_zero", ROWS)
    write_run(audit, "shf_s1_other", ROWS[:2])
    if packed:
        pack.pack_experiment(audit)
        assert not (audit / "shf_s1_center_zero" / "metrics.jsonl").exists()
    before = frame_without_run_id(audit / "shf_s1_center_zero")

    new = pack.move_run(audit / "shf_s1_center_zero", main / "shf_s1")

    assert new == main / "shf_s1"
    summary = json.loads((new / "summary.json").read_text())
    assert summary["run_id"] == "shf_s1" and summary["moved_from"] == "exp/shf_s1_center_zero"
    assert summary["status"] == "completed" and summary["steps"] == 3
    config = yaml.safe_load((new / "config.yaml").read_text())
    assert config["run_id"] == "shf_s1" and config["optimizer"]["damping_center"] == "zero"
    # the command line as run moves unchanged
    assert "run_id=shf_s1_center_zero" in (new / "overrides.yaml").read_text()
    lines = [json.loads(line) for line in (new / "metrics.jsonl").read_text().splitlines()]
    assert lines == [json.loads(json.dumps(r)) for r in ROWS]  # as the run logged them, ints as ints
    if packed:  # the loose and the packed layout read "inf" differently: compare like with like
        pack.pack_experiment(main)
    pd.testing.assert_frame_equal(frame_without_run_id(new), before, check_dtype=False)
    # the source no longer has it; the other run stays
    assert not (audit / "shf_s1_center_zero").exists()
    assert list(load_summaries(tmp_path / "audit", "exp")["run_id"]) == ["shf_s1_other"]
    # and the destination packs cleanly (the pack checks itself against the files)
    res = pack.pack_experiment(main)
    assert res.runs == 1 and res.rows == 3 and pack.is_packed(main)


def test_move_run_refuses_to_overwrite_or_invent(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    write_run(exp, "a", ROWS)
    write_run(exp, "b", ROWS)
    with pytest.raises(FileExistsError, match="already exists"):
        pack.move_run(exp / "a", exp / "b")
    with pytest.raises(FileNotFoundError, match="no finished run"):
        pack.move_run(exp / "missing", exp / "c")
    lock = RunLock(exp / "a")  # a live run owns it
    lock.acquire()
    try:
        with pytest.raises(RunInUseError, match="is in use by process"):
            pack.move_run(exp / "a", exp / "c")
    finally:
        lock.release()
    assert (exp / "a" / "metrics.jsonl").exists() and not (exp / "c").exists()
    (exp / "a" / "run.lock").write_text("{}")  # left by a killed run: stale, taken over
    pack.move_run(exp / "a", exp / "c")
    assert not (exp / "a").exists() and not (exp / "c" / "run.lock").exists()


def test_drop_every_packed_run_removes_the_pack(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    write_run(exp, "a", ROWS)
    pack.pack_experiment(exp)
    pack.move_run(exp / "a", tmp_path / "other" / "a")
    assert not pack.is_packed(exp)
    assert (tmp_path / "other" / "a" / "metrics.jsonl").exists()
