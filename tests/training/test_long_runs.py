"""Long runs that outlive a working session: time-based checkpoints, resuming a killed run from
its committed directory, one process per run directory, override parsing of the drivers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from curvopt.training.build import run_from_config
from curvopt.training.records import RunLock
from experiments import runs
from tests.conftest import TINY_RUN, compose

TINY = [*TINY_RUN, "optimizer=adam", "experiment_name=t"]


def _run(tmp_path: Path, extra: list[str]) -> dict:
    return run_from_config(compose([*TINY, f"paths.results_dir={tmp_path}", *extra]))


def test_time_based_checkpoint_is_written_and_removed_when_not_kept(tmp_path, monkeypatch):
    from curvopt.training import loop

    saved_steps: list[int] = []
    original = loop.Trainer.save_checkpoint

    def spy(self):
        saved_steps.append(self.step)
        original(self)

    monkeypatch.setattr(loop.Trainer, "save_checkpoint", spy)
    # checkpoint_every_s=0 would be "off"; a tiny positive interval makes every step due
    summary = _run(
        tmp_path,
        [
            "run_id=a",
            "trainer.max_steps=6",
            "trainer.checkpoint_every_s=1e-9",
            "trainer.keep_checkpoint=false",
        ],
    )
    assert saved_steps == [1, 2, 3, 4, 5, 6]
    assert not (Path(summary["run_dir"]) / "checkpoint.pt").exists()  # finished: periodic one removed
    saved_steps.clear()
    _run(tmp_path, ["run_id=b", "trainer.max_steps=6"])
    assert saved_steps == [6]  # default: only the final checkpoint


def test_killed_run_with_checkpoint_is_resumed_by_the_driver(tmp_path):
    # a run killed after its checkpoint: records up to step 10 and beyond, no summary
    full = _run(tmp_path, ["run_id=full", "trainer.max_steps=20"])
    _run(tmp_path, ["run_id=adam_quick_s0", "trainer.max_steps=10", "seed=0"])
    run_dir = Path(tmp_path) / "t" / "adam_quick_s0"
    (run_dir / "summary.json").unlink()
    action, _ = runs.ensure_run("t", "adam", 0, results_dir=tmp_path, dry_run=True)
    assert action == "resumed"
    # without a checkpoint the unfinished run is moved aside, never deleted
    (run_dir / "checkpoint.pt").unlink()
    action, _ = runs.ensure_run("t", "adam", 0, results_dir=tmp_path, dry_run=True)
    assert action == "ran" and not run_dir.exists()
    assert len(list((Path(tmp_path) / "t").glob("adam_quick_s0.killed-*"))) == 1
    assert full["status"] == "completed"


def test_packed_runs_are_kept_by_the_driver(tmp_path):
    """A completed run folded into the experiment's pack is not run again."""
    from curvopt.analysis.pack import pack_experiment

    _run(tmp_path, ["run_id=adam_quick_s0", "trainer.max_steps=3", "seed=0"])
    assert runs.ensure_run("t", "adam", 0, results_dir=tmp_path, dry_run=True)[0] == "kept"
    pack_experiment(Path(tmp_path) / "t")
    assert not (Path(tmp_path) / "t" / "adam_quick_s0" / "summary.json").exists()  # in the pack now
    assert runs.run_status(Path(tmp_path) / "t" / "adam_quick_s0") == "completed"
    assert runs.ensure_run("t", "adam", 0, results_dir=tmp_path, dry_run=True)[0] == "kept"
    assert runs.ensure_run("t", "adam", 1, results_dir=tmp_path, dry_run=True)[0] == "ran"


def test_run_lock_refuses_a_live_owner_and_takes_over_a_stale_one(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lock = RunLock(tmp_path)
        lock.path.parent.mkdir(parents=True, exist_ok=True)
        from curvopt.training.records import _boot_id

        lock.path.write_text(json.dumps({"pid": child.pid, "boot_id": _boot_id()}))
        with pytest.raises(RuntimeError, match=f"in use by process {child.pid}"):
            lock.acquire()
        # the same pid on another machine (a committed run directory) is stale
        lock.path.write_text(json.dumps({"pid": child.pid, "boot_id": "another-machine"}))
        lock.acquire()
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
        lock.release()
        assert not lock.path.exists()
    finally:
        child.kill()
        child.wait()


def test_run_lock_is_released_after_a_run(tmp_path):
    summary = _run(tmp_path, ["run_id=a", "trainer.max_steps=2"])
    assert not (Path(summary["run_dir"]) / "run.lock").exists()


def test_driver_overrides_may_follow_the_seed_list(tmp_path, capsys):
    runs.main(
        [
            "--experiment",
            "t",
            "--optimizers",
            "adam",
            "--seeds",
            "0",
            "1",
            "trainer.num_threads=1",
            "trainer.clock=process",
            "--results-dir",
            str(tmp_path),
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert out.count("trainer.num_threads=1 trainer.clock=process") == 2
    assert "seed=0" in out and "seed=1" in out


CHILD = """
import signal, sys, time
from pathlib import Path
stop = []
signal.signal(signal.SIGINT, lambda s, f: stop.append(s))
signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
Path(sys.argv[1], "started").write_text("")
while not stop:
    time.sleep(0.01)
time.sleep(1.0)  # a step boundary and a checkpoint take a while
Path(sys.argv[1], "checkpoint").write_text("")
sys.exit(128 + stop[0])
"""
DRIVER = """
import sys
sys.path.insert(0, "src")
from experiments.runs import run_train
run_train([sys.executable, "-c", sys.argv[1], sys.argv[2]])
"""


@pytest.mark.parametrize("how", ["ctrl_c_to_the_group", "sigterm_to_the_driver"])
def test_driver_waits_for_an_interrupted_run_to_checkpoint(tmp_path, how):
    """subprocess.run SIGKILLs its child 0.25 s after a Ctrl-C: a run driven by make reproduce-*
    never wrote its interrupt checkpoint. run_train waits (and passes a SIGTERM on)."""
    import signal
    import time

    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, CHILD, str(tmp_path)],
        cwd=Path(__file__).resolve().parents[2],
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        end = time.monotonic() + 120
        while not (tmp_path / "started").exists():
            assert driver.poll() is None and time.monotonic() < end
            time.sleep(0.01)
        if how == "ctrl_c_to_the_group":
            os.killpg(driver.pid, signal.SIGINT)
            expected = 130
        else:
            driver.send_signal(signal.SIGTERM)
            expected = 143
        assert driver.wait(timeout=120) == expected
        assert (tmp_path / "checkpoint").exists()
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)


def test_driver_goes_on_after_a_diverged_run_and_stops_on_failure():
    assert runs.run_train([sys.executable, "-c", "raise SystemExit(3)"]) == 3
    with pytest.raises(subprocess.CalledProcessError):
        runs.run_train([sys.executable, "-c", "raise SystemExit(1)"])
    with pytest.raises(SystemExit) as stop:
        runs.run_train([sys.executable, "-c", "raise SystemExit(130)"])
    assert stop.value.code == 130
