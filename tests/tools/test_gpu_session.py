"""tools/gpu/session.sh, the GPU checklist script: its CPU-checkable parts (refusals, the run
queue of the background MNIST runs, the pack of what a session wrote)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu" / "session.sh"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="bash script")


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {
        **os.environ,
        "GPU_SESSION_DIR": str(tmp_path / "session"),
        "GPU_SESSION_RESULTS": str(tmp_path / "results"),
        "PYTHON": sys.executable,
        **env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, cwd=ROOT, timeout=120
    )


def test_refuses_without_cuda_and_on_unknown_stages(tmp_path):
    res = _run(tmp_path)
    assert res.returncode == 2 and "smoke" in res.stdout  # usage
    res = _run(tmp_path, "nonsense")
    assert res.returncode == 2 and "unknown stage 'nonsense'" in res.stderr
    import torch

    if not torch.cuda.is_available():
        res = _run(tmp_path, "bench")
        assert res.returncode == 2 and "no CUDA device is visible" in res.stderr


def test_background_queue_runs_every_method_and_seed_once(tmp_path):
    fake = tmp_path / "fakepy"
    fake.write_text(
        "#!/bin/bash\n"
        f'if [ "$1" = "-c" ]; then exec {sys.executable} "$@"; fi\n'
        'echo "$@" >> "$(dirname "$0")/calls"; sleep 0.5; echo completed\n'
    )
    fake.chmod(0o755)
    res = _run(
        tmp_path, "shf-start", "0", "3", PYTHON=str(fake), GPU_SESSION_SKIP_CUDA_CHECK="1", SHF_JOBS="2"
    )
    assert res.returncode == 0, res.stderr
    ledger = tmp_path / "results" / "gpu_smoke" / "cuda" / "gpu_session.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline:
        events = [json.loads(x) for x in ledger.read_text().splitlines()] if ledger.exists() else []
        if sum(e["event"] == "run-end" for e in events) == 4:
            break
        time.sleep(0.5)
    calls = sorted((tmp_path / "calls").read_text().splitlines())
    assert len(calls) == 4, calls
    for opt in ("shf_lsmr", "hf_cg"):
        for seed in ("0", "3"):
            assert any(f"--optimizers {opt} --seeds {seed} trainer.device=cuda" in c for c in calls), (
                opt,
                seed,
            )
    assert all("--experiment shf_fig2_mnist --profile paper" in c for c in calls)
    starts = [e for e in events if e["event"] == "run-start"]
    assert len(starts) == 4 and {e["detail"].split("worker ")[1] for e in starts} <= {"1", "2"}
    status = _run(tmp_path, "status")
    assert status.stdout.count("completed") == 4


def test_pack_takes_what_the_session_wrote_and_no_checkpoints(tmp_path):
    old = tmp_path / "results" / "exp" / "old" / "metrics.jsonl"
    old.parent.mkdir(parents=True)
    old.write_text("{}\n")
    past = time.time() - 3600
    os.utime(old, (past, past))
    assert _run(tmp_path, "status").returncode == 0  # the first call stamps the session's start
    new = tmp_path / "results" / "exp" / "new"
    new.mkdir(parents=True)
    (new / "metrics.jsonl").write_text("{}\n")
    (new / "checkpoint.pt").write_bytes(b"x")
    res = _run(tmp_path, "pack", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    with tarfile.open(tmp_path / "out" / "results.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("exp/new/metrics.jsonl") for n in names), names
    assert not any(n.endswith("checkpoint.pt") or n.endswith("old/metrics.jsonl") for n in names), names
