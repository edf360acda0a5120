##@ SHF-LSMR paper (docs/shf.md)
# SHF-LSMR paper (docs/shf.md). SCALE=quick: MNIST on the CPU, one seed, a fixed algorithm-time
# budget per method (~10 min for the whole target); SCALE=paper: all three datasets, 5 seeds,
# the paper's settings (GPU). Each target runs only the missing runs, then draws from the records.
SHF_DATASETS ?= $(if $(filter paper,$(SCALE)),mnist curves usps,mnist)
SHF_SEEDS ?= $(if $(filter paper,$(SCALE)),0 1 2 3 4,0)
SHF_METHODS ?= shf_lsmr hf_cg
# Extra Hydra overrides for every run. SHF_CPU=1 runs the paper profile on a CPU the way the committed
# CPU records were made: one torch thread, the process clock, a checkpoint every 10 minutes so a run
# that outlives a working session resumes from its (committed) run directory.
SHF_CPU_OVERRIDES = trainer.device=cpu trainer.num_threads=1 trainer.clock=process trainer.checkpoint_every_s=600
SHF_OVERRIDES ?= $(if $(SHF_CPU),$(SHF_CPU_OVERRIDES))
# Figures and the table always show all three datasets; a panel without runs says how to make them.
SHF_FIG_ARGS = --profile $(SCALE) --datasets mnist curves usps

.PHONY: shf-runs reproduce-shf-fig2 reproduce-shf-fig3 reproduce-shf-table2 reproduce-shf \
	reproduce-fig2 reproduce-fig3 reproduce-table2 bench-shf test-shf

# One driver call for every dataset: it lists the runs it will start with a time estimate from the
# committed records and, at SCALE=paper, asks first (YES=1 answers for scripts; DRY_RUN=1 lists only).
shf-runs:
	$(PY) -m experiments.run_missing --experiment $(addprefix shf_fig2_,$(SHF_DATASETS)) --profile $(SCALE) \
		--optimizers $(SHF_METHODS) --seeds $(SHF_SEEDS) $(if $(DRY_RUN),--dry-run) $(SHF_OVERRIDES)

reproduce-shf-fig2: shf-runs ## SHF-LSMR Figure 2 (train dotted / test solid error vs time)
	$(PY) -m experiments.shf.figures fig2 $(SHF_FIG_ARGS)

reproduce-shf-fig3: shf-runs ## SHF-LSMR Figure 3 (mini-batch size vs time)
	$(PY) -m experiments.shf.figures fig3 $(SHF_FIG_ARGS)

reproduce-shf-table2: shf-runs ## SHF-LSMR Table 2 (errors at best validation, next to the paper's)
	$(PY) -m experiments.shf.figures table2 $(SHF_FIG_ARGS)

reproduce-shf: reproduce-shf-fig2 reproduce-shf-fig3 reproduce-shf-table2 ## all SHF-LSMR figures and tables

# Short names (README, docs): the main job and the paper's other two items.
reproduce-fig2: reproduce-shf-fig2 ## the main job: short for reproduce-shf-fig2
reproduce-fig3: reproduce-shf-fig3 ## short for reproduce-shf-fig3
reproduce-table2: reproduce-shf-table2 ## short for reproduce-shf-table2

bench-shf: ## SHF building blocks: LSMR iteration vs JVP+VJP, ours vs SciPy, GN·v vs gradient (results/benchmarks/shf.json)
	$(PY) -m benchmarks.bench_shf --sizes 300 2000 --threads 1 --stat min

test-shf: ## SHF-LSMR and HF-CG tests: LSMR, Gauss-Newton products, both algorithms, USPS/CURVES data, experiments
	$(PY) -m pytest -q tests/*/test_shf_*.py tests/*/test_hfcg_*.py tests/data/test_data_curves_usps.py
