##@ Reproduction report and cross-paper benchmark table
# Reproduction report (issue 9) and the cross-paper benchmark table.
# `make report` reads run records and the drivers' table outputs only (it runs nothing): a missing run
# shows as "not run" with the command that produces it.
REPORT_ARGS ?=
BENCH_QUICK ?= 1

.PHONY: report bench bench-table bench-dispatch test-report

report: ## results/REPORT.md + REPORT.html (untracked, built here): every paper figure/table, paper vs ours, status per item
	$(PY) -m experiments.report --results-dir results --tolerances experiments/report/tolerances.yaml $(REPORT_ARGS)

bench: ## cross-paper step time / optimizer-state memory vs Adam (BENCH_QUICK=1: a few minutes on 2 cores)
	$(PY) -m experiments.report.bench run $(if $(filter 1,$(BENCH_QUICK)),--quick,)
	$(PY) -m experiments.report.bench table

bench-table: ## only rebuild the cross-paper table from results/benchmarks/*.json
	$(PY) -m experiments.report.bench table

test-report: ## report unit tests + notebook execution
	$(PY) -m pytest -q -m "not gpu" tests/experiments/test_report.py tests/experiments/test_notebooks.py

bench-dispatch: ## ops / host reads per optimizer step and solver iteration, predicted H200 ms (docs/lean_steps.md; ~2 min)
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.bench_dispatch
