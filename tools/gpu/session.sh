#!/usr/bin/env bash
# The GPU checklist of this repository, in stages short enough for a node you hold briefly
# (docs/cluster.md, section 6). Run from the repository root on a CUDA machine you keep a shell on;
# for the one-command device calls of a lent GPU use tools/gpu_slice.sh (section 5):
#
#   bash tools/gpu/session.sh smoke            # every *_paper experiment a few steps (make gpu-smoke)
#   bash tools/gpu/session.sh bench            # the GPU benchmarks -> results/benchmarks/cuda/
#   bash tools/gpu/session.sh shf-start 0 1 2  # MNIST paper runs of SHF-LSMR and HF-CG, these seeds, in the background
#   bash tools/gpu/session.sh status           # progress of the background runs
#   bash tools/gpu/session.sh pack [DIR]       # what this session wrote under results/ -> DIR/results.tgz
#
# Stages can be chained (`smoke bench`). Every call installs the offline wheelhouse first when Hydra
# is missing (`wheelhouse/`, made by `make wheelhouse`; docs/cluster.md, section 1), into
# $GPU_SESSION_DIR/site, so the node's own torch and transformers stay untouched.
#
# Environment: SMOKE_ARGS (arguments of tools.gpu.smoke; default --jobs 4), PACK_CHECKPOINTS=1
# (also pack the checkpoints of unfinished runs, in 15 MB parts), CURVOPT_DATA_DIR (the data directory; default ./data), GPU_SESSION_DIR (logs,
# installed wheels and the session's start stamp; default /tmp/curvopt_gpu_session), SHF_JOBS (how
# many MNIST runs share the GPU at once; default 2: their wall-clock axes are then contended, and
# results/gpu_smoke/cuda/gpu_session.jsonl records which ran together).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
SESSION="${GPU_SESSION_DIR:-/tmp/curvopt_gpu_session}"
mkdir -p "$SESSION/logs"
[ -f "$SESSION/stamp" ] || touch "$SESSION/stamp"  # files newer than this are the session's
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
export CURVOPT_DATA_DIR="${CURVOPT_DATA_DIR:-$ROOT/data}"
PY="${PYTHON:-python3}"
RESULTS="${GPU_SESSION_RESULTS:-results}"  # tests point these two elsewhere
LEDGER="${GPU_SESSION_LEDGER:-$RESULTS/gpu_smoke/cuda/gpu_session.jsonl}"

log() { printf '[gpu_session %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
ledger() {  # one JSON line per stage or launched run: what ran, when, alongside what
    mkdir -p "$(dirname "$LEDGER")"
    printf '{"time": "%s", "event": "%s", "detail": "%s"}\n' "$(date -u +%FT%TZ)" "$1" "$2" >>"$LEDGER"
}

ensure_deps() {
    if "$PY" -c "import hydra, omegaconf" 2>/dev/null; then return; fi
    [ -d wheelhouse ] || { echo "Hydra is missing and there is no wheelhouse/: run 'make wheelhouse' where PyPI is reachable, copy it here (docs/cluster.md)" >&2; exit 2; }
    log "installing wheelhouse/ into $SESSION/site (no index, no deps)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SESSION/site" wheelhouse/*.whl
    export PYTHONPATH="$SESSION/site:$PYTHONPATH"
}
[ -d "$SESSION/site" ] && export PYTHONPATH="$SESSION/site:$PYTHONPATH"

need_cuda() {
    [ "${GPU_SESSION_SKIP_CUDA_CHECK:-0}" = 1 ] && return  # tests of this script on a CPU
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || {
        echo "no CUDA device is visible: this script is the GPU checklist (on a CPU: make gpu-smoke)" >&2; exit 2; }
}

stage_smoke() {
    log "gpu smoke: every *_paper experiment, a few steps each"
    ledger smoke start
    # several entries at once (SMOKE_ARGS, default --jobs 4): pass/fail is the point here, the
    # benchmarks are the timings; a single entry's step time is then contended
    # shellcheck disable=SC2086
    "$PY" -m tools.gpu.smoke ${SMOKE_ARGS:---jobs 4} 2>&1 | tee "$SESSION/logs/smoke.log" || true
    ledger smoke end
}

stage_bench() {
    local out=results/benchmarks/cuda
    mkdir -p "$out"
    ledger bench start
    log "bench-shf: GN·v / gradient, LSMR iteration / (JVP + VJP), n = 300, 2000, 6000"
    "$PY" -m benchmarks.bench_shf --device cuda --with-6000 --out "$out/shf.json" 2>&1 | tee "$SESSION/logs/bench_shf.log" || true
    log "FGN Figure 2a at the paper's protocol (12 class counts, 4 methods, CUDA-synchronised)"
    "$PY" -m experiments.fgn.fig2 timing --profile paper 2>&1 | tee "$SESSION/logs/fgn_fig2a.log" || true
    log "bench-fgn: FGN / SGN / Adam step-time ratios over the paper's class grid, torch.compile included"
    "$PY" -m benchmarks.bench_fgn --device cuda --compile --classes 2 8 32 128 512 1024 2048 4096 \
        --out "$out" 2>&1 | tee "$SESSION/logs/bench_fgn.log" || true
    log "bench-optim: RACS / AdamW, Alice / GaLore on the LLaMA-60M matrices"
    "$PY" -m benchmarks.bench_llm_optim --device cuda --out-dir "$out" 2>&1 | tee "$SESSION/logs/bench_optim.log" || true
    log "LLaMA-60M bf16 tokens/s and peak memory per method (Figure 4)"
    "$PY" -m benchmarks.bench_llm_throughput --device cuda --dtype bfloat16 --sizes 60m \
        --out "$out/llm_throughput_60m.json" 2>&1 | tee "$SESSION/logs/bench_throughput.log" || true
    ledger bench end
}

stage_shf_start() {
    local seeds=("$@")
    [ ${#seeds[@]} -gt 0 ] || seeds=(0)
    local jobs="${SHF_JOBS:-2}" list=()
    for s in "${seeds[@]}"; do list+=("shf_lsmr:$s" "hf_cg:$s"); done
    log "MNIST paper profile, ${#list[@]} runs, $jobs at a time, in the background (periodic checkpoints: a later session resumes them)"
    ledger shf-start "${list[*]} jobs=$jobs"
    # a queue in the background: $jobs workers take runs in order; setsid so it outlives this call
    printf '%s\n' "${list[@]}" >"$SESSION/shf_queue"
    for w in $(seq 1 "$jobs"); do
        setsid nohup bash -c '
            cd "$0"; while true; do
                item=$(flock "$1/shf_queue" -c "head -n 1 \"$1/shf_queue\"; sed -i 1d \"$1/shf_queue\"")
                [ -n "$item" ] || exit 0
                opt=${item%%:*}; seed=${item##*:}
                printf "{\"time\": \"%s\", \"event\": \"run-start\", \"detail\": \"%s seed %s, worker %s\"}\n" "$(date -u +%FT%TZ)" "$opt" "$seed" "$2" >>"$3"
                "$4" -m experiments.run_missing --experiment shf_fig2_mnist --profile paper --optimizers "$opt" --seeds "$seed" \
                    trainer.device=cuda trainer.clock=wall trainer.checkpoint_every_s=120 logger=none \
                    >"$1/logs/shf_mnist_${opt}_s${seed}.log" 2>&1 || true
                printf "{\"time\": \"%s\", \"event\": \"run-end\", \"detail\": \"%s seed %s\"}\n" "$(date -u +%FT%TZ)" "$opt" "$seed" >>"$3"
            done' "$ROOT" "$SESSION" "$w" "$(realpath -m "$LEDGER")" "$PY" >/dev/null 2>&1 &
    done
    log "started; 'bash tools/gpu/session.sh status' shows their progress"
}

stage_status() {
    for f in "$SESSION"/logs/shf_mnist_*.log; do
        [ -e "$f" ] || { log "no background runs"; return; }
        printf '%s: %s\n' "$(basename "$f" .log)" "$(grep -E 'step [0-9]+|completed|interrupted|Error' "$f" | tail -n 1 | cut -c1-220)"
    done
    [ -s "$SESSION/shf_queue" ] && log "queued: $(tr '\n' ' ' <"$SESSION/shf_queue")" || true
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null || true
}

stage_pack() {
    local dest="${1:-${OUT:-outputs/gpu_session}}"
    mkdir -p "$dest"
    log "packing what this session wrote under $RESULTS/ into $dest/"
    find "$RESULTS" -type f -newer "$SESSION/stamp" ! -name '*.pt' ! -name 'run.lock' -print0 \
        | tar --null -czf "$dest/results.tgz" -T -
    if [ "${PACK_CHECKPOINTS:-0}" = 1 ]; then
        # checkpoints of unfinished runs, so a later session resumes them (MNIST: tens of MB each),
        # in 15 MB parts: cat checkpoints.tgz.part-* | tar -xz
        find "$RESULTS" -type f -name 'checkpoint.pt' -newer "$SESSION/stamp" -print0 \
            | tar --null -cz -T - | split -b 15m - "$dest/checkpoints.tgz.part-"
    fi
    tar -czf "$dest/logs.tgz" -C "$SESSION" logs
    ls -la "$dest"
    log "unpack in the repository root: tar -xzf results.tgz"
}

[ $# -gt 0 ] || { sed -n '2,20p' "$0"; exit 2; }
ensure_deps
while [ $# -gt 0 ]; do
    stage="$1"; shift
    case "$stage" in
        smoke) need_cuda; stage_smoke ;;
        bench) need_cuda; stage_bench ;;
        shf-start)
            need_cuda
            seeds=(); while [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; do seeds+=("$1"); shift; done
            stage_shf_start "${seeds[@]}" ;;
        status) stage_status ;;
        pack)
            if [ $# -gt 0 ] && [[ "$1" != smoke && "$1" != bench && "$1" != status && "$1" != shf-start ]]; then
                stage_pack "$1"; shift
            else stage_pack; fi ;;
        *) echo "unknown stage '$stage': smoke, bench, shf-start [SEEDS], status, pack [DIR]" >&2; exit 2 ;;
    esac
done
