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
from experiments import pack as pack_cli
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
    assert "is in use" in resumed.get("refused", ""), (
        "the resume was not refused while the packer held the run"
    )
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


def test_a_pack_whose_metrics_parquet_is_gone_is_named_not_read_as_runs_without_rows(tmp_path: Path) -> None:
    """Before: load_runs read the packed runs as finished with no rows, and packing again wrote
    them so for good."""
    from curvopt.analysis.records import RecordError, load_runs

    exp = tmp_path / "exp"
    finished_run(exp)
    pack.pack_experiment(exp)
    (exp / "metrics.parquet").unlink()
    with pytest.raises(RecordError, match=r"runs.jsonl lists 1 packed runs but .*metrics.parquet is missing"):
        load_runs(tmp_path, "exp")
    with pytest.raises(RecordError, match="metrics.parquet is missing"):
        pack.pack_experiment(exp)
    assert pack_cli.main([str(exp)]) == 2
    assert json.loads((exp / "runs.jsonl").read_text())["run_id"] == "adam_s0"  # left as it was


@pytest.mark.parametrize("gz", [False, True])
def test_a_half_written_runs_jsonl_is_named(tmp_path: Path, gz: bool, capsys: pytest.CaptureFixture) -> None:
    """Before: a bare JSONDecodeError (or EOFError for the .gz) from every reader, and train.py."""
    import gzip

    from curvopt.analysis.records import RecordError, load_summaries
    from curvopt.errors import BadInputError
    from curvopt.training.rundir import check_run_dir

    exp = tmp_path / "exp"
    finished_run(exp, "a_s0")
    finished_run(exp, "b_s1")
    pack.pack_experiment(exp)
    text = (exp / "runs.jsonl").read_bytes()
    (exp / "runs.jsonl").unlink()
    cut = text[: len(text) - 40]
    if gz:
        (exp / "runs.jsonl.gz").write_bytes(gzip.compress(text)[:-30])
        name = "runs.jsonl.gz"
    else:
        (exp / "runs.jsonl").write_bytes(cut)
        name = "runs.jsonl"
    with pytest.raises(RecordError, match=rf"{name} .*truncated or half-written.*restore it"):
        load_summaries(tmp_path, "exp")
    with pytest.raises(BadInputError, match=rf"{name} is not a valid pack .*restore it"):
        check_run_dir(exp / "a_s0", resume=True, restart=False)
    assert pack_cli.main(["--unpack", str(exp / "a_s0")]) == 2
    assert name in capsys.readouterr().err


def test_a_parked_finished_run_packed_leaves_no_gz_behind(tmp_path: Path) -> None:
    """Before: the packer deleted metrics.jsonl but not a parked metrics.jsonl.gz; the run then looked
    loose, and train.py let a resume of it past the packed-id refusal."""
    from curvopt.errors import RunExistsError
    from curvopt.training.records import park_metrics
    from curvopt.training.rundir import check_run_dir

    exp = tmp_path / "exp"
    run = finished_run(exp)
    (run / "checkpoint.pt").write_bytes(b"kept checkpoint")  # a finished run that kept its checkpoint
    park_metrics(run)
    res = pack.pack_experiment(exp)
    assert res.runs == 1 and res.rows == 5
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.pt"]
    with pytest.raises(RunExistsError, match="--unpack"):
        check_run_dir(run, resume=True, restart=False)


def test_repacking_keeps_int_columns_ints(tmp_path: Path) -> None:
    """Before: a column of ints that some rows lack came back as floats after a second pack (3 -> 3.0)."""
    import pyarrow.parquet as pq

    exp = tmp_path / "exp"
    rows = [{"step": s, "loss": 1.0, **({"cg_iters": s * 3} if s % 2 else {})} for s in range(4)]
    write_run(exp, "a_s0", rows, {"status": "completed"}, CONFIG)
    pack.pack_experiment(exp)
    finished_run(exp, "b_s1")  # a run added later: packing again reads the packed rows back
    pack.pack_experiment(exp)
    schema = pq.read_schema(exp / "metrics.parquet")
    assert str(schema.field("cg_iters").type) == "int64" and str(schema.field("step").type) == "int64"
    pack.unpack_run(exp / "a_s0")
    assert read_metrics(exp / "a_s0" / "metrics.jsonl") == rows


@pytest.mark.parametrize("kill_after", ["summary.json", "metrics.jsonl", "records"])
def test_a_killed_unpack_is_finished_by_unpacking_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill_after: str
) -> None:
    """Before: a second --unpack refused the files the first one wrote, and the advice it printed (pack
    the experiment) did not clear a run without metrics.jsonl."""
    from curvopt.training import records as training_records

    exp = tmp_path / "exp"
    finished_run(exp, "a_s0")
    finished_run(exp, "b_s1")
    pack.pack_experiment(exp)
    real_write = training_records.atomic_write_text
    real_drop = pack._drop_from_pack

    def killed_write(path: Path, text: str) -> None:
        real_write(path, text)
        if path.name == kill_after:
            raise KeyboardInterrupt  # SIGKILL in effect: nothing after this line runs

    def killed_drop(exp_dir: Path, run_id: str) -> None:
        raise KeyboardInterrupt

    if kill_after == "records":
        monkeypatch.setattr(pack, "_drop_from_pack", killed_drop)
    else:
        monkeypatch.setattr(pack, "atomic_write_text", killed_write)
    with pytest.raises(KeyboardInterrupt):
        pack.unpack_run(exp / "a_s0")
    monkeypatch.setattr(pack, "atomic_write_text", real_write)
    monkeypatch.setattr(pack, "_drop_from_pack", real_drop)
    assert pack_cli.main(["--unpack", str(exp / "a_s0")]) == 0
    assert [r["run_id"] for r in pack.read_packed_runs(exp)] == ["b_s1"]
    assert len(read_metrics(exp / "a_s0" / "metrics.jsonl")) == 5


def test_unpack_still_refuses_records_of_another_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    exp = tmp_path / "exp"
    finished_run(exp)
    pack.pack_experiment(exp)
    (exp / "adam_s0").mkdir()
    (exp / "adam_s0" / "summary.json").write_text('{"status": "failed"}')
    assert pack_cli.main(["--unpack", str(exp / "adam_s0")]) == 2
    assert "Move summary.json out of" in capsys.readouterr().err
    assert pack.read_packed_runs(exp)[0]["run_id"] == "adam_s0"


def test_a_parked_copy_left_by_an_older_pack_is_refused_then_cleared_by_unpack(tmp_path: Path) -> None:
    """A pack made before this fix left metrics.jsonl.gz beside the packed run: train.py took the run
    for a loose one. Now it is refused with the unpack command, and unpacking takes the copy back."""
    import gzip

    from curvopt.errors import RunExistsError
    from curvopt.training.rundir import check_run_dir

    exp = tmp_path / "exp"
    run = finished_run(exp)
    text = (run / "metrics.jsonl").read_text()
    (run / "checkpoint.pt").write_bytes(b"kept checkpoint")
    pack.pack_experiment(exp)
    (run / "metrics.jsonl.gz").write_bytes(
        gzip.compress(pack._record_texts(None, None, read_metrics_text(text))["metrics.jsonl"].encode())
    )
    with pytest.raises(RunExistsError, match="--unpack"):
        check_run_dir(run, resume=True, restart=False)
    assert pack_cli.main(["--unpack", str(run)]) == 0
    assert not (run / "metrics.jsonl.gz").exists() and len(read_metrics(run / "metrics.jsonl")) == 5
    assert check_run_dir(run, resume=True, restart=False) == "resume"


def read_metrics_text(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("packed", [False, True])
def test_a_resume_started_while_a_run_is_moved_is_refused_and_no_row_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    """move_run holds the source run's lock from its check to the delete of the directory. Before, it
    only looked for run.lock once: a resume that started between the check and the delete wrote rows
    into a directory the move then deleted (and the moved copy lacked them)."""
    exp = tmp_path / "exp"
    run = finished_run(exp)
    (run / "checkpoint.pt").write_bytes(b"kept checkpoint")  # a finished run that can be extended
    if packed:
        pack.pack_experiment(exp)
    real_write = pack._write_records
    resumed: dict = {}

    def slow_write(run_dir: Path, *args, **kwargs) -> None:
        # the move reads the records, then writes the copy: `trainer.resume=true` starts now
        lock = RunLock(run)
        try:
            lock.acquire()
        except RunInUseError as err:
            resumed["refused"] = str(err)
        else:
            recorder = RunRecorder(run, resume_step=4)
            recorder.log({"step": 5, "train/loss": 0.1})
            recorder.close()
            lock.release()
            resumed["wrote"] = True
        real_write(run_dir, *args, **kwargs)

    monkeypatch.setattr(pack, "_write_records", slow_write)
    new = pack.move_run(run, tmp_path / "other" / "adam_s0")
    assert "is in use" in resumed.get("refused", ""), "the resume was not refused while the move held the run"
    assert [r["step"] for r in read_metrics(new / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert (new / "checkpoint.pt").read_bytes() == b"kept checkpoint" and not (new / "run.lock").exists()
    assert not run.exists() and not pack.read_packed_runs(exp)
