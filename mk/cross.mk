##@ Cross-paper grid: every method on every paper's task (docs/cross.md)
# One Hydra multirun per task (src/train.py -m over methods x seeds x trials), equal CPU-time budget per
# task (process clock, one torch thread), then the "Cross-paper grid" table and figures from the records.
# SCALE=quick: 10 CPU-s per run, 2 seeds x 2 trials (~1.2 CPU-hours with evaluation, committed);
# SCALE=paper: the paper-like CPU profile, 3 seeds x 2 trials, 2-4 CPU-min per run (~12 CPU-hours; asks
# first, YES=1 answers). CROSS_TASKS picks tasks (usps lr lm llm); CROSS_ARGS adds driver flags
# (--methods, --seeds, --budget, --dry-run); DRY_RUN=1 only lists the sweeps.
CROSS_TASKS ?= usps lr lm llm
CROSS_ARGS ?=
CROSS_RUN := $(PY) -m experiments.cross.run

.PHONY: reproduce-cross cross-figures test-cross

reproduce-cross: ## the cross-paper grid: runs what is missing (one multirun per task), then table + figures
	$(CROSS_RUN) --profile $(SCALE) --tasks $(CROSS_TASKS) $(if $(DRY_RUN),--dry-run) $(if $(YES),--yes) $(CROSS_ARGS)
	$(if $(DRY_RUN),,$(PY) -m experiments.cross.report --profile $(SCALE))

cross-figures: ## only redraw the cross-paper table (results/tables/cross_grid_*) and figures from the records
	$(PY) -m experiments.cross.report --profile $(SCALE)

test-cross: ## the cross-paper grid's tests
	$(PY) -m pytest -q tests/experiments/test_cross.py
