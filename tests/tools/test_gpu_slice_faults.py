"""tools/gpu/ (the slice tool) against bad input (issue 43): a stale output over a run that went further, a
manifest naming a slice outside the queue, a truncated manifest, the same output unpacked twice, and
GPU_SLICE_TMP pointing at a folder of one's own."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = "results/gpu_selftest/default/adam_quick_s0_long"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="bash, POSIX paths")


@pytest.fixture(scope="module")
def gs():
    """The slice tool's modules (tools/gpu/), one per step: gs.slices, gs.carry, gs.run, gs.pack,
    gs.unpack, gs.ledger; gs.common, gs.cli."""
    from tools import gpu
    from tools.gpu import cli  # noqa: F401 - imports every module of the slice's path

    return gpu


def run_files(steps: int, status: str = "interrupted") -> dict[str, bytes]:
    rows = "".join(json.dumps({"step": s, "train/loss": 1.0 / (s + 1)}) + "\n" for s in range(steps + 1))
    summary = {"status": status, "steps": steps, "checkpoint_step": steps}
    return {
        "metrics.jsonl": rows.encode(),
        "summary.json": json.dumps(summary).encode(),
        "config.yaml": b"seed: 0\n",
    }


def make_output(
    gs, where: Path, steps: int, slice_id: str = "cpu-test", stamp: str = "20260101T000000Z"
) -> Path:
    """A slice's $OUT as `python -m tools.gpu run` packs it: one interrupted run at ``steps``, its checkpoint."""
    src, out = where / "src", where / "out"
    out.mkdir(parents=True)
    items = []
    for name, data in run_files(steps).items():
        (src / RUN).mkdir(parents=True, exist_ok=True)
        (src / RUN / name).write_bytes(data)
        items.append((src / RUN / name, f"{RUN}/{name}"))
    report = src / "results" / "gpu_slices" / "cpu-test" / "report.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("report\n")
    items.append((report, "results/gpu_slices/cpu-test/report.md"))
    members = gs.pack._tar(items, out / "results.tar.gz", compress=True)
    ck = f"checkpoint of step {steps}".encode()
    (src / "ck.pt.gz").write_bytes(gzip.compress(ck))
    ck_members = gs.pack._tar(
        [(src / "ck.pt.gz", f"{RUN}/checkpoint.pt.gz")], out / "checkpoints.tar", compress=False
    )
    ck_members[f"{RUN}/checkpoint.pt.gz"].update(raw_sha256=hashlib.sha256(ck).hexdigest(), raw_bytes=len(ck))
    (out / "slice.log").write_text("log\n")
    man = {
        "format": 1,
        "slice": slice_id,
        "stamp": stamp,
        "status": "partial",
        "ended": "2026-01-01T00:10:00Z",
        "elapsed_s": 60,
        "device": {"device_name": "H200", "torch": "2.x", "cuda": "12"},
        "runs": [{"id": "tiny-long", "kind": "train", "status": "interrupted", "steps": steps}],
        "archives": {
            "results": {"members": members, "parts": ["results.tar.gz"]},
            "checkpoints": {"members": ck_members, "parts": ["checkpoints.tar"]},
        },
    }
    man["files"] = {
        f.name: {"sha256": gs.common.sha256_file(f), "bytes": f.stat().st_size}
        for f in sorted(out.iterdir())
        if f.name != "manifest.json"
    }
    (out / "manifest.json").write_text(json.dumps(man, indent=2))
    return out


def unpack(gs, out: Path, repo: Path) -> int:
    return gs.cli.main(
        ["--ledger", str(repo / "ledger.md"), "unpack", str(out), "--root", str(repo), "--no-after"]
    )


def test_an_older_output_does_not_roll_back_a_run_that_went_further(gs, tmp_path, capsys):
    """Before: unpacking a slice output after its run went further here put metrics, summary and
    checkpoint back to where the slice left them (400 steps lost). Now the run's files stay as they
    are; the output's copy of the run is set aside under the slice's logs folder, and it says so."""
    repo = tmp_path / "repo"
    old = make_output(gs, tmp_path / "old", steps=100)
    new = make_output(gs, tmp_path / "new", steps=500, stamp="20260102T000000Z")
    assert unpack(gs, new, repo) == 0
    run = repo / RUN
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    assert before["checkpoint.pt"] == b"checkpoint of step 500"
    assert unpack(gs, old, repo) == 0
    err = capsys.readouterr().err
    assert f"{RUN}: the output stops at step 100, the run here is at step 500" in err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # nothing rolled back
    aside = repo / "outputs" / "gpu_slices" / "cpu-test" / "20260101T000000Z" / "stale" / RUN
    assert (aside / "checkpoint.pt").read_bytes() == b"checkpoint of step 100"  # nothing lost either
    assert json.loads((aside / "summary.json").read_text())["steps"] == 100


def test_the_same_output_unpacked_twice_writes_one_ledger_row(gs, tmp_path, capsys):
    repo = tmp_path / "repo"
    out = make_output(gs, tmp_path / "a", steps=100)
    assert unpack(gs, out, repo) == 0
    assert unpack(gs, out, repo) == 0
    assert len(gs.ledger.read_ledger(repo / "ledger.md")) == 1
    assert "already (unpacked before): no new row" in capsys.readouterr().out


@pytest.mark.parametrize("slice_id", ["../../../escaped", "/tmp/h43_abs_slice", "no-such-slice", 7])
def test_a_manifest_naming_a_slice_outside_the_queue_is_refused(gs, tmp_path, capsys, slice_id):
    """Before: the manifest's `slice` named the logs folder as it was: `..` or an absolute path made
    gpu-unpack write its logs and manifest outside the repository."""
    repo = tmp_path / "deep" / "er" / "repo"
    out = make_output(gs, tmp_path / "a", steps=100, slice_id=slice_id)
    assert unpack(gs, out, repo) == 2
    assert "is not a slice of gpu_queue.yaml" in capsys.readouterr().err
    assert not repo.exists() and not (tmp_path / "escaped").exists()
    assert not Path("/tmp/h43_abs_slice").exists()


def test_a_stamp_with_a_path_is_refused(gs, tmp_path, capsys):
    repo = tmp_path / "repo"
    out = make_output(gs, tmp_path / "a", steps=100, stamp="../../../../x")
    assert unpack(gs, out, repo) == 2
    assert "not a time stamp" in capsys.readouterr().err and not repo.exists()


def test_a_truncated_manifest_is_named(gs, tmp_path, capsys):
    repo = tmp_path / "repo"
    out = make_output(gs, tmp_path / "a", steps=100)
    text = (out / "manifest.json").read_text()
    (out / "manifest.json").write_text(text[: len(text) // 2])
    assert unpack(gs, out, repo) == 2
    err = capsys.readouterr().err
    assert "manifest.json is not valid JSON" in err and "Traceback" not in err and not repo.exists()
    (out / "manifest.json").write_text(json.dumps({"slice": "cpu-test", "files": {"x": {}}}))
    assert unpack(gs, out, repo) == 2
    assert "is not a slice manifest" in capsys.readouterr().err


def _slice(tmp_path: Path, work: Path, item: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        "GPU_SLICE_TMP": str(work),
        "GPU_SLICE_RESULTS": str(tmp_path / "results"),
        "GPU_SLICE_CARRY": str(tmp_path / "no_carry"),
        "GPU_SLICE_LEDGER": str(tmp_path / "ledger.md"),
    }
    return subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_slice.sh"), item],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("item", ["no-such-slice", "cpu-test"])
def test_gpu_slice_tmp_pointing_at_a_folder_of_ones_own_keeps_its_contents(tmp_path, item):
    """Before: the slice deleted GPU_SLICE_TMP whatever it held, even for an unknown ITEM."""
    mine = tmp_path / "my_thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("precious\n")
    res = _slice(tmp_path, mine, item)
    assert res.returncode == 2, res.stdout + res.stderr
    assert (mine / "chapter1.tex").read_text() == "precious\n"
    assert ("no slice 'no-such-slice'" if item == "no-such-slice" else "did not create") in res.stderr
    assert "Traceback" not in res.stderr


def test_the_slice_reuses_only_its_own_work_folder(gs, tmp_path):
    work = tmp_path / "work"
    gs.run.prepare_work(work)
    (work / "site").mkdir()
    (work / "slice.log").write_text("old\n")
    gs.run.prepare_work(work)  # its own: emptied
    assert sorted(p.name for p in work.iterdir()) == [gs.run.WORK_MARK]
    empty = tmp_path / "empty"
    empty.mkdir()
    gs.run.prepare_work(empty)  # an empty folder of one's own is used
    (tmp_path / "file").write_text("x")
    with pytest.raises(gs.common.Refused, match="is not a folder"):
        gs.run.prepare_work(tmp_path / "file")


def test_a_manifest_listing_a_path_as_a_file_is_refused(gs, tmp_path, capsys):
    repo = tmp_path / "repo"
    out = make_output(gs, tmp_path / "a", steps=100)
    man = json.loads((out / "manifest.json").read_text())
    man["files"]["../../etc/passwd"] = {"sha256": "0" * 64, "bytes": 1}
    (out / "manifest.json").write_text(json.dumps(man))
    assert unpack(gs, out, repo) == 2
    assert "not a file name of a slice output" in capsys.readouterr().err and not repo.exists()
