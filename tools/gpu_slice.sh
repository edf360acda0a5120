#!/usr/bin/env bash
# One GPU slice of tools/gpu/gpu_queue.yaml: the single command of a device call (docs/cluster.md, 5).
#
#   bash tools/gpu_slice.sh [ITEM]        # ITEM: a slice id; default gpu_carry/plan.json's, else the
#                                         # first slice without a `done` row in docs/gpu_ledger.md
#
# Installs the slice's missing wheels from gpu_carry/wheels (pip --no-index --no-deps --target),
# uses gpu_carry/data as CURVOPT_DATA_DIR, puts carried checkpoints in place, runs the slice until
# its work deadline (GPU_SLICE_WORK_S, default 480 s), stops the runs with SIGTERM (they checkpoint),
# and packs records, checkpoints of unfinished runs, logs and manifest.json into $OUT.
# Prepare here with `make gpu-carry ITEM=...`; afterwards `make gpu-unpack FROM=<files_at>`.
# Environment: PYTHON (default python3), GPU_SLICE_WORK_S, GPU_SLICE_TMP (scratch, default
# /tmp/gpu_slice; emptied only when a slice made it, another non-empty folder is refused),
# GPU_SLICE_RESULTS (default results/), GPU_SLICE_CARRY (default gpu_carry/).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m tools.gpu run "$@"
