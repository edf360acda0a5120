"""Figure 4: measured peak memory of each method, with and without layer-wise updates.

Protocol (paper §F.4 and Figure 4; docs/decisions.md RACS-22): BF16 weights and states (on GPUs;
fp32 on CPUs by default, ``--dtype``), one sequence of 256 tokens per step, a few steps so every
optimizer state exists. "-layerwise" runs each parameter's optimizer step in
a post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``) and frees the
gradient at once, so only one layer's gradient is alive (GaLore's ``*_per_layer`` optimizers):
every parameter gets its own instance of the method's optimizer class with its group's
hyperparameters.

What is measured depends on the device, and the records say which (``memory_kind``):

* CUDA: ``torch.cuda.max_memory_allocated`` over the steps (the paper's measure);
* CPU: the peak of live tensor bytes in the torch profiler's memory timeline (weights,
  gradients, optimizer states, activations, temporaries; ``cpu_profiler_tensor_peak``), in a
  fresh process per configuration; the process's peak resident-set growth is recorded beside it
  (``rss_delta_bytes``, which adds allocator slack and kernel workspaces).

    python -m experiments.alice_llm.memory --profile quick           # tiny and 60M on the CPU
    python -m experiments.alice_llm.memory --profile paper --sizes 60m 130m 350m 1b   # GPU

Records: ``results/alice_memory/<profile>_<size>_<method>[_layerwise].json`` (kept; delete one
to re-measure). ``python -m experiments.alice_llm.figures fig4`` draws them.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from experiments.alice_llm.specs import TABLE2_METHODS, experiment_for, method_by_key

REPO = Path(__file__).resolve().parents[2]
QUICK_SIZES = ["tiny", "60m"]
FIG4_METHODS = ["adam", "galore", "fira", "racs", "alice0", "alice"]


def rss_bytes() -> int:
    """Current resident set of this process (Linux /proc)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_tensor_peak(fn) -> int:
    """Peak bytes of live CPU tensors while ``fn`` runs (torch profiler memory timeline: weights,
    gradients, optimizer states, activations, temporaries)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "timeline.json"
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    return int(max(sum(row) for row in sizes)) if sizes else 0


def per_parameter_optimizers(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, torch.optim.Optimizer]:
    """One instance of ``optimizer``'s class per parameter, with that parameter's group settings."""
    cls = type(optimizer)
    ctor = inspect.signature(cls.__init__).parameters
    extra = {k: v for k, v in optimizer.defaults.items() if k in ctor and k != "params"}
    out = {}
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            out[p] = cls([{**settings, "params": [p]}], **extra)
    return out


def make_layerwise(optimizer: torch.optim.Optimizer) -> list:
    """Step each parameter as soon as its gradient is accumulated, then free the gradient."""
    per_param = per_parameter_optimizers(optimizer)
    handles = []
    for p, opt in per_param.items():

        def hook(param: torch.Tensor, opt: torch.optim.Optimizer = opt) -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        handles.append(p.register_post_accumulate_grad_hook(hook))
    return handles


def measure_one(
    size: str,
    method_key: str,
    layerwise: bool,
    profile: str,
    steps: int,
    device_name: str,
    dtype_name: str = "auto",
) -> dict:
    """Build the run's model and optimizer from its config and time/measure a few steps."""
    from curvopt.objective import Objective, mean_loss
    from curvopt.training.build import build_algorithm, build_model, resolve_device
    from experiments.runs import compose_config

    m = method_by_key(method_key)
    exp = experiment_for(size)
    exp_cfg = exp if profile == "quick" and size == "tiny" else f"{exp}_paper"
    overrides = [
        f"experiment={exp_cfg}",
        f"optimizer={m.optimizer}",
        *[o for o in m.run_overrides() if not o.startswith("tag=")],
        "logger=none",
        "~optimizer.scheduler",
    ]
    cfg = compose_config(overrides)
    device = resolve_device(device_name)
    if dtype_name == "auto":  # the paper's bf16 on GPUs; bf16 matmuls crawl on CPUs without bf16 units
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, dtype_name)
    import transformers  # noqa: F401  (imported before the baseline, like everything else)

    baseline = rss_bytes()
    torch.manual_seed(0)
    model, loss = build_model(cfg, dtype, device)
    objective = Objective(model, loss)
    algorithm = build_algorithm(cfg.optimizer, objective, data=None)  # type: ignore[arg-type]
    optimizer = algorithm.optimizer
    if layerwise:
        make_layerwise(optimizer)
    vocab = int(model.vocab_size) if hasattr(model, "vocab_size") else 32000
    x = torch.randint(3, vocab, (1, 256), device=device)
    y = x[:, 1:].clone()
    losses: list[float] = []

    def run_steps() -> None:
        for _ in range(steps):
            out = model(x)
            loss_value = mean_loss(out, y, "cross_entropy")
            loss_value.backward()
            del out
            losses.append(float(loss_value.detach()))
            if not layerwise:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    rss_delta = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        run_steps()
        torch.cuda.synchronize(device)
        peak, kind = int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
        dev = torch.cuda.get_device_name(device)
    else:
        peak = cpu_tensor_peak(run_steps)
        rss_delta = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024 - baseline
        kind, dev = "cpu_profiler_tensor_peak", "cpu"
    return {
        "profile": profile,
        "size": size,
        "method": method_key,
        "layerwise": layerwise,
        "peak_bytes": peak,
        "memory_kind": kind,
        "device": dev,
        "steps": steps,
        "dtype": dtype_name,
        "num_params": sum(p.numel() for p in model.parameters()),
        "seconds": time.perf_counter() - t0,
        "loss": losses[-1],
        "losses": losses,
        "rss_delta_bytes": rss_delta,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Figure 4 memory measurements")
    parser.add_argument("--profile", default=os.environ.get("SCALE", "quick"), choices=["quick", "paper"])
    parser.add_argument("--sizes", nargs="*", default=None)
    parser.add_argument("--methods", nargs="*", default=FIG4_METHODS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument(
        "--jobs", type=int, default=1, help="configurations measured at once (one process each; GPU: 4-6)"
    )
    parser.add_argument("--one", nargs=3, metavar=("SIZE", "METHOD", "LAYERWISE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        size, method, lw = args.one
        print(
            json.dumps(
                measure_one(size, method, lw == "1", args.profile, args.steps, args.device, args.dtype)
            )
        )
        return
    sizes = args.sizes or (QUICK_SIZES if args.profile == "quick" else ["60m", "130m", "350m", "1b"])
    out_dir = args.results / "alice_memory"
    out_dir.mkdir(parents=True, exist_ok=True)
    known = {m.key for m in TABLE2_METHODS}
    unknown = [m for m in args.methods if m not in known]
    if unknown:
        raise SystemExit(f"unknown method {unknown[0]}; choose from {sorted(known)}")
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    todo = []
    for size in sizes:
        for method in args.methods:
            for layerwise in (False, True):
                path = out_dir / f"{args.profile}_{size}_{method}{'_layerwise' if layerwise else ''}.json"
                if path.exists():
                    print(f"[kept] {path}")
                    continue
                todo.append((size, method, layerwise, path))

    def one(size: str, method: str, layerwise: bool, path: Path) -> None:
        cmd = [sys.executable, "-m", "experiments.alice_llm.memory", "--profile", args.profile, "--steps", str(args.steps),
               "--device", args.device, "--dtype", args.dtype,
               "--one", size, method, "1" if layerwise else "0"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            print(f"[failed] {size} {method} layerwise={layerwise}:\n{done.stderr[-2000:]}", flush=True)
            return
        record = json.loads(done.stdout.strip().splitlines()[-1])
        record["concurrent_jobs"] = args.jobs
        path.write_text(json.dumps(record, indent=2) + "\n")  # each record as soon as it is measured
        print(
            f"[measured] {path}: {record['peak_bytes'] / 2**20:.1f} MiB ({record['memory_kind']})", flush=True
        )

    # Each configuration runs in its own process, so its peak (CUDA's max allocated, or the CPU
    # profiler's tensor peak) is its own even when several run at once on one device.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for future in [pool.submit(one, *job) for job in todo]:
            future.result()


if __name__ == "__main__":
    main()
