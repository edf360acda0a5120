"""Checkpoints and data files are data, not code (docs/resume.md, "Checkpoints are data").

A run folder handed over (a pulled commit, an unpacked GPU slice) controls both ``checkpoint.pt``
and its ``.sha256``: a pickled object added to the checkpoint, with the checksum rewritten, must not
run on resume. Each payload here would create a marker file when unpickled in full (checked at the
end of each test, so the payload is real); the resume, the CIFAR-10 reader and the converter's
refusal must leave no marker. Also: what the loop writes loads weights-only; a checkpoint of the
earlier format is refused with the convert command, which converts it so that the run continues
exactly. Fast (tiny synthetic runs, in-process, one ``src/train.py`` process).
"""

from __future__ import annotations

import os
import pickle
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from curvopt.errors import EXIT_BAD_INPUT, CorruptCheckpointError, CorruptDataError
from curvopt.training import checkpoint as ck
from curvopt.training.build import run_from_config
from curvopt.training.loop import comparable_rows
from curvopt.training.records import read_metrics
from curvopt.training.rundir import CommandLine
from tests.conftest import TINY_RUN, compose

TINY = [*TINY_RUN, "experiment_name=t"]
GROUPS = ("dataset", "model", "optimizer", "trainer", "logger", "paths", "experiment")
REPO = Path(__file__).resolve().parents[2]


class _System:
    """Unpickled in full, runs ``touch <marker>`` through ``os.system`` (the issue's attack)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


class _Exec:
    """Unpickled in full, creates the marker through ``exec`` (a builtin, not a module function)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


PAYLOADS = {"os.system": _System, "exec": _Exec}


def _run(results: Path, extra: list[str]) -> dict:
    """One tiny run; ``extra`` is also its command line (so a resume knows what was typed)."""
    return run_from_config(
        compose([*TINY, f"paths.results_dir={results}", *extra]), CommandLine.parse(extra, GROUPS)
    )


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its content (what a refused resume must leave alone)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _rewrite(ckpt: Path, state: dict, protocol: int = 2) -> None:
    """Save ``state`` as ``ckpt`` and make its ``.sha256`` match (what whoever hands it over can do)."""
    torch.save(state, ckpt, pickle_protocol=protocol)
    ck.write_checksum(ckpt, ck.file_sha256(ckpt))
    assert ck.verify_checkpoint(ckpt)


def _paused(results: Path, run_id: str) -> Path:
    """A 6-step Adam run paused at step 3 (checkpoint, no extra evaluation); its checkpoint."""
    _run(results, ["optimizer=adam", f"run_id={run_id}", "trainer.max_steps=6", "trainer.pause_at_step=3"])
    return results / "t" / run_id / ck.CHECKPOINT_NAME


def test_the_loop_writes_checkpoints_that_load_weights_only(tmp_path):
    ckpt = _paused(tmp_path, "w")
    assert ck._pickled_globals(ckpt) == []  # nothing but what torch allows by default
    state = torch.load(ckpt, weights_only=True)
    numpy_state = state["rng"]["numpy"]
    assert isinstance(numpy_state, dict) and len(numpy_state["keys"]) == 624
    assert isinstance(state["config_yaml"], str)
    np.random.seed(5)
    expected = np.random.rand(3)
    np.random.seed(5)
    saved = ck.rng_state()
    np.random.rand(7)
    ck.set_rng_state(saved)
    assert np.array_equal(np.random.rand(3), expected)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_a_payload_checkpoint_runs_nothing_on_resume(tmp_path, payload, protocol):
    results, marker = tmp_path / "results", tmp_path / "marker"
    ckpt = _paused(results, "p")
    state = torch.load(ckpt, weights_only=True)
    state["algorithm"]["extra"] = PAYLOADS[payload](marker)
    _rewrite(ckpt, state, protocol)
    before = _tree(results)
    with pytest.raises(ck.UnsafeCheckpointError, match="it was not loaded") as info:
        _run(results, ["optimizer=adam", "run_id=p", "trainer.resume=true"])
    assert not marker.exists()
    message = str(info.value)
    assert str(ckpt) in message and "\n" not in message
    assert f"python -m curvopt.training.checkpoint convert {ckpt} --trust" in message
    assert isinstance(info.value, CorruptCheckpointError)  # a BadInputError: src/train.py exits 2
    with pytest.raises(ck.UnsafeCheckpointError):  # the loop's own reader refuses it as well
        ck.read_checkpoint(ckpt, torch.device("cpu"))
    assert not marker.exists() and _tree(results) == before
    torch.load(ckpt, weights_only=False)  # what every resume did before: the payload runs
    assert marker.exists()


def test_train_py_refuses_a_payload_checkpoint_with_exit_2(tmp_path):
    results, marker = tmp_path / "results", tmp_path / "marker"
    ckpt = _paused(results, "x")
    state = torch.load(ckpt, weights_only=True)
    state["extra"] = _System(marker)
    _rewrite(ckpt, state)
    proc = subprocess.run(
        [sys.executable, "src/train.py", *TINY, f"paths.results_dir={results}", "optimizer=adam", "run_id=x"]
        + ["trainer.resume=true"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_BAD_INPUT, out[-2000:]
    assert not marker.exists() and "Traceback" not in out
    lines = [line for line in out.splitlines() if "it was not loaded" in line]
    assert len(lines) == 1 and str(ckpt) in lines[0] and "posix.system" in lines[0]
    assert "convert" in lines[0] and "--trust" in lines[0]


def _as_earlier_version(ckpt: Path) -> None:
    """Rewrite a checkpoint as the earlier format held it: numpy's RNG state as a pickled array."""
    state = torch.load(ckpt, weights_only=True)
    plain = state["rng"]["numpy"]
    keys = np.asarray(plain["keys"], dtype=np.uint32)
    state["rng"]["numpy"] = (
        plain["bit_generator"],
        keys,
        plain["pos"],
        plain["has_gauss"],
        plain["cached_gaussian"],
    )
    _rewrite(ckpt, state)


def test_an_earlier_checkpoint_is_refused_then_converted_and_resumes_exactly(tmp_path, capsys):
    full = _run(tmp_path, ["optimizer=adam", "run_id=full", "trainer.max_steps=6"])
    ckpt = _paused(tmp_path, "old")
    _as_earlier_version(ckpt)
    before = _tree(tmp_path / "t" / "old")
    resume = ["optimizer=adam", "run_id=old", "trainer.resume=true"]
    with pytest.raises(ck.UnsafeCheckpointError, match="written by an earlier curvopt") as info:
        _run(tmp_path, resume)
    assert "numpy" in str(info.value) and "\n" not in str(info.value)
    assert f"python -m curvopt.training.checkpoint convert {ckpt} --trust" in str(info.value)
    assert _tree(tmp_path / "t" / "old") == before

    assert ck.main(["convert", str(ckpt.parent)]) == EXIT_BAD_INPUT  # no --trust: nothing read
    assert "--trust" in capsys.readouterr().err and _tree(tmp_path / "t" / "old") == before
    assert ck.main(["convert", str(ckpt.parent), "--trust"]) == 0
    assert "converted (rng.numpy" in capsys.readouterr().out
    assert ck._pickled_globals(ckpt) == [] and ck.verify_checkpoint(ckpt)  # new .sha256
    assert ck.main(["convert", str(ckpt), "--trust"]) == 0
    assert "already loads weights-only; unchanged" in capsys.readouterr().out

    resumed = _run(tmp_path, resume)
    assert resumed["status"] == "completed" and resumed["steps"] == 6
    rows = comparable_rows(read_metrics(Path(resumed["run_dir"]) / "metrics.jsonl"))
    assert rows == comparable_rows(read_metrics(Path(full["run_dir"]) / "metrics.jsonl"))


def test_convert_refuses_a_file_changed_after_its_checksum(tmp_path, capsys):
    marker = tmp_path / "marker"
    ckpt = _paused(tmp_path, "c")
    state = torch.load(ckpt, weights_only=True)
    state["extra"] = _System(marker)
    torch.save(state, ckpt)  # the .sha256 still describes the file the run wrote
    assert ck.main(["convert", str(ckpt), "--trust"]) == EXIT_BAD_INPUT
    assert "does not match its checksum" in capsys.readouterr().err and not marker.exists()


def test_a_write_of_a_python_object_fails_before_the_file_changes(tmp_path):
    ckpt = _paused(tmp_path, "n")
    before = ckpt.read_bytes()
    with pytest.raises(TypeError, match=r"numpy\..*weights_only=True"):
        ck.write_checkpoint(ckpt, {"step": 1, "x": np.zeros(3)}, 1)
    assert ckpt.read_bytes() == before and not ckpt.with_suffix(".tmp").exists()


def test_the_projector_objects_of_the_official_baselines_load_by_name(tmp_path):
    from curvopt.optim import lowrank

    if not lowrank.official_available("galore"):
        pytest.skip("galore-torch is not installed")
    (cls,) = [c for c in lowrank.state_globals("galore") if c.__name__ == "GaLoreProjector"]
    projector = cls.__new__(cls)
    projector.ortho_matrix = torch.ones(2, 2)
    path = tmp_path / "state.pt"
    torch.save({"state": {0: {"projector": projector}}}, path)
    loaded = ck.load_weights_only(path)["state"][0]["projector"]
    assert type(loaded) is cls and torch.equal(loaded.ortho_matrix, torch.ones(2, 2))


# -- the CIFAR-10 python batches -------------------------------------------------------------------
def _batch(n: int = 4, **extra) -> dict:
    rng = np.random.default_rng(n)
    return {
        "batch_label": "training batch",
        "labels": [int(v) for v in rng.integers(0, 10, n)],
        "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        "filenames": [f"img_{i}.png" for i in range(n)],
        **extra,
    }


@pytest.mark.parametrize("protocol", [2, 5])
def test_a_cifar_batch_loads_through_the_restricted_reader(tmp_path, protocol):
    from curvopt.data.cifar10 import read_python_batch

    batch = _batch()
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps(batch, protocol=protocol))
    read = read_python_batch(path)
    assert np.array_equal(read["data"], batch["data"]) and read["labels"] == batch["labels"]


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_a_payload_cifar_batch_runs_nothing(tmp_path, payload):
    from curvopt.data.cifar10 import TEST_BATCHES, TRAIN_BATCHES, read_cifar10

    folder, marker = tmp_path / "data" / "cifar-10-batches-py", tmp_path / "marker"
    folder.mkdir(parents=True)
    for name in TRAIN_BATCHES + TEST_BATCHES:
        (folder / name).write_bytes(pickle.dumps(_batch(), protocol=2))
    bad = folder / "data_batch_2"
    bad.write_bytes(pickle.dumps(_batch(extra=PAYLOADS[payload](marker)), protocol=2))
    with pytest.raises(CorruptDataError, match="which the format never holds") as info:
        read_cifar10(tmp_path / "data", "train", allow_download=False)
    assert str(bad) in str(info.value) and not marker.exists()
    with bad.open("rb") as fh:
        pickle.load(fh, encoding="latin1")  # what the reader did before: the payload runs
    assert marker.exists()


def test_a_cifar_batch_with_an_object_array_is_refused(tmp_path):
    from curvopt.data.cifar10 import read_python_batch

    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps(_batch(data=np.zeros((4, 3072), dtype=object)), protocol=2))
    with pytest.raises(CorruptDataError, match="dtype object"):
        read_python_batch(path)
    path.write_bytes(pickle.dumps(_batch(data=np.zeros((4, 3072), dtype=np.float32)), protocol=2))
    with pytest.raises(CorruptDataError, match=r"uint8 \[N, 3072\]"):
        read_python_batch(path)
