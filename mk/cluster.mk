##@ Cluster: offline wheelhouse, GPU smoke test (docs/cluster.md)
# Cluster use (docs/cluster.md): an offline wheelhouse for GPU nodes without internet, and the GPU
# smoke test of every paper experiment (CUDA when present, else the same list on the CPU).
#   make wheelhouse PY_TARGET=3.12 PLATFORM=manylinux_2_28_x86_64 WHEELHOUSE_ARGS="--with submitit"
#   make gpu-smoke                      # results/gpu_smoke/<device>/smoke.{json,md}
# (PY is this Makefile's interpreter, so the target Python is PY_TARGET; `make wheelhouse PY=3.12`
# is accepted too and means the same.)
PY_TARGET ?= $(if $(filter 3.%,$(PY)),$(PY),3.12)
PLATFORM ?= manylinux_2_28_x86_64
WHEELHOUSE ?= wheelhouse
WHEELHOUSE_ARGS ?=
WHEELHOUSE_PY := $(if $(filter 3.%,$(PY)),$(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3),$(PY))
GPU_SMOKE_ARGS ?=

.PHONY: wheelhouse gpu-smoke gpu-smoke-quick test-gpu-smoke

wheelhouse: ## wheels our runs need that a CUDA node lacks, for PY_TARGET/PLATFORM, into wheelhouse/ (docs/cluster.md)
	$(WHEELHOUSE_PY) tools/wheelhouse.py --python-version $(PY_TARGET) \
		$(foreach p,$(PLATFORM),--platform $(p)) --dest $(WHEELHOUSE) $(WHEELHOUSE_ARGS)

gpu-smoke: ## every paper experiment a few steps (CUDA; CPU: tiny) -> results/gpu_smoke/<device>/smoke.{json,md}
	$(PY) -m experiments.gpu_smoke $(GPU_SMOKE_ARGS)

gpu-smoke-quick: ## the short list of gpu-smoke (one entry per paper) -> smoke_quick.{json,md}
	$(PY) -m experiments.gpu_smoke --quick $(GPU_SMOKE_ARGS)

test-gpu-smoke: ## the smoke list's tests (coverage of every *_paper experiment + the short CPU run)
	$(PY) -m pytest -q tests/test_gpu_smoke.py
