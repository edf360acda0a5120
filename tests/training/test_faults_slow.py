"""The fault scenarios with real processes (``make test-slow``): SIGINT, SIGTERM and SIGKILL sent
to ``src/train.py`` mid-run, then the same command with ``trainer.resume=true``, give the
uninterrupted run's metrics row by row for Adam, SHF-LSMR, HF-CG, FOSI and Alice; a full disk
(RLIMIT_FSIZE) at the final checkpoint, two processes on one run id, one Ctrl-C in a sweep, and
the exit codes of docs/resume.md."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from curvopt.errors import EXIT_BAD_INPUT, EXIT_COMPLETED, EXIT_DIVERGED, EXIT_SIGINT, EXIT_SIGTERM
from curvopt.training.loop import comparable_rows
from curvopt.training.records import read_metrics
from tests.training.test_faults import PROBLEMS, TINY

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# long enough that a signal after a few rows always arrives mid-run on a busy 2-core CPU
STEPS = {"adam": 150, "fosi": 60, "alice": 80, "shf_lsmr": 25, "hf_cg": 25}
SIGNALS = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}
EXPECTED_CODE = {"sigint": EXIT_SIGINT, "sigterm": EXIT_SIGTERM, "sigkill": -signal.SIGKILL}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OPENBLAS_NUM_THREADS"] = "1"
    return env


def _cmd(results: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "src/train.py",
        *TINY,
        f"paths.results_dir={results}",
        f"paths.output_dir={results}/outputs",
        "trainer.num_threads=1",
        *extra,
    ]


def _start(cmd: list[str], log: Path, **kwargs) -> subprocess.Popen:
    fh = log.open("w")
    return subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=fh, stderr=subprocess.STDOUT, text=True, **kwargs
    )


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 900) -> tuple[int, str]:
    code = proc.wait(timeout=timeout)
    return code, log.read_text()


def _wait_rows(path: Path, rows: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and len(read_metrics(path)) >= rows:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended (code {proc.returncode}) before it had {rows} rows")
        time.sleep(0.05)
    pytest.fail(f"no {rows} rows in {path} after {timeout} s")


def _rows(run_dir: Path) -> list[dict]:
    return comparable_rows(read_metrics(run_dir / "metrics.jsonl"))


def _summary(run_dir: Path) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"bare {name}")

    return json.loads((run_dir / "summary.json").read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted run of each problem (a subprocess, as the interrupted ones)."""
    root = tmp_path_factory.mktemp("references")
    cache: dict[str, list[dict]] = {}

    def get(problem: str) -> list[dict]:
        if problem not in cache:
            extra = [*PROBLEMS[problem], f"run_id={problem}", f"trainer.max_steps={STEPS[problem]}"]
            log = root / f"{problem}.log"
            code, out = _finish(_start(_cmd(root, [*extra, "trainer.checkpoint_every=3"]), log), log)
            assert code == EXIT_COMPLETED, out[-3000:]
            cache[problem] = _rows(root / "t" / problem)
        return cache[problem]

    return get


@pytest.mark.parametrize("sig", sorted(SIGNALS))
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_real_signal_then_resume_equals_the_uninterrupted_run(tmp_path, references, problem, sig):
    expected = references(problem)
    extra = [
        *PROBLEMS[problem],
        "run_id=r",
        f"trainer.max_steps={STEPS[problem]}",
        "trainer.checkpoint_every=3",  # what SIGKILL resumes from
    ]
    run_dir = tmp_path / "t" / "r"
    log = tmp_path / "first.log"
    proc = _start(_cmd(tmp_path, extra), log)
    _wait_rows(run_dir / "metrics.jsonl", 8, proc)
    proc.send_signal(SIGNALS[sig])
    code, out = _finish(proc, log)
    assert code == EXPECTED_CODE[sig], out[-3000:]
    if sig == "sigkill":
        assert not (run_dir / "summary.json").exists()
    else:
        saved = _summary(run_dir)
        assert saved["status"] == "interrupted" and saved["stop_reason"] == sig
        assert saved["checkpoint_step"] == saved["steps"] < STEPS[problem]
    log2 = tmp_path / "resume.log"
    code, out = _finish(_start(_cmd(tmp_path, [*extra, "trainer.resume=true"]), log2), log2)
    assert code == EXIT_COMPLETED, out[-3000:]
    assert _summary(run_dir)["status"] == "completed"
    assert _rows(run_dir) == expected


def test_the_issue_example_mnist_autoencoder_ctrl_c_at_15_rows(tmp_path, shared_data_dir):
    """Item 1 of the issue, verbatim: Ctrl-C when metrics.jsonl has 15 lines, then resume; step 15
    has epoch 0.0768 and the uninterrupted loss."""
    base = [
        sys.executable,
        "src/train.py",
        "experiment=mnist_autoencoder",
        "optimizer=adam",
        "trainer.max_steps=30",
        "trainer.eval_every=10",
        "logger=none",
        "trainer.num_threads=1",
        f"paths.results_dir={tmp_path}",
        f"paths.output_dir={tmp_path}/outputs",
    ]
    log = tmp_path / "full.log"
    proc = subprocess.Popen(
        [*base, "run_id=F"], cwd=REPO, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    assert proc.wait(timeout=1800) == 0, log.read_text()[-3000:]
    run_dir = tmp_path / "mnist_autoencoder" / "E"
    log = tmp_path / "e.log"
    proc = subprocess.Popen(
        [*base, "run_id=E"], cwd=REPO, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    _wait_rows(run_dir / "metrics.jsonl", 15, proc, timeout=1800)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=1800) == EXIT_SIGINT, log.read_text()[-3000:]
    proc = subprocess.run(
        [*base, "run_id=E", "trainer.resume=true"], cwd=REPO, env=_env(), capture_output=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = _rows(run_dir)
    assert resumed == _rows(tmp_path / "mnist_autoencoder" / "F")
    assert resumed[15]["epoch"] == pytest.approx(15 * 256 / 50000)
    assert "max_steps: 30" in (run_dir / "config.yaml").read_text()


def test_a_full_disk_at_the_final_checkpoint(tmp_path):
    """RLIMIT_FSIZE: files may not grow past 16 KB, so the records fit and the ~40 KB checkpoint
    does not (torch's write error). Every step and the summary are kept; no partial file."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16_000, 16_000))

    extra = ["optimizer=adam", "run_id=d", "trainer.max_steps=6"]
    proc = subprocess.run(
        _cmd(tmp_path, extra),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        preexec_fn=limit,
        timeout=900,
    )
    run_dir = tmp_path / "t" / "d"
    assert proc.returncode == EXIT_COMPLETED, proc.stderr[-3000:]
    saved = _summary(run_dir)
    assert saved["status"] == "completed" and saved["steps"] == 6 and saved["checkpoint_step"] is None
    assert "could not write the checkpoint" in saved["checkpoint_error"]
    assert not (run_dir / "checkpoint.tmp").exists() and not (run_dir / "checkpoint.pt").exists()
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(7))


def test_two_processes_on_one_run_id(tmp_path):
    """The second run used to run too (both said completed; only the second's records remained)."""
    extra = ["optimizer=adam", "run_id=same", "trainer.max_steps=1000000", "trainer.eval_every=1000"]
    run_dir = tmp_path / "t" / "same"
    log = tmp_path / "a.log"
    first = _start(_cmd(tmp_path, extra), log)
    _wait_rows(run_dir / "metrics.jsonl", 3, first)
    second = subprocess.run(
        _cmd(tmp_path, extra), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert second.returncode == EXIT_BAD_INPUT
    assert f"in use by process {first.pid}" in second.stdout + second.stderr
    assert first.poll() is None  # the first run was alive all along, and keeps going
    time.sleep(1)
    first.send_signal(signal.SIGTERM)
    code, out = _finish(first, log)
    assert code == EXIT_SIGTERM, out[-3000:]
    saved = _summary(run_dir)
    assert saved["status"] == "interrupted" and saved["checkpoint_step"] == saved["steps"]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(saved["steps"] + 1))


def test_one_ctrl_c_stops_a_sweep(tmp_path):
    """A multirun used to need three Ctrl-Cs and still exit 0."""
    base = _cmd(tmp_path, ["trainer.max_steps=1000000", "trainer.eval_every=1000"])
    cmd = [*base[:2], "-m", *base[2:], "optimizer=adam,heavy_ball,sgd"]
    log = tmp_path / "sweep.log"
    proc = _start(cmd, log)
    end = time.monotonic() + 600
    while not list((tmp_path / "t").glob("*/metrics.jsonl")):
        assert proc.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    code, out = _finish(proc, log)
    assert code == EXIT_SIGINT, out[-3000:]
    runs = list((tmp_path / "t").iterdir())
    assert len(runs) == 1 and _summary(runs[0])["status"] == "interrupted"


def test_exit_code_of_a_diverged_run(tmp_path):
    extra = [
        "dataset=synthetic_images",
        "model=tiny_autoencoder",
        "model.output_activation=null",
        "model.activation=tanh",
        "model.code_activation=null",
        "optimizer=sgd",
        "optimizer.lr=50",
        "trainer.max_steps=200",
        "run_id=boom",
    ]
    proc = subprocess.run(
        _cmd(tmp_path, extra), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-3000:]
    assert _summary(tmp_path / "t" / "boom")["status"] == "diverged"
