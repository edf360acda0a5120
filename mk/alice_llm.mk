##@ RACS / Alice paper: LLaMA on C4, Tables 2 and 5, Figures 1-6 (docs/alice_llm.md)
# RACS / Alice paper, LLaMA on C4 (docs/alice_llm.md). SCALE=quick: a small LLaMA on the C4
# sample on the CPU (~15 min for the Table 2 set); SCALE=paper: the paper's sizes on GPUs
# (ALICE_SIZES, ALICE_NPROC = GPUs per run via torchrun). Each target runs only what is missing.
ALICE_SIZES ?= 60m 130m 350m 1b
ALICE_NPROC ?= 1
ALICE_RUN := $(PY) -m experiments.alice_llm.run --profile $(SCALE) --nproc $(ALICE_NPROC)
ALICE_FIG := $(PY) -m experiments.alice_llm.figures --profile $(SCALE)
ALICE_SIZE_ARGS = $(if $(filter paper,$(SCALE)),--sizes $(ALICE_SIZES),)

.PHONY: reproduce-alice-table2 reproduce-alice-fig1 reproduce-alice-fig2 reproduce-alice-fig3 \
	reproduce-alice-fig4 reproduce-alice-fig5 reproduce-alice-table5 reproduce-alice-fig6 \
	reproduce-alice bench-alice-throughput

reproduce-alice-table2: ## RACS/Alice Table 2 (eval ppl, speed-up, TP) + paper numbers
	$(ALICE_RUN) table2 $(ALICE_SIZE_ARGS)

reproduce-alice-fig1: ## RACS/Alice Figure 1 (1B eval ppl curves; quick: the small model)
	$(ALICE_RUN) fig1 $(if $(filter paper,$(SCALE)),--sizes 1b,)

reproduce-alice-fig2: ## RACS/Alice Figure 2 (60M/130M/350M eval ppl curves; quick: the small model)
	$(ALICE_RUN) fig2 $(if $(filter paper,$(SCALE)),--sizes 60m 130m 350m,)

reproduce-alice-fig3: ## RACS/Alice Figure 3 (throughput, effective throughput)
	$(ALICE_RUN) fig3 $(ALICE_SIZE_ARGS)

reproduce-alice-fig4: ## RACS/Alice Figure 4 (measured memory, with/without layer-wise updates)
	$(PY) -m experiments.alice_llm.memory --profile $(SCALE)
	$(ALICE_FIG) fig4

reproduce-alice-fig5: ## RACS/Alice Figure 5 (ablations; paper: 130M)
	$(ALICE_RUN) fig5

reproduce-alice-table5: ## RACS/Alice Table 5 (component ablation; paper: 130M)
	$(ALICE_RUN) table5

reproduce-alice-fig6: ## RACS/Alice Figure 6 (basis stability across refreshes)
	$(PY) -m experiments.alice_llm.basis_stability --profile $(SCALE)
	$(ALICE_FIG) fig6

ALICE_ITEMS := reproduce-alice-table2 reproduce-alice-fig1 reproduce-alice-fig2 reproduce-alice-fig3 \
	reproduce-alice-fig4 reproduce-alice-fig5 reproduce-alice-table5 reproduce-alice-fig6

reproduce-alice: $(ALICE_ITEMS) ## everything above: Table 2, Figures 1-6, Table 5 (Table 3: reproduce-alice-table3)

bench-alice-throughput: ## tokens/s of each method relative to Adam (tiny and 60M on this machine)
	$(PY) -m benchmarks.bench_llm_throughput
