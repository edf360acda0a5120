"""`SCALE=paper` lists the runs it will start with an estimate from the records and asks first;
a dry run says "would run", never "[ran]"."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from experiments import runs


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(runs, "_confirmed", False)
    monkeypatch.delenv("YES", raising=False)
    started: list[list[str]] = []
    monkeypatch.setattr(runs, "run_train", lambda cmd, env=None: started.append(list(cmd)) or 0)
    return started


def _record(root: Path, experiment: str, run_id: str, optimizer: str, profile: str, wall: float) -> None:
    run = root / experiment / run_id
    run.mkdir(parents=True)
    summary = {"status": "completed", "run_id": run_id, "optimizer": optimizer, "profile": profile,
               "wall_time_s": wall, "algo_time_s": wall * 0.8, "device": "cpu", "device_name": "cpu"}  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "algo_time_s": 0.0}) + "\n")


def test_dry_run_says_would_run_and_starts_nothing(tmp_path, capsys, _fresh):
    runs.main(
        [
            "--experiment",
            "e",
            "--optimizers",
            "adam",
            "--seeds",
            "0",
            "--results-dir",
            str(tmp_path),
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert "[would run]" in out and "[ran]" not in out and "nothing was started" in out
    assert _fresh == []


def test_paper_runs_are_listed_with_an_estimate_and_not_started_unconfirmed(
    tmp_path, capsys, monkeypatch, _fresh
):
    _record(tmp_path, "e", "adam_paper_s0", "adam", "paper", 7200.0)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # no terminal to ask on
    with pytest.raises(SystemExit) as stop:
        runs.main(["--experiment", "e", "--optimizers", "adam", "--seeds", "0", "1", "2", "--profile", "paper",
                   "--results-dir", str(tmp_path)])  # fmt: skip
    assert stop.value.code == 2 and _fresh == []
    out = capsys.readouterr().out
    assert "2 paper-profile run(s) to start" in out
    assert "e/adam_paper_s1: ~2.0 h wall, 1.6 h algorithm time on cpu (median of 1 committed run)" in out
    assert "in all ~4.0 h wall" in out and "YES=1" in out


@pytest.mark.parametrize("how", ["flag", "env"])
def test_yes_starts_them_without_asking(tmp_path, capsys, monkeypatch, _fresh, how):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    argv = [
        "--experiment",
        "e",
        "--optimizers",
        "adam",
        "--seeds",
        "0",
        "--profile",
        "paper",
        "--results-dir",
        str(tmp_path),
    ]
    if how == "flag":
        argv.append("--yes")
    else:
        monkeypatch.setenv("YES", "1")
    runs.main(argv)
    assert len(_fresh) == 1 and "[ran]" in capsys.readouterr().out


def test_quick_runs_do_not_ask(tmp_path, monkeypatch, _fresh):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    runs.main(["--experiment", "e", "--optimizers", "adam", "--seeds", "0", "--results-dir", str(tmp_path)])
    assert len(_fresh) == 1


def test_a_driver_calling_ensure_run_asks_too(tmp_path, monkeypatch, _fresh):
    """fosi_tasks / fgn / alice drivers start runs through ensure_run: the same question."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    with pytest.raises(SystemExit):
        runs.ensure_run("e", "adam", 0, "paper", results_dir=tmp_path)
    assert _fresh == []


def test_estimate_falls_back_to_a_sibling_experiment(tmp_path):
    _record(tmp_path, "shf_fig2_usps", "hf_cg_paper_s0", "hf_cg", "paper", 1800.0)
    text = runs.estimate(tmp_path, "shf_fig2_mnist", "hf_cg", "paper")
    assert text.startswith("~30 min wall") and "of shf_fig2_usps" in text
    assert "no committed paper-profile record of sgd" in runs.estimate(
        tmp_path, "shf_fig2_mnist", "sgd", "paper"
    )
