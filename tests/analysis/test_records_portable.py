"""No tracked run record under results/ names an absolute folder of the machine that wrote it."""

from __future__ import annotations

from pathlib import Path

import pytest

from curvopt.analysis.portable import ABSOLUTE_PATH, tracked_records

ROOT = Path(__file__).resolve().parents[2]


def test_tracked_records_hold_no_absolute_machine_path(monkeypatch):
    monkeypatch.chdir(ROOT)
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no tracked records to check")
    found = []
    for path in tracked_records(Path("results")):
        if path.exists():
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                match = ABSOLUTE_PATH.search(line)
                if match:
                    found.append(f"{path}:{number}: {line[max(0, match.start() - 40) : match.end() + 40]}")
    assert not found, (
        f"{len(found)} record line(s) name an absolute machine folder; the writers store paths relative "
        "to $CURVOPT_DATA_DIR and the repository (`python -m experiments.portable results` rewrites "
        "old records):\n" + "\n".join(found[:20])
    )


def test_the_check_sees_the_folders_records_used_to_hold():
    for text in ("data_dir: /work/shared/data", 'File \\"/root/.cache/x\\"', "--work-dir /tmp/gpu_slice/x"):
        assert ABSOLUTE_PATH.search(text), text
    for text in ("data_dir: $CURVOPT_DATA_DIR", "results/fosi_ae/x", "a/tmp/b", "$TMPDIR/gpu_slice"):
        assert not ABSOLUTE_PATH.search(text), text
