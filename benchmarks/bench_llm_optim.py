"""Optimizer step cost on the LLaMA-60M weight matrices (issue #7 performance targets).

The 56 block matrices of LLaMA-60M — 8 layers × [4 × 512×512 (q,k,v,o), 2 × 1376×512 (gate, up),
512×1376 (down)], fp32, as ``nn.Linear`` stores them — get the same fixed random gradients for
every method. Per method we time

* the plain step (median over ``--steps`` steps, after a warm-up),
* a refresh step (GaLore/Fira/APOLLO-svd: SVD; Alice: subspace iteration + switch), forced in
  steady state by setting the step counter, reported as its extra cost over a plain step,
* the amortised step over K = 200: ``(refresh + (K−1)·plain)/K``,
* optimizer-state bytes vs the state formula (``curvopt.optim.grouping.method_state_numel``).

Targets (2 cores): RACS ≤ 1.5× fused AdamW; Alice plain ≤ 1.5× GaLore plain; Alice refresh ≤
0.25× GaLore's SVD refresh; Alice amortised ≤ 1.5× GaLore amortised; state bytes = formula ± 1 %.

    python -m benchmarks.bench_llm_optim            # ~5 min
    python -m benchmarks.bench_llm_optim --quick    # < 2 min
Writes results/benchmarks/bench_llm_optim.{json,md,png} (``--device cuda``: results/benchmarks/cuda/). Other processes may share the CPU: the
load average is recorded with the results, and ``--threads 1`` (``--clock auto`` then times the
process's CPU time instead of the wall clock) gives ratios that contention barely moves.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from curvopt.optim.grouping import method_state_numel, optimizer_state_bytes

K = 200


def llama60m_shapes() -> list[tuple[int, int]]:
    shapes = []
    for _ in range(8):
        shapes += [(512, 512)] * 4 + [(1376, 512)] * 2 + [(512, 1376)]
    return shapes


def make_params(shapes, seed=0, device="cpu") -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same numbers on every device
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device)) for s in shapes]
    grads = [(torch.randn(s, generator=g) * 1e-3).to(device) for s in shapes]
    return params, grads


def build(method: str, params: list[torch.nn.Parameter], rank: int) -> torch.optim.Optimizer:
    from curvopt.optim import lowrank
    from curvopt.optim.alice import Alice
    from curvopt.optim.racs import RACS

    if method == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, fused=True)
    if method == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, foreach=True)
    if method == "racs":  # foreach=None: stacked on CUDA, per-matrix loop on the CPU
        return RACS(params, lr=0.02)
    if method in ("racs_loop", "racs_foreach"):  # both paths on the same device, for the ratio
        return RACS(params, lr=0.02, foreach=method == "racs_foreach")
    if method == "racs_compiled":  # the stacked update under torch.compile (first step compiles)
        return RACS(params, lr=0.02, compile=True)
    if method == "alice":  # foreach=None: plain steps stacked on CUDA, per-matrix loop on the CPU
        return Alice(params, lr=0.02, rank=rank, leading=40, update_interval=K)
    if method in ("alice_loop", "alice_foreach"):
        return Alice(
            params, lr=0.02, rank=rank, leading=40, update_interval=K, foreach=method == "alice_foreach"
        )
    if method == "alice_compiled":
        return Alice(params, lr=0.02, rank=rank, leading=40, update_interval=K, compile=True)
    if method == "alice0":
        return Alice(params, lr=0.02, rank=rank, leading=40, update_interval=K, betas=(0.9, 0.9, 0.0))
    if method == "galore":
        return lowrank.galore([], params, lr=0.02, rank=rank, update_proj_gap=K, scale=0.3)
    if method == "fira":
        return lowrank.fira([], params, lr=0.02, rank=rank, update_proj_gap=K, alpha=0.3)
    if method == "apollo":
        return lowrank.apollo([], params, lr=0.01, rank=rank, update_proj_gap=K)
    if method == "apollo_mini":
        return lowrank.apollo(
            [], params, lr=0.01, rank=1, scale_type="tensor", scale=128.0, update_proj_gap=K
        )
    if method == "kozistr_alice":
        from pytorch_optimizer import Alice as KAlice

        return KAlice(params, lr=0.02, rank=256, leading_basis=40, update_interval=K)
    raise ValueError(method)


def force_refresh_next(method: str, opt: torch.optim.Optimizer) -> bool:
    """Set every step counter so that the next step is a refresh (steady state, not t = 1)."""
    for st in opt.state.values():
        if method in ("alice", "alice0", "alice_loop", "alice_foreach", "alice_compiled"):
            st["step"] = 2 * K - 1  # next t = 2K ≡ 0 (mod K)
        elif method in ("galore", "fira", "apollo", "apollo_mini"):
            st["step"] = 2 * K  # upstream refreshes when the pre-increment step ≡ 0 (mod gap)
        else:
            return False
    if method == "kozistr_alice":
        return False
    return True


CLOCK = time.perf_counter  # set by main(): wall clock, or the process's CPU time (--clock process)
SYNC = lambda: None  # noqa: E731  set by main(): torch.cuda.synchronize on a GPU


def time_steps(opt, params, grads, n) -> list[float]:
    out = []
    for _ in range(n):
        for p, g in zip(params, grads):
            p.grad = g
        SYNC()
        t0 = CLOCK()
        opt.step()
        SYNC()
        out.append(CLOCK() - t0)
    return out


def count_syncs(step: Any) -> int:
    """Synchronising CUDA calls made by ``step()``: ``torch.cuda.set_sync_debug_mode("warn")`` warns
    on each (``.item()``, ``nonzero``, a copy to the host, a stream synchronisation); the host reads
    that ``make bench-dispatch`` counts on the CPU, confirmed on the device."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def formula_bytes(method: str, shapes, rank: int) -> int | None:
    key = {
        "adamw_fused": "adam",
        "adamw_foreach": "adam",
        "racs_loop": "racs",
        "racs_foreach": "racs",
        "racs_compiled": "racs",
        "alice_loop": "alice",
        "alice_foreach": "alice",
        "alice_compiled": "alice",
    }.get(method, method)
    if key == "kozistr_alice":
        return None
    total = 0
    for s in shapes:
        layout = method_state_numel(key, s, 1 if key == "apollo_mini" else rank)
        total += sum(n * (4 if fp32 else 4) for n, fp32 in layout.values())  # fp32 params here
    return total


def run(
    methods: list[str], steps: int, warmup: int, refreshes: int, rank: int, device: str = "cpu"
) -> list[dict[str, Any]]:
    shapes = llama60m_shapes()
    results = []
    for method in methods:
        params, grads = make_params(shapes, device=device)
        try:
            opt = build(method, params, rank)
        except ImportError as err:
            print(f"skip {method}: {err}")
            continue
        step_path = None
        if hasattr(opt, "_use_foreach"):  # RACS / Alice: which code path a plain step takes
            group = opt.param_groups[0]
            step_path = (
                "compiled"
                if group.get("compile")
                else "stacked"
                if opt._use_foreach(group, params)
                else "per-matrix"
            )
        first = time_steps(opt, params, grads, 1)[0]
        time_steps(opt, params, grads, warmup)
        plain = time_steps(opt, params, grads, steps)
        plain_ms = 1e3 * statistics.median(plain)
        refresh_ms = None
        if force_refresh_next(method, opt):
            rs = []
            for _ in range(refreshes):
                force_refresh_next(method, opt)
                rs.append(time_steps(opt, params, grads, 1)[0])
            refresh_ms = 1e3 * statistics.median(rs) - plain_ms  # extra cost of the refresh
        elif method == "kozistr_alice":
            refresh_ms = 1e3 * first - plain_ms  # its t = 1 step is a refresh
        amort = plain_ms + (refresh_ms or 0.0) / K
        syncs: dict[str, int] = {}
        if str(device).startswith("cuda"):
            one_step = functools.partial(time_steps, opt, params, grads, 1)
            syncs["sync_plain"] = count_syncs(one_step)
            if force_refresh_next(method, opt):
                syncs["sync_refresh"] = count_syncs(one_step)
        state = optimizer_state_bytes(opt)
        # Adam-type 'step' scalars and limiter norms are not in the formulas
        formula = formula_bytes(method, shapes, rank)
        row = {
            "method": method,
            "plain_ms": plain_ms,
            "plain_ms_all": [1e3 * x for x in plain],
            "refresh_extra_ms": refresh_ms,
            "amortised_ms": amort,
            "first_step_ms": 1e3 * first,
            "state_bytes": state,
            "formula_bytes": formula,
            "state_vs_formula": (state / formula - 1) if formula else None,
            **syncs,
            **({"step_path": step_path} if step_path else {}),
        }
        results.append(row)
        ref = f"{refresh_ms:9.1f}" if refresh_ms is not None else "        -"
        print(
            f"{method:14s} plain {plain_ms:8.1f} ms  refresh(+) {ref} ms  amortised {amort:8.1f} ms  state {state / 2**20:7.1f} MiB",
            flush=True,
        )
        del opt, params, grads
    return results


def targets(res: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []

    def add(name, value, limit):
        if value is not None:
            out.append({"target": name, "ratio": value, "limit": limit, "ok": value <= limit})

    if "racs" in res and "adamw_fused" in res:
        add("RACS / fused AdamW (plain)", res["racs"]["plain_ms"] / res["adamw_fused"]["plain_ms"], 1.5)
    for key, label in (("racs", "RACS"), ("alice", "Alice")):  # informational: no target of their own
        if f"{key}_foreach" in res and f"{key}_loop" in res:
            ratio = res[f"{key}_foreach"]["plain_ms"] / res[f"{key}_loop"]["plain_ms"]
            out.append(
                {"target": f"{label} foreach / per-matrix loop (plain; information)", "ratio": ratio,
                 "limit": None, "ok": None}
            )  # fmt: skip
    if "alice" in res and "galore" in res:
        a, g = res["alice"], res["galore"]
        add("Alice / GaLore (plain)", a["plain_ms"] / g["plain_ms"], 1.5)
        if a["refresh_extra_ms"] and g["refresh_extra_ms"]:
            add("Alice / GaLore (refresh)", a["refresh_extra_ms"] / g["refresh_extra_ms"], 0.25)
        add("Alice / GaLore (amortised K=200)", a["amortised_ms"] / g["amortised_ms"], 1.5)
    if "alice" in res and "kozistr_alice" in res:  # pytorch-optimizer's Alice runs at rank 256
        a, k = res["alice"], res["kozistr_alice"]
        add(
            "Alice / pytorch-optimizer Alice (plain; same rank only with --rank 256)",
            a["plain_ms"] / k["plain_ms"],
            1 / 3,
        )
        add("Alice / pytorch-optimizer Alice (amortised)", a["amortised_ms"] / k["amortised_ms"], 1 / 3)
    for name, r in res.items():
        if r["state_vs_formula"] is not None:
            add(f"{name} |state/formula − 1|", abs(r["state_vs_formula"]), 0.01)
    return out


def plot(results: list[dict[str, Any]], path: Path, gpu: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in results]
    plain = [r["plain_ms"] for r in results]
    amort = [r["amortised_ms"] for r in results]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], plain, width=0.4, label="plain step")
    ax.bar([i + 0.2 for i in x], amort, width=0.4, label=f"amortised (K={K})")
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("ms per step")
    where = gpu or f"{torch.get_num_threads()} threads, CPU"
    ax.set_title(f"LLaMA-60M matrices, {where}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="few steps, no pytorch-optimizer comparison (< 2 min)"
    )
    parser.add_argument("--methods", nargs="*", default=None)
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--clock",
        default="auto",
        choices=["auto", "wall", "process"],
        help="wall: perf_counter; process: CPU time of this process (robust when other processes share "
        "the cores; meaningful with --threads 1); auto: process with one thread on the CPU, else wall",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (CUDA: wall clock with synchronisation)")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="default results/benchmarks (CPU) or results/benchmarks/<device> (e.g. cuda)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here; run without --device for the CPU")
    out_dir = args.out_dir or Path("results/benchmarks") / ("" if device.type == "cpu" else device.type)
    torch.set_num_threads(args.threads)
    if device.type == "cuda" and args.clock == "process":
        parser.error("--clock process counts CPU seconds only; on a GPU use --clock wall (or auto)")
    auto = "wall" if device.type == "cuda" or args.threads != 1 else "process"
    clock = args.clock if args.clock != "auto" else auto
    global CLOCK, SYNC
    CLOCK = time.process_time if clock == "process" else time.perf_counter
    if device.type == "cuda":
        SYNC = torch.cuda.synchronize
    methods = args.methods or [
        "adamw_fused",
        "adamw_foreach",
        "racs",
        "racs_loop",
        "racs_foreach",
        "alice",
        "alice_loop",
        "alice_foreach",
        "alice0",
        "galore",
        "fira",
        "apollo",
        "apollo_mini",
        *([] if args.quick else ["kozistr_alice"]),
    ]
    steps, warmup, refreshes = (3, 1, 1) if args.quick else (10, 2, 3)
    load = os.getloadavg()[0]
    print(
        f"threads {args.threads}, clock {clock}, load average {load:.2f} (other processes may share the CPU)"
    )
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    results = run(methods, steps, warmup, refreshes, args.rank, str(device))
    by = {r["method"]: r for r in results}
    checks = targets(by)
    lines = [
        f"# Optimizer step cost on the LLaMA-60M matrices ({'quick' if args.quick else 'full'} run)",
        "",
        f"`benchmarks/bench_llm_optim.py{' --quick' if args.quick else ''} --threads {args.threads} "
        f"--clock {clock}{'' if device.type == 'cpu' else ' --device ' + args.device}`, rank {args.rank}, "
        f"K = {K}, torch {torch.__version__}, device {device_name}, "
        f"1-min load average {load:.2f} at the start (a shared CPU: wall-clock times are contended; "
        "the process clock counts this process's CPU time only; on a GPU: CUDA-synchronised wall clock).",
        "",
        "| method | plain ms | refresh extra ms | amortised ms | state MiB | state/formula−1 |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        ref = f"{r['refresh_extra_ms']:.0f}" if r["refresh_extra_ms"] is not None else "–"
        sv = f"{100 * r['state_vs_formula']:+.3f}%" if r["state_vs_formula"] is not None else "–"
        lines.append(
            f"| {r['method']} | {r['plain_ms']:.1f} | {ref} | {r['amortised_ms']:.1f} | {r['state_bytes'] / 2**20:.1f} | {sv} |"
        )
    if any("sync_plain" in r for r in results):
        lines += [
            "",
            "Synchronising CUDA calls in one step (`torch.cuda.set_sync_debug_mode('warn')`; "
            "`make bench-dispatch` counts the host reads on the CPU):",
            "",
            "| method | plain step | refresh step |",
            "|---|---|---|",
        ]
        lines += [
            f"| {r['method']} | {r['sync_plain']} | {r.get('sync_refresh', '–')} |"
            for r in results
            if "sync_plain" in r
        ]
    lines += ["", "| target | ratio | limit | ok |", "|---|---|---|---|"]
    for c in checks:
        lines.append(
            f"| {c['target']} | {c['ratio']:.3f} | {'–' if c['limit'] is None else format(c['limit'], '.3g')} "
            f"| {'–' if c['ok'] is None else 'yes' if c['ok'] else 'NO'} |"
        )
    print("\n" + "\n".join(lines))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_llm_optim.md").write_text("\n".join(lines) + "\n")
    payload = {
        "benchmark": "bench_llm_optim",
        "quick": args.quick,
        "threads": args.threads,
        "clock": clock,
        "rank": args.rank,
        "K": K,
        "load_average_1m": load,
        "machine": platform.machine(),
        "device": device.type,
        "device_name": device_name,
        "torch": torch.__version__,
        "results": results,
        "targets": checks,
    }
    (out_dir / "bench_llm_optim.json").write_text(json.dumps(payload, indent=2))
    plot(results, out_dir / "bench_llm_optim.png", device_name if device.type == "cuda" else None)
    print(f"wrote {out_dir / 'bench_llm_optim.json'}, .md and .png")


if __name__ == "__main__":
    main()
