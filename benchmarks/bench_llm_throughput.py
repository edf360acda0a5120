"""Training throughput of each RACS/Alice-paper method relative to Adam, same model and machine.

    python -m benchmarks.bench_llm_throughput                        # tiny (quick model) and 60M, CPU
    python -m benchmarks.bench_llm_throughput --sizes 60m --device cuda --dtype bfloat16   # + peak memory

TP = non-pad tokens per second of the update (forward, backward, optimizer step; the loop's
``TorchOptimizerAlgorithm.step`` with the run's micro-batching), as the loop logs it. Methods
with a periodic projection refresh (GaLore, Fira, Alice, Alice-0: every K updates) pay for it
once per K steps, so their TP is amortised: ``tokens / ((K−1)/K · t_steady + 1/K · t_refresh)``,
with ``t_refresh`` timed on refresh steps (the first step, and steps of a run with K = 2) and
``t_steady`` on the others. Targets (issue #8): RACS ≥ 0.9× and Alice ≥ 0.85× Adam.

Builds each method from the same composed config as a run (``experiment=alice_c4`` for ``tiny``,
``alice_c4_<size>_paper`` for the paper sizes) with a random-token batch of the profile's shape:
tiny = 8 × 128 (2 micro-batches), 60M on the CPU = 4 × 256 (one micro-batch; the paper's
512 × 256 is the same per-token work, 128× longer). Other processes may share the CPU: the
record keeps the load average. On a GPU (``--shape auto``) the batch is the config's own, 512 × 256
in micro-batches of 256 for 60M, and each method's peak allocated memory is recorded (Figure 4).
Writes ``results/benchmarks/llm_throughput.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from experiments.alice_llm.specs import method_by_key

ROOT = Path(__file__).resolve().parents[1]

METHODS = ["adam", "racs", "alice", "alice0", "galore", "fira"]
CLOCK = time.perf_counter  # main(): wall clock, or this process's CPU time (--clock process, CPU only)
SHAPES = {"tiny": (8, 128, 4), "60m": (4, 256, None), "130m": (4, 256, None)}  # batch, length, micro
REFRESH_KEYS = ("update_proj_gap", "update_interval", "proj_gap", "K")


def compose_cfg(size: str, method_key: str, extra: list[str]):
    from hydra import compose, initialize_config_dir

    from curvopt.training.schema import register_schemas

    register_schemas()
    m = method_by_key(method_key)
    exp = "alice_c4" if size == "tiny" else f"alice_c4_{size}_paper"
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose(
            "config",
            [
                f"experiment={exp}",
                f"optimizer={m.optimizer}",
                *[o for o in m.run_overrides() if not o.startswith("tag=")],
                "logger=none",
                *extra,
            ],
        )


def refresh_key(cfg) -> str | None:
    for key in REFRESH_KEYS:
        if key in cfg.optimizer:
            return key
    return None


def batch_shape(size: str, cfg, shape: str) -> tuple[int, int, int | None]:
    """(sequences per update, sequence length, micro-batch) of the timed batch.

    ``small``: :data:`SHAPES` (a CPU-sized batch). ``paper``: the run config's own, i.e. the
    paper's global batch with its micro-batching (60M: 512 × 256 in micro-batches of 256), which a
    GPU needs for a throughput that is not launch overhead.
    """
    if shape == "small" or size == "tiny":
        return SHAPES[size]
    micro = cfg.trainer.get("micro_batch_size")
    return int(cfg.trainer.batch_size), int(cfg.dataset.max_length), int(micro) if micro else None


def time_steps(
    size: str,
    method_key: str,
    steps: int,
    device: torch.device,
    dtype: torch.dtype,
    extra: list[str],
    shape: str = "small",
):
    """Step times of ``steps`` updates (the first included) on one fixed random batch."""
    from omegaconf import open_dict

    from curvopt.api import DataBundle
    from curvopt.objective import Objective
    from curvopt.training.build import build_algorithm, build_model

    cfg = compose_cfg(size, method_key, extra)
    with open_dict(cfg):
        cfg.optimizer.pop(
            "scheduler", None
        )  # constant lr: the schedule costs nothing and lr 0 at step 1 hides work
    torch.manual_seed(0)
    model, loss = build_model(cfg, dtype, device)
    batch, length, micro = batch_shape(size, cfg, shape)
    vocab = int(model.vocab_size)
    x = torch.randint(3, vocab, (batch, length), device=device)
    y = x[:, 1:].clone()
    data = DataBundle(train=(x, y))
    algo = build_algorithm(cfg.optimizer, Objective(model, loss), data, micro_batch_size=micro)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = CLOCK()
        algo.step((x, y))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(CLOCK() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return times, int((y != -100).sum()), cfg, (batch, length, micro), peak


def measure(
    size: str, method_key: str, steps: int, device: torch.device, dtype: torch.dtype, shape: str = "small"
) -> dict:
    times, tokens, cfg, (batch, length, micro), peak = time_steps(
        size, method_key, steps, device, dtype, [], shape
    )
    steady = statistics.median(times[1:])
    key = refresh_key(cfg)
    record = {
        "size": size,
        "method": method_key,
        "batch": batch,
        "length": length,
        "micro_batch": micro,
        "peak_mem_bytes": peak,
        "tokens_per_step": tokens,
        "steady_step_s": steady,
        "first_step_s": times[0],
        "step_times_s": times,
    }
    if key is not None:
        interval = int(cfg.optimizer[key])
        # every step of a K=2 run after the first alternates refresh / no refresh
        r_times = time_steps(size, method_key, 5, device, dtype, [f"optimizer.{key}=2"], shape)[0]
        refresh = statistics.median([r_times[i] for i in (2, 4)])  # t % 2 == 0 → refresh
        amortised = (interval - 1) / interval * steady + refresh / interval
        record.update(
            refresh_key=key, refresh_interval=interval, refresh_step_s=refresh, amortised_step_s=amortised
        )
    else:
        amortised = steady
        record.update(amortised_step_s=amortised)
    record["tokens_per_s"] = tokens / amortised
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "60m"])
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument(
        "--steps", type=int, default=None, help="timed updates per method (default: 10 tiny, 4 else)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--clock",
        default="auto",
        choices=["auto", "wall", "process"],
        help="process: this process's CPU time (robust on a shared CPU, with --threads 1); "
        "auto: process on the CPU with one thread, else wall",
    )
    parser.add_argument(
        "--shape",
        default="auto",
        choices=["auto", "small", "paper"],
        help="timed batch: small (4 x 256, CPU), paper (the config's global batch and micro-batch, "
        "60M: 512 x 256); auto: paper on a GPU, small on the CPU",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "benchmarks" / "llm_throughput.json")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = args.clock
    if clock == "auto":
        clock = "process" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"
    if clock == "process" and device.type != "cpu":
        raise SystemExit("--clock process measures CPU time: use it on the CPU only")
    global CLOCK
    CLOCK = time.process_time if clock == "process" else time.perf_counter
    shape = args.shape if args.shape != "auto" else ("paper" if device.type == "cuda" else "small")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = []
    for size in args.sizes:
        steps = args.steps or (10 if size == "tiny" else 4)
        adam_tp = None
        for method in args.methods:
            try:
                rec = measure(size, method, steps, device, dtype, shape)
            except Exception as err:  # a method missing here must not lose the others
                print(f"{size:>5} {method:>8}: failed ({err!r})", flush=True)
                continue
            if method == "adam":
                adam_tp = rec["tokens_per_s"]
            rec["relative_to_adam"] = rec["tokens_per_s"] / adam_tp if adam_tp else None
            results.append(rec)
            rel = f"{rec['relative_to_adam']:.3f}x Adam" if rec["relative_to_adam"] else ""
            print(f"{size:>5} {method:>8}: {rec['tokens_per_s']:10.0f} tok/s  {rel}", flush=True)
    out = {
        "device": args.device if args.device != "cuda" else torch.cuda.get_device_name(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "clock": clock,
        "dtype": args.dtype,
        "shape": shape,
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        "# Training throughput relative to Adam (same model, same machine)",
        "",
        f"`benchmarks/bench_llm_throughput.py --sizes {' '.join(args.sizes)}`: device {out['device']}, "
        f"{out['threads']} thread(s), {clock} clock, {args.dtype}, 1-min load average "
        f"{out['load_average'][0]:.2f} (a shared CPU). Targets: RACS ≥ 0.9×, Alice ≥ 0.85× Adam.",
        "",
        "| size | method | batch × length (micro) | tokens/s (amortised) | × Adam | steady step s | refresh step s | peak memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rel = f"{r['relative_to_adam']:.3f}" if r["relative_to_adam"] else "–"
        ref = f"{r['refresh_step_s']:.3f}" if "refresh_step_s" in r else "–"
        mem = f"{r['peak_mem_bytes'] / 2**30:.2f} GiB" if r.get("peak_mem_bytes") else "–"
        shp = f"{r['batch']} × {r['length']} ({r['micro_batch'] or '–'})"
        lines.append(
            f"| {r['size']} | {r['method']} | {shp} | {r['tokens_per_s']:.0f} | {rel} | {r['steady_step_s']:.3f} | {ref} | {mem} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
