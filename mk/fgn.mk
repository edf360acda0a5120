##@ FGN paper (docs/fgn.md)
# FGN paper (Fast Gauss-Newton for multiclass cross-entropy), docs/fgn.md.
# SCALE=quick: 2-core CPU, minutes (synthetic Cars196 stand-in, short runs, fewer C values);
# SCALE=paper: the paper's protocol (GPU; real Cars196 features, or FGN_DATASET=cars196_synthetic).
# Each target runs only what is missing, then draws from the records.
FGN_DATASET ?=
FGN_SEEDS ?=
FGN_RUN_ARGS = --profile $(SCALE) $(if $(FGN_DATASET),--dataset $(FGN_DATASET),) $(if $(FGN_SEEDS),--seeds $(FGN_SEEDS),)

.PHONY: reproduce-fgn-fig2 reproduce-fgn-fig3 reproduce-fgn-table1 reproduce-fgn bench-fgn test-fgn

reproduce-fgn-fig2: ## FGN Figure 2: (a) time/update vs C, (b) trace split vs xi, (c) step quality vs xi
	$(PY) -m experiments.fgn.fig2 all --profile $(SCALE)

reproduce-fgn-fig3: ## FGN Figure 3: Cars196 head, test accuracy vs head time (Adam, SGN, FGN)
	$(PY) -m experiments.fgn.cars196 fig3 $(FGN_RUN_ARGS)

reproduce-fgn-table1: ## FGN Table 1: accuracy / CE at the shared horizon, time to thresholds
	$(PY) -m experiments.fgn.cars196 table1 $(FGN_RUN_ARGS)

reproduce-fgn: reproduce-fgn-fig2 reproduce-fgn-fig3 reproduce-fgn-table1 ## all FGN figures and tables

bench-fgn: ## FGN / SGN / Adam step-time ratios at b=512, D=2048 (results/benchmarks/; CPU: 1 thread, CPU-seconds clock)
	$(PY) -m benchmarks.bench_fgn --threads 1

test-fgn: ## the FGN tests only
	$(PY) -m pytest -q tests/*/test_fgn_*.py
