##@ FOSI paper: quadratic experiments, optimizer benchmark and tests (docs/fosi.md)
# FOSI (docs/fosi.md). The quadratic experiments are float64 and run at the paper's settings on
# the CPU whatever SCALE says (about two minutes on 2 cores); figures are drawn from the run
# records in $(FOSI_Q_RESULTS) only.
FOSI_Q_RESULTS ?= results/fosi_quadratics
FOSI_FIGURES ?= results/figures/fosi
FOSI_Q_RUN := $(PY) -m experiments.fosi_quadratics.run --results-dir $(FOSI_Q_RESULTS)
FOSI_Q_FIG := $(PY) -m experiments.fosi_quadratics.figures --results-dir $(FOSI_Q_RESULTS) --out-dir $(FOSI_FIGURES)
FOSI_Q_ROBUST := $(PY) -m experiments.fosi_quadratics.robustness --results-dir $(FOSI_Q_RESULTS)
# The authors' code for the Figs 7-8 audit: a checkout of hsivan/fosi (cf040ce) and a Python with
# their CPU jax stack, both outside the repository (docs/fosi.md, "Audit against the authors' script")
FOSI_AUTHORS_SRC ?= /tmp/fosi_src
FOSI_JAX_PYTHON ?= /tmp/fosi_jax_venv/bin/python
FOSI_AUDIT_CELLS ?= all

.PHONY: reproduce-fosi-quadratics reproduce-fosi-fig3 reproduce-fosi-fig4 reproduce-fosi-fig7-fig8 \
	reproduce-fosi-fig9 fosi-fig7-robustness audit-fosi-authors bench-fosi test-fosi

reproduce-fosi-quadratics: ## FOSI Figures 3, 4, 7, 8, 9 (quadratic experiments Q1-Q4, records + figures)
	$(FOSI_Q_RUN) all
	$(FOSI_Q_ROBUST)
	$(FOSI_Q_FIG) all

reproduce-fosi-fig3: ## FOSI Figure 3 (Q1: n x lambda_1, six optimizers)
	$(FOSI_Q_RUN) q1
	$(FOSI_Q_FIG) fig3

reproduce-fosi-fig4: ## FOSI Figure 4 (Q2: GD vs FOSI-GD, k = 9)
	$(FOSI_Q_RUN) q2
	$(FOSI_Q_FIG) fig4

reproduce-fosi-fig7-fig8: ## FOSI Figures 7 and 8 (Q3: the (b, zeta) grid) and the start-point robustness map
	$(FOSI_Q_RUN) q3
	$(FOSI_Q_ROBUST)
	$(FOSI_Q_FIG) fig7 fig8 fig7_robustness

fosi-fig7-robustness: ## FOSI Figs 7-8: share of random eigenvector-sign starts where FOSI-Adam <= Adam (~3 CPU-min)
	$(FOSI_Q_ROBUST)
	$(FOSI_Q_FIG) fig7_robustness

audit-fosi-authors: ## FOSI Figs 7-8: the authors' jax script vs ours, f_t per step (skips without jax / checkout)
	$(PY) -m experiments.fosi_quadratics.audit_authors --authors-src $(FOSI_AUTHORS_SRC) \
		--jax-python $(FOSI_JAX_PYTHON) --cells $(FOSI_AUDIT_CELLS) --results-dir $(FOSI_Q_RESULTS)

reproduce-fosi-fig9: ## FOSI Figure 9 (Q4: learning-rate and momentum sweeps, c = 1 vs c = inf)
	$(FOSI_Q_RUN) q4
	$(FOSI_Q_FIG) fig9

bench-fosi: ## FOSI step and ESE cost vs its base optimizer (AE 2.8M, MLP 1M; thread CPU clock)
	$(PY) -m benchmarks.bench_fosi --clock cpu

test-fosi: ## FOSI paper tests: optimizer, Lanczos/HVP, quadratics, the DNN tasks (data, models, analysis), K-FAC
	$(PY) -m pytest -q tests/*/test_fosi_*.py tests/optim/test_kfac.py
