# Entry points. `make setup` once, then `make reproduce-fig2` (the main job) and `make test`.
# SCALE=quick (2-core CPU, minutes) | paper (the papers' settings, for a GPU).
# At SCALE=paper a driver lists the runs it would start, with a time estimate from the committed
# records, and asks first: YES=1 answers for scripts; DRY_RUN=1 (SHF targets) only lists them.
# Per paper (mk/<paper>.mk): reproduce-<paper>-<item>, reproduce-<paper> (all of its items),
# test-<paper>, bench-<paper>. `make help` lists them, one heading per file. The drivers are run as
# modules of the experiments package from the repository root (python -m experiments.<paper>.<driver>).
##@ Setup, tests, lint
SHELL := /bin/bash
VENV ?= .venv
PY ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)
SCALE ?= quick
# Data directory: CURVOPT_DATA_DIR if set, else ../shared/data when it exists (a data folder next to
# the checkout, shared by several checkouts), else ./data. README.md, "Data directory", lists its contents.
CURVOPT_DATA_DIR ?= $(if $(wildcard ../shared/data),$(abspath ../shared/data),$(abspath data))
export CURVOPT_DATA_DIR
# scipy/numpy threads fight torch's for the cores otherwise (2.4x slower LSMR on 2 cores).
export OPENBLAS_NUM_THREADS ?= 1
export PYTHONPATH := $(abspath src)$(if $(PYTHONPATH),:$(PYTHONPATH))
TRAIN := $(PY) src/train.py

.PHONY: setup test test-slow test-all lint format mnist-autoencoder-demo help

help: ## this list: one heading per file (##@ line), its targets in file order
	@awk '/^##@ / { printf "\n%s\n", substr($$0, 5); next } \
		/^[a-zA-Z0-9_-]+:.*## / { name = $$0; sub(/:.*/, "", name); text = $$0; sub(/^[^#]*## /, "", text); \
		printf "  %-28s %s\n", name, text }' $(MAKEFILE_LIST)

setup: ## create .venv and install the pinned requirements (CPU torch) + this package
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	$(VENV)/bin/pip install -q --no-deps -e .

test: ## default test suite (< 10 min on 2 cores)
	$(PY) -m pytest -q

test-slow: ## the slow tests only
	$(PY) -m pytest -q -m slow

test-all: ## every CPU test
	$(PY) -m pytest -q -m "not gpu"

lint: ## ruff lint + format check
	$(PY) -m ruff check src tests experiments benchmarks tools
	$(PY) -m ruff format --check src tests experiments benchmarks tools

format:
	$(PY) -m ruff format src tests experiments benchmarks
	$(PY) -m ruff check --fix src tests experiments benchmarks

mnist-autoencoder-demo: ## Adam / heavy-ball / SGD on the MNIST autoencoder, then the error-vs-time plot
	$(PY) -m experiments.run_missing --experiment mnist_autoencoder --optimizers adam heavy_ball sgd --seeds 0
	$(PY) -m experiments.plots.error_vs_time --experiment mnist_autoencoder \
		--out results/figures/mnist_autoencoder_error_vs_time.png

# Papers in the README's order, then the report and the cluster tools (any other mk/*.mk after them).
MK_FILES := mk/shf.mk mk/fgn.mk mk/fosi.mk mk/fosi_tasks.mk mk/alice.mk mk/alice_llm.mk mk/cross.mk mk/report.mk mk/cluster.mk
-include $(MK_FILES) $(filter-out $(MK_FILES),$(sort $(wildcard mk/*.mk)))
