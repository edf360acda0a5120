"""The progress bar counts the budget that stops the run; wandb keeps quiet on the terminal."""

from __future__ import annotations

import io

import pytest

from curvopt.training.loop import BudgetProgress, binding_budget
from curvopt.training.schema import TrainerConfig
from curvopt.training.tracking import wandb_silent_default


def test_time_budget_is_the_bar_total_when_steps_are_far_off():
    # the quick profile: max_steps=100000 never binds, 150 algorithm seconds do
    cfg = TrainerConfig(max_steps=100000, max_algo_time_s=150.0)
    assert binding_budget(cfg, 0, 0.0, 0.0) == ("algo-s", 0.0, 150.0)
    assert binding_budget(cfg, 10, 0.1, 31.0) == ("algo-s", 31.0, 150.0)


def test_steps_bind_when_they_run_out_first():
    cfg = TrainerConfig(max_steps=20, max_algo_time_s=150.0)
    assert binding_budget(cfg, 10, 0.1, 3.0) == ("step", 10.0, 20.0)


def test_epochs_and_steps_without_a_time_budget():
    assert binding_budget(TrainerConfig(max_steps=500), 7, 0.5, 9.0) == ("step", 7.0, 500.0)
    cfg = TrainerConfig(max_steps=10**6, max_epochs=2.0)
    assert binding_budget(cfg, 300, 0.5, 9.0) == ("epoch", 0.5, 2.0)


def _bar(cfg: TrainerConfig) -> tuple[BudgetProgress, io.StringIO]:
    out = io.StringIO()
    progress = BudgetProgress(cfg, "run", file=out, disable=False)  # as on a terminal
    return progress, out


def test_bar_counts_algorithm_seconds_and_shows_the_step():
    progress, out = _bar(TrainerConfig(max_steps=100000, max_algo_time_s=150.0))
    progress.update(10, 0.1, 31.0, loss=1.25)
    text = str(progress.bar)
    assert "31.0/150 algo-s" in text and "step=10/100000" in text and "loss=1.25" in text
    assert "100000/" not in text  # not the step budget that never binds
    progress.update(40, 0.4, 150.2)
    assert progress.bar.n == pytest.approx(150.0)  # full when the run stops, never past it
    progress.close()


def test_bar_switches_to_the_budget_that_binds():
    progress, _ = _bar(TrainerConfig(max_steps=20, max_algo_time_s=150.0))
    assert progress.unit == "algo-s"
    progress.update(15, 0.1, 10.0)
    assert (progress.unit, progress.bar.total, progress.bar.n) == ("step", 20.0, 15.0)
    progress.close()


@pytest.mark.parametrize(
    ("value", "silent"), [(None, True), ("true", True), ("false", False), ("0", False), ("1", True)]
)
def test_wandb_is_silent_unless_asked(monkeypatch, value, silent):
    if value is None:
        monkeypatch.delenv("WANDB_SILENT", raising=False)
    else:
        monkeypatch.setenv("WANDB_SILENT", value)
    assert wandb_silent_default() is silent


def test_a_resumed_run_starts_the_bar_where_it_stopped():
    out = io.StringIO()
    cfg = TrainerConfig(max_steps=100000, max_algo_time_s=150.0)
    progress = BudgetProgress(cfg, "run", file=out, disable=False, start=(40, 0.4, 100.0))
    assert progress.bar.n == pytest.approx(100.0) and progress.bar.initial == pytest.approx(100.0)
    progress.update(42, 0.42, 105.0)
    assert progress.bar.n == pytest.approx(105.0)
    progress.close()
