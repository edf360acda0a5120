##@ FOSI paper: the five DNN tasks (docs/fosi_tasks.md)
# FOSI paper, part 2: the five DNN tasks (docs/fosi_tasks.md). Each target runs only what is missing
# (finished runs are kept), then builds its table/figure from the run records.
# SCALE=quick: CPU smoke scale (LR at 20 epochs, AE/LM a few hundred steps; TL/AC need their data);
# SCALE=paper: the paper's settings (LR runs fully on the CPU in minutes; the others want a GPU).
# FOSI_TASKS picks tasks (default: all five; tasks without data/weights are skipped with a message).
# FOSI_ARGS adds driver flags, e.g. FOSI_ARGS="--clock wall" or "--kfac-grid full".
FOSI_TASKS ?= lr ae lm tl ac
FOSI_ARGS ?=
FOSI_RUN := $(PY) -m experiments.fosi_tasks.run
FOSI_COMMON = --profile $(SCALE) --tasks $(FOSI_TASKS) $(FOSI_ARGS)

.PHONY: reproduce-fosi-table1 reproduce-fosi-table2 reproduce-fosi-fig2 reproduce-fosi-fig5 \
	reproduce-fosi-fig6 reproduce-fosi-lr bench-fosi-overhead bench-kfac reproduce-fosi

reproduce-fosi-table1: ## FOSI Table 1 (time to the base optimizer's best validation metric) + paper's values
	$(FOSI_RUN) table1 $(FOSI_COMMON)

reproduce-fosi-table2: ## FOSI Table 2 (time to the base optimizer's best training loss) + paper's values
	$(FOSI_RUN) table2 $(FOSI_COMMON)

reproduce-fosi-fig2: ## FOSI Figure 2 (AC: train loss, validation accuracy vs time; needs AudioSet)
	$(FOSI_RUN) fig2 $(FOSI_COMMON)

reproduce-fosi-fig5: ## FOSI Figure 5 (per task: train loss vs epoch/time, validation loss vs epoch)
	$(FOSI_RUN) fig5 $(FOSI_COMMON)

reproduce-fosi-fig6: ## FOSI Figure 6 (FOSI-HB vs K-FAC vs L-BFGS best L, with the paper's omissions)
	$(FOSI_RUN) fig6 $(FOSI_COMMON)

reproduce-fosi-lr: ## the LR row at paper scale on the CPU: Tables 1-2, Figures 5-6
	$(FOSI_RUN) all --profile paper --tasks lr $(FOSI_ARGS)

bench-kfac: ## K-FAC input factors on the AE: im2col reference vs fast path, and the quadratic model's cost
	$(PY) -m benchmarks.bench_kfac

bench-fosi-overhead: ## FOSI per-step overhead (tau1, tau2, tau3) and rho(T=800) per task vs the 1.1 target
	$(PY) -m experiments.fosi_tasks.overhead --profile $(SCALE) --tasks $(FOSI_TASKS)

# Every FOSI item of the report, in its order (the quadratics come from mk/fosi.mk).
FOSI_ITEMS := reproduce-fosi-quadratics reproduce-fosi-table1 reproduce-fosi-table2 reproduce-fosi-fig2 \
	reproduce-fosi-fig5 reproduce-fosi-fig6 bench-fosi-overhead

reproduce-fosi: $(FOSI_ITEMS) ## all FOSI figures and tables: quadratics (Figs 3, 4, 7-9), Tables 1-2, Figs 2, 5, 6, overhead
