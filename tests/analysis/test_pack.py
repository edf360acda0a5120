"""The packed record layout (curvopt.analysis.pack): the readers return the same frames from one
directory per run and from ``metrics.parquet`` + ``runs.jsonl``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from curvopt.analysis import pack
from curvopt.analysis.records import load_runs, load_summaries, read_run_metrics
from curvopt.training.records import packed_run_ids
from experiments import pack as pack_cli
from experiments.fosi_quadratics import figures as figs


def write_run(exp: Path, run_id: str, rows: list[dict], summary: dict | None, config: dict) -> Path:
    run = exp / run_id
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def make_experiment(root: Path) -> Path:
    exp = root / "exp"
    for i, (opt, status) in enumerate([("adam", "completed"), ("sgd", "diverged"), ("fosi", "completed")]):
        rows = []
        for step in range(5):
            row: dict = {"step": step, "train/loss": 1.0 / (step + 1) + i, "epoch": step // 2}
            if status == "diverged" and step >= 3:
                row["train/loss"] = "nan" if step == 3 else "inf"
            if step % 2 == 0:
                row["val/acc"] = 0.5 + 0.1 * step  # logged on some rows only
            if opt == "fosi":
                row["phase"] = "ese" if step == 0 else "step"  # a column the other runs lack
                row["eigs"] = [1.0, 2.0 + step]  # a list value
            rows.append(row)
        config = {"seed": i, "profile": "quick", "optimizer": {"name": opt, "lr": 0.1 * (i + 1)}}
        summary = {"status": status, "device": "cpu", "best": {"metrics": {"val/acc": 0.9 - i / 10}}}
        write_run(exp, f"{opt}_s{i}", rows, summary, config)
    # a run still going (no summary) and a run moved aside stay as they are
    write_run(exp, "hb_s9", [{"step": 0, "train/loss": 3.0}], None, {"seed": 9, "optimizer": {"name": "hb"}})
    write_run(exp, "adam_s0.completed-20260101-000000", [{"step": 0}], {"status": "completed"}, {"seed": 0})
    return exp


def normalise(frame: pd.DataFrame, root: Path) -> pd.DataFrame:
    frame = frame.copy()
    if "run_dir" in frame:
        frame["run_dir"] = frame["run_dir"].str.replace(str(root), "ROOT", regex=False)
    return frame


@pytest.fixture
def two_layouts(tmp_path: Path) -> tuple[Path, Path]:
    loose = tmp_path / "loose"
    make_experiment(loose)
    packed = tmp_path / "packed"
    shutil.copytree(loose, packed)
    res = pack.pack_experiment(packed / "exp")
    assert res.runs == 3 and res.skipped == ["hb_s9"] and res.removed_files == 9
    return loose, packed


def test_pack_leaves_two_files_and_unfinished_runs(two_layouts: tuple[Path, Path]) -> None:
    _, packed = two_layouts
    exp = packed / "exp"
    names = sorted(p.name for p in exp.iterdir())
    assert names == ["adam_s0.completed-20260101-000000", "hb_s9", "metrics.parquet", "runs.jsonl"]
    lines = (exp / "runs.jsonl").read_text().splitlines()
    assert [json.loads(x)["run_id"] for x in lines] == ["adam_s0", "fosi_s2", "sgd_s1"]
    assert pd.read_parquet(exp / "metrics.parquet")["run_id"].nunique() == 3  # pandas reads it as is


def test_large_pack_gzips_runs_jsonl(two_layouts: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A pack whose runs.jsonl text is over the threshold is written as runs.jsonl.gz (byte-stable),
    read the same, and unpacking a run rewrites it; the plain name is gone."""
    _, packed = two_layouts
    exp = packed / "exp"
    before = pack.read_packed_runs(exp)
    frame = load_runs(packed, "exp")
    monkeypatch.setattr(pack, "GZIP_RUNS_ABOVE_BYTES", 10)
    pack.unpack_run(exp / "sgd_s1")  # rewrites the pack without it: gzipped now
    assert not (exp / "runs.jsonl").exists() and packed_run_ids(exp) == {"adam_s0", "fosi_s2"}
    pack.pack_experiment(exp)
    assert not (exp / "runs.jsonl").exists() and (exp / "runs.jsonl.gz").exists()
    first = (exp / "runs.jsonl.gz").read_bytes()
    assert pack.is_packed(exp) and packed_run_ids(exp) == {"adam_s0", "fosi_s2", "sgd_s1"}
    assert pack.read_packed_runs(exp) == before
    pd.testing.assert_frame_equal(load_runs(packed, "exp"), frame, check_exact=True)
    pack.unpack_run(exp / "sgd_s1")
    pack.pack_experiment(exp)
    assert (exp / "runs.jsonl.gz").read_bytes() == first  # same runs, same bytes (gzip mtime 0)


@pytest.mark.parametrize("status", [None, "completed"])
def test_load_runs_same_frame_from_both_layouts(two_layouts: tuple[Path, Path], status: str | None) -> None:
    loose, packed = two_layouts
    a = load_runs(loose, "exp", status=status)
    b = load_runs(packed, "exp", status=status)
    assert len(a) == (15 if status is None else 10) + (1 if status is None else 0)
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert np.isnan(a.loc[a["run_id"] == "sgd_s1", "train/loss"]).sum() == 1 if status is None else True


def test_load_summaries_and_run_metrics_same_from_both_layouts(two_layouts: tuple[Path, Path]) -> None:
    loose, packed = two_layouts
    pd.testing.assert_frame_equal(
        normalise(load_summaries(loose, "exp"), loose), normalise(load_summaries(packed, "exp"), packed)
    )
    for run in ("adam_s0", "fosi_s2", "sgd_s1", "hb_s9"):
        a = read_run_metrics(loose / "exp" / run)
        b = read_run_metrics(packed / "exp" / run)
        a["train/loss"] = a["train/loss"].astype(float)  # "nan"/"inf" strings are floats in the pack
        pd.testing.assert_frame_equal(a, b, check_exact=True)


RERUN = {"seed": 1, "profile": "quick", "optimizer": {"name": "sgd", "lr": 0.2}}


def test_pack_again_folds_in_new_and_rerun_runs(two_layouts: tuple[Path, Path]) -> None:
    loose, packed = two_layouts
    exp = packed / "exp"
    (exp / "hb_s9" / "summary.json").write_text(json.dumps({"status": "completed"}))  # finished
    write_run(
        exp, "sgd_s1", [{"step": 0, "train/loss": 0.25}], {"status": "completed", "device": "cpu"}, RERUN
    )
    res = pack.pack_experiment(exp)
    assert res.runs == 4 and res.skipped == []
    runs = load_runs(packed, "exp")
    assert runs.loc[runs["run_id"] == "sgd_s1", "train/loss"].tolist() == [0.25]
    assert runs.loc[runs["run_id"] == "hb_s9", "train/loss"].tolist() == [3.0]
    before = load_runs(loose, "exp")
    keep = ~before["run_id"].isin(["sgd_s1", "hb_s9"])
    pd.testing.assert_frame_equal(
        before[keep].reset_index(drop=True),
        runs[~runs["run_id"].isin(["sgd_s1", "hb_s9"])][before.columns].reset_index(drop=True),
    )


def test_cli_packs_every_experiment_below_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_experiment(tmp_path / "a")
    make_experiment(tmp_path / "b")
    before = load_runs(tmp_path / "a", "exp")
    assert pack_cli.main([str(tmp_path / "a"), str(tmp_path / "b" / "exp")]) == 0
    assert pack.is_packed(tmp_path / "a" / "exp") and pack.is_packed(tmp_path / "b" / "exp")
    pd.testing.assert_frame_equal(before, load_runs(tmp_path / "a", "exp"))
    assert pack_cli.main([str(tmp_path / "empty")]) == 1


def test_fosi_quadratics_readers_read_the_pack(tmp_path: Path) -> None:
    for root in (tmp_path / "loose", tmp_path / "packed"):
        for name, f in (("gd", [3.0, 2.0, "nan"]), ("fosi_gd", [3.0, 1.0, 0.5])):
            rows = [{"step": t, "f": v} for t, v in enumerate(f)]
            summary = {"status": "completed", "setting": {"optimizer": name}, "f_final": f[-1]}
            write_run(root / "q2_fig4", name, rows, summary, {"optimizer": name})
    pack.pack_experiment(tmp_path / "packed" / "q2_fig4")
    a = figs.load_summaries(tmp_path / "loose", "q2_fig4")
    b = figs.load_summaries(tmp_path / "packed", "q2_fig4")
    assert [s["setting"] for s in a] == [s["setting"] for s in b]
    for sa, sb in zip(a, b):
        np.testing.assert_array_equal(figs.curve(sa), figs.curve(sb))


def test_a_parked_unfinished_run_is_read_and_left_alone(two_layouts: tuple[Path, Path]) -> None:
    """``--park`` gzips a paused run's metrics: the readers still return its rows, packing leaves
    it as it is, and parking it again is a clear error."""
    loose, packed = two_layouts
    before = read_run_metrics(packed / "exp" / "hb_s9")
    assert pack_cli.main(["--park", str(packed / "exp" / "hb_s9")]) == 0
    assert (packed / "exp" / "hb_s9" / "metrics.jsonl.gz").exists()
    assert not (packed / "exp" / "hb_s9" / "metrics.jsonl").exists()
    assert "hb_s9" in [p.name for p in pack.loose_run_dirs(packed / "exp")]
    pd.testing.assert_frame_equal(read_run_metrics(packed / "exp" / "hb_s9"), before)
    assert "hb_s9" in set(load_summaries(packed, "exp")["run_id"])  # still listed as running
    res = pack.pack_experiment(packed / "exp")
    assert res.skipped == ["hb_s9"] and (packed / "exp" / "hb_s9" / "metrics.jsonl.gz").exists()
    assert pack_cli.main(["--park", str(packed / "exp" / "hb_s9")]) == 2


def test_unpack_restores_a_run_and_leaves_the_others_packed(two_layouts: tuple[Path, Path]) -> None:
    """``--unpack`` writes a packed run's three record files back (its rows, summary and config as
    the readers saw them packed), takes it out of the pack alone, and packing again is a round trip."""
    loose, packed = two_layouts
    exp = packed / "exp"
    (exp / "fosi_s2").mkdir()
    (exp / "fosi_s2" / "checkpoint.pt").write_bytes(b"kept")  # what packing left in the directory
    before = load_runs(packed, "exp")
    assert pack_cli.main(["--unpack", str(exp / "fosi_s2"), str(exp / "sgd_s1")]) == 0
    for run in ("fosi_s2", "sgd_s1"):
        assert (loose / "exp" / run / "metrics.jsonl").exists() and (exp / run / "metrics.jsonl").exists()
        assert json.loads((exp / run / "summary.json").read_text()) == json.loads(
            (loose / "exp" / run / "summary.json").read_text()
        )
        assert yaml.safe_load((exp / run / "config.yaml").read_text()) == yaml.safe_load(
            (loose / "exp" / run / "config.yaml").read_text()
        )
    # fosi_s2 logged no non-finite value: its file is the original, byte for byte
    assert (exp / "fosi_s2" / "metrics.jsonl").read_text() == (
        loose / "exp" / "fosi_s2" / "metrics.jsonl"
    ).read_text()
    assert (exp / "fosi_s2" / "checkpoint.pt").read_bytes() == b"kept"
    assert [r["run_id"] for r in pack.read_packed_runs(exp)] == ["adam_s0"]
    assert set(pd.read_parquet(exp / "metrics.parquet")["run_id"]) == {"adam_s0"}
    assert "eigs" not in pd.read_parquet(exp / "metrics.parquet").columns  # only fosi_s2 logged it
    pd.testing.assert_frame_equal(load_runs(packed, "exp"), before, check_exact=True)
    res = pack.pack_experiment(exp)
    assert res.runs == 3
    pd.testing.assert_frame_equal(load_runs(packed, "exp"), before, check_exact=True)


def test_unpack_refuses_what_it_cannot_do(
    two_layouts: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    _, packed = two_layouts
    exp = packed / "exp"
    assert pack_cli.main(["--unpack", str(exp / "hb_s9")]) == 2  # loose, not packed
    assert "not in the pack" in capsys.readouterr().err
    write_run(exp, "adam_s0", [{"step": 0}], None, {"seed": 0})  # a new run under a packed id
    assert pack_cli.main(["--unpack", str(exp / "adam_s0")]) == 2
    assert "already holds" in capsys.readouterr().err
    assert "adam_s0" in [r["run_id"] for r in pack.read_packed_runs(exp)]  # nothing changed


def test_the_module_examples_run() -> None:
    import doctest

    result = doctest.testmod(pack)
    assert result.attempted > 0 and result.failed == 0


def test_an_interrupted_run_is_left_for_its_resume(two_layouts: tuple[Path, Path]) -> None:
    """A run stopped by a signal has a summary (status ``interrupted``) and will be resumed: packing
    it would leave its resume writing only the new rows."""
    _, packed = two_layouts
    exp = packed / "exp"
    (exp / "hb_s9" / "summary.json").write_text(json.dumps({"status": "interrupted"}))
    res = pack.pack_experiment(exp)
    assert res.skipped == ["hb_s9"] and (exp / "hb_s9" / "metrics.jsonl").exists()
    assert "hb_s9" not in [r["run_id"] for r in pack.read_packed_runs(exp)]
