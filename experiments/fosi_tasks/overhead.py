"""FOSI's runtime overhead per task against the paper's design target ρ = 1.1 (paper §3.7, A.8).

For each task (with its data available) and base optimizer (HB, Adam) it measures, on the task's
model and batch size at the chosen profile:

* τ₁: one step of the base optimizer (median over ``--steps`` after warm-up; on the CPU with one
  thread measured as process CPU time, which leaves out the time other processes hold the core);
* τ₂: one FOSI step between ESEs (a basis installed, no ESE due), timed alternately with τ₁'s steps;
* τ₃: one ESE (Lanczos with m HVPs on the ESE batch; with ``--ese-repeats`` > 1 the median of all but the
  first, which also pays one-time torch.func set-up);

and reports the amortised ratio ρ(T) = (τ₂ + τ₃/T)/τ₁ at the paper's T = 800 and at the T of the
profile, with the period T* = τ₃/(1.1·τ₁ − τ₂) that would meet ρ = 1.1 (eq. 8).

    python -m experiments.fosi_tasks.overhead --profile quick --tasks lr ae lm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from curvopt.objective import Objective
from curvopt.training.build import build_algorithm, build_data, build_model
from experiments.fosi_tasks import analysis
from experiments.fosi_tasks.run import data_problem
from experiments.runs import REPO_ROOT, compose_config, experiment_config

CONF_DIR = REPO_ROOT / "conf"


def compose(overrides: list[str]):
    return compose_config(overrides)


def _clock(device: torch.device):
    # On the CPU with one thread, process CPU time is the step's cost without the time other
    # processes hold the core (a shared machine); on a GPU, synchronised wall time.
    return time.perf_counter if device.type == "cuda" or torch.get_num_threads() > 1 else time.process_time


def _timed_step(algorithm, batch, device: torch.device, clock) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = clock()
    algorithm.step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - t0


def _interleaved_step_times(
    base_algo, fosi_algo, batches, warmup: int, device: torch.device
) -> tuple[list[float], list[float]]:
    """Step times of the base and of FOSI, alternating step by step on the same batches, so that a
    change of load on a shared machine hits both alike (sequential blocks gave τ₂/τ₁ from 0.7 to 1.2).

    Each step gets a fresh copy of the batch, made just before it as the training loop's batch
    fetch is: stepping both on one tensor gave the second a batch already in cache (on LR's
    1024 × 784 batch, FOSI's τ₂ came out 0.97-1.08 τ₁ where the runs' own step times give 1.27-1.30).
    """
    clock = _clock(device)
    base_times, fosi_times = [], []
    for i, batch in enumerate(batches):
        tb = _timed_step(base_algo, tuple(t.clone() for t in batch), device, clock)
        tf = _timed_step(fosi_algo, tuple(t.clone() for t in batch), device, clock)
        if i >= warmup:
            base_times.append(tb)
            fosi_times.append(tf)
    return base_times, fosi_times


def measure(
    task: analysis.Task,
    base: str,
    profile: str,
    steps: int,
    device: str,
    ese_repeats: int = 2,
    fosi_overrides: list[str] | None = None,
) -> dict:
    fosi_name = f"fosi_{base}"
    common = [
        f"experiment={experiment_config(task.experiment, profile)}",
        "logger=none",
        f"trainer.device={device}",
    ]
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    out = {"task": task.key, "base": base, "profile": profile, "device": str(dev)}
    cfg = compose([*common, f"optimizer={base}"])
    torch.manual_seed(0)
    data = build_data(cfg, torch.float32, dev)
    bs = int(cfg.trainer.batch_size)
    x, y = data.train
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps + 3):
        idx = torch.randperm(x.shape[0], generator=gen)[:bs].to(x.device)
        batches.append((x[idx], y[idx]))
    model, loss = build_model(cfg, torch.float32, dev)
    base_algo = build_algorithm(cfg.optimizer, Objective(model, loss), data)

    cfg = compose([*common, f"optimizer={fosi_name}", *(fosi_overrides or [])])
    out["fosi_overrides"] = list(fosi_overrides or [])
    profile_T = int(cfg.optimizer.ese_period)
    cfg.optimizer.ese_warmup = 10**9  # no ESE inside the timed steps
    torch.manual_seed(0)
    model, loss = build_model(cfg, torch.float32, dev)
    algo = build_algorithm(cfg.optimizer, Objective(model, loss), data)
    fosi = algo.fosi
    algo.step(batches[0])  # state exists before the basis is installed
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    ese_times = []
    for _ in range(ese_repeats):
        clock = _clock(dev)
        t0 = clock()
        result = fosi.run_ese()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ese_times.append(clock() - t0)
    out["ese_ok"] = result is not None
    base_times, fosi_times = _interleaved_step_times(base_algo, algo, batches, 3, dev)
    out["clock"] = "process_time" if _clock(dev) is time.process_time else "perf_counter"
    out["tau1_s"] = statistics.median(base_times)
    out["tau2_s"] = statistics.median(fosi_times)
    # the first ESE of a process also pays torch.func's one-time set-up (0.3-0.9 s, which is 100-300
    # LR steps); with --ese-repeats > 1, tau3 is the steady-state cost of the later ones
    out["tau3_first_s"] = ese_times[0]
    out["tau3_s"] = statistics.median(ese_times[1:] if len(ese_times) > 1 else ese_times)
    out["tau1_min_s"], out["tau2_min_s"], out["tau3_min_s"] = min(base_times), min(fosi_times), min(ese_times)
    t1, t2, t3 = out["tau1_s"], out["tau2_s"], out["tau3_s"]
    out["num_params"] = fosi.n
    out["profile_T"] = profile_T
    out["rho_T800"] = (t2 + t3 / 800) / t1
    out["rho_profile_T"] = (t2 + t3 / profile_T) / t1
    out["step_ratio"] = t2 / t1
    out["ese_in_steps"] = t3 / t1
    denom = 1.1 * t1 - t2
    out["T_for_rho_1.1"] = t3 / denom if denom > 0 else float("inf")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="quick", choices=["quick", "paper"])
    p.add_argument("--tasks", nargs="+", default=list(analysis.TASKS), choices=list(analysis.TASKS))
    p.add_argument("--bases", nargs="+", default=["heavy_ball", "adam"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ese-repeats", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared CPU)")
    p.add_argument(
        "--fosi-overrides",
        nargs="*",
        default=[],
        help="Hydra overrides for the FOSI runs only, e.g. optimizer.hvp_mode=reverse_over_reverse",
    )
    p.add_argument("--out", default=str(REPO_ROOT / "results" / "tables"))
    p.add_argument(
        "--tag", default="", help="suffix of the output file name (fosi_overhead_<profile><tag>.json)"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data_dir = Path(os.environ.get("CURVOPT_DATA_DIR", REPO_ROOT / "data"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fosi_overhead_{args.profile}{args.tag}.json"
    # The rows already in the file stay, in their order: re-measuring one task must not drop the
    # others' measurements; a re-measured (task, base) replaces its row once measured (a crash keeps
    # the old one), and a new pair is appended.
    previous = json.loads(path.read_text()) if path.exists() else []
    rows: list[dict] = []

    def merged() -> list[dict]:
        new = {(r["task"], r["base"]): r for r in rows}
        out = [new.pop((r.get("task"), r.get("base")), r) for r in previous]
        return out + list(new.values())

    for key in args.tasks:
        task = analysis.TASKS[key]
        problem = data_problem(task, data_dir)
        if problem is not None:
            print(f"[skip {key}] {problem.splitlines()[0]}")
            continue
        for base in args.bases:
            row = measure(
                task, base, args.profile, args.steps, args.device, args.ese_repeats, args.fosi_overrides
            )
            row["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            rows.append(row)
            print(
                f"{key.upper():3s} {base:10s} n={row['num_params']:>8d} tau1={1e3 * row['tau1_s']:8.2f} ms "
                f"tau2={1e3 * row['tau2_s']:8.2f} ms tau3={row['tau3_s']:7.2f} s (= {row['ese_in_steps']:.0f} steps) "
                f"rho(T=800)={row['rho_T800']:.3f} rho(T_profile={row['profile_T']})={row['rho_profile_T']:.3f} "
                f"T*(rho=1.1)={row['T_for_rho_1.1']:.0f}",
                flush=True,
            )
            path.write_text(
                json.dumps(merged(), indent=1)
            )  # after every row: a later crash (OOM) keeps these
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
