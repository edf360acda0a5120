##@ Cluster: offline wheelhouse, GPU smoke test, GPU slices (docs/cluster.md)
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
	$(WHEELHOUSE_PY) tools/gpu/wheelhouse.py --python-version $(PY_TARGET) \
		$(foreach p,$(PLATFORM),--platform $(p)) --dest $(WHEELHOUSE) $(WHEELHOUSE_ARGS)

gpu-smoke: ## every paper experiment a few steps (CUDA; CPU: tiny) -> results/gpu_smoke/<device>/smoke.{json,md}
	$(PY) -m tools.gpu.smoke $(GPU_SMOKE_ARGS)

gpu-smoke-quick: ## the short list of gpu-smoke (one entry per paper) -> smoke_quick.{json,md}
	$(PY) -m tools.gpu.smoke --quick $(GPU_SMOKE_ARGS)

test-gpu-smoke: ## the smoke list's tests (coverage of every *_paper experiment + the short CPU run)
	$(PY) -m pytest -q tests/tools/test_gpu_smoke.py

# GPU slices (docs/cluster.md, section 5): the GPU work as a queue (tools/gpu/gpu_queue.yaml) of slices
# of one device call each; docs/gpu_ledger.md says which are done.
#   make gpu-queue                      # the slices, their estimated GPU minutes, the next one
#   make gpu-carry [ITEM=<slice>]       # gpu_carry/: only that slice's wheels, data, checkpoints
#   make gpu-unpack FROM=<files_at> [GPU_MIN=<minutes>]   # after the device call
ITEM ?=
FROM ?=
GPU_MIN ?=
GPU_CARRY_ARGS ?=

.PHONY: gpu-queue gpu-carry gpu-slice gpu-unpack test-gpu-slice

gpu-queue: ## the GPU slices of tools/gpu/gpu_queue.yaml: estimated minutes, runs, ledger status, the next one
	$(PY) -m tools.gpu list

gpu-carry: ## gpu_carry/ for ITEM (default: the next slice): its wheels, data and checkpoints; prints the device call
	$(PY) -m tools.gpu carry $(ITEM) $(GPU_CARRY_ARGS)

gpu-slice: ## run slice ITEM here (what the device call runs: bash tools/gpu_slice.sh ITEM); CUDA, except ITEM=cpu-test
	PYTHON=$(PY) bash tools/gpu_slice.sh $(ITEM)

gpu-unpack: ## FROM=<folder>: check the manifest's sha256s, extract into results/, ledger row, figures + make report
	@test -n "$(FROM)" || { echo "usage: make gpu-unpack FROM=<the device reply's files_at folder> [GPU_MIN=<minutes>]"; exit 2; }
	$(PY) -m tools.gpu unpack $(FROM) $(if $(GPU_MIN),--gpu-minutes $(GPU_MIN)) --python $(PY)

test-gpu-slice: ## the slice machinery's tests (CPU: the whole path with a fake $OUT, unpack, tampering)
	$(PY) -m pytest -q tests/tools/test_gpu_slice.py
