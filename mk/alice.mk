##@ RACS / Alice paper: optimizers, Table 3, step cost, tests (docs/alice.md)
# RACS / Alice / Alice-0 optimizers and the GaLore/Fira/APOLLO baselines (docs/alice.md).
.PHONY: reproduce-alice-table3 bench-optim bench-optim-quick bench-alice test-alice

reproduce-alice-table3: ## RACS/Alice Table 3: estimated memory (60M-1B) vs paper + measured 60M state bytes
	$(PY) -m experiments.alice_table3.table3 --out-dir results/tables

bench-optim: ## optimizer step cost on the LLaMA-60M matrices (AdamW, RACS, Alice, GaLore, Fira, APOLLO)
	$(PY) -m benchmarks.bench_llm_optim --out-dir results/benchmarks

bench-optim-quick: ## the same in --quick mode, one thread, process CPU time (a few min on a shared CPU)
	$(PY) -m benchmarks.bench_llm_optim --quick --threads 1 --out-dir results/benchmarks

bench-alice: bench-optim bench-alice-throughput ## the RACS/Alice benchmarks: step cost (bench-optim) and LLaMA throughput

test-alice: ## RACS/Alice paper tests: optimizers, grouping and memory, baselines, C4/LLaMA pipeline and analysis
	$(PY) -m pytest -q tests/optim/test_racs_optimizer.py tests/optim/test_alice_optimizer.py tests/optim/test_alice_grouping.py tests/optim/test_alice_baselines.py \
		tests/data/test_lm_data.py tests/training/test_lm_training.py tests/experiments/test_lm_analysis.py
