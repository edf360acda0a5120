"""FOSI cost against its base optimizer (issue #5 performance targets).

    python -m benchmarks.bench_fosi                 # AE 2.8M + MLP 1M, bases HB/Adam/GD
    python -m benchmarks.bench_fosi --rounds 10 --models autoencoder --bases adam

For each model (random data, batch 300):

* ``base step`` / ``fosi step``: one loop step (forward, backward, optimizer) of the base optimizer
  and of FOSI *without* an ESE (V̂ installed, k = 10), measured interleaved, median over rounds.
  Target: fosi/base ≤ 1.1.
* ``grad``: one forward+backward; ``ese``: one ESE (m = 40 Lanczos iterations on the ESE batch)
  in units of ``grad``; target ≤ 4 per Lanczos iteration (≤ 160 for m = 40). All re-orthogonalisation
  modes are timed and their eigenvalues compared (the cut must not cost accuracy).
* ``reorth``: the re-orthogonalisation alone (Lanczos on an O(n) diagonal operator) for ours
  (``twice`` / ``dgks`` / ``partial``) and the authors' scheme (two passes against the whole m × n basis).
* ``amortised``: (τ_fosi + τ_ese / T) / τ_base for T = 800; target ≤ 1.25.

Other processes may share the CPU: the JSON records the load average. Writes
results/benchmarks/fosi.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from curvopt.curvature.lanczos import lanczos
from curvopt.models.mlp import autoencoder, mlp
from curvopt.objective import Objective, mean_loss
from curvopt.optim.fosi import FOSI, make_base_optimizer
from curvopt.optim.fosi_adapter import FOSIAlgorithm
from curvopt.training.algorithm import TorchOptimizerAlgorithm

ROOT = Path(__file__).resolve().parents[1]

REORTH = ("twice", "dgks", "partial")  # re-orthogonalisation modes timed
BASE_LR = {"heavy_ball": 1e-3, "adam": 1e-3, "gd": 1e-2}
DEFAULTS = {"hvp_mode": "forward_over_reverse", "reorth": "partial"}  # FOSI's defaults


def make_model(name: str, batch: int, seed: int = 0):
    torch.manual_seed(seed)
    if name == "autoencoder":
        model = autoencoder([784, 1000, 500, 250, 30], activation="sigmoid")
        x = torch.rand(batch, 784)
        return model, "squared_error", x, x
    model = mlp([784, 1000, 200, 10], activation="relu")
    return model, "cross_entropy", torch.randn(batch, 784), torch.randint(0, 10, (batch,))


CLOCK = {"clock": time.perf_counter}


def timed(fn) -> float:
    """Seconds of ``fn()`` on the chosen clock: wall time, or this thread's CPU time (``--clock
    cpu`` with one torch thread: insensitive to other processes queueing for the cores)."""
    clock = CLOCK["clock"]
    t0 = clock()
    fn()
    return clock() - t0


def reorth_cost(n: int, m: int = 40) -> dict[str, float]:
    """Lanczos on a diagonal operator (an O(n) product): what remains is re-orthogonalisation."""
    d = torch.linspace(0.0, 1.0, n, dtype=torch.float64)
    out = {}
    for mode in REORTH:
        out[mode] = timed(lambda mode=mode: lanczos(lambda v: d * v, n, 10, num_iters=m, reorth=mode))
    # the same with a float32 operator (as in an ESE on a float32 model): its rounding puts partial
    # above √ε after every step, so it then projects every vector
    d32 = d.float()
    out["partial_f32_operator"] = timed(
        lambda: lanczos(lambda v: d32 * v, n, 10, num_iters=m, reorth="partial", operator_dtype=torch.float32)
    )

    def authors() -> None:  # two passes against the full zero-initialised m × n basis per iteration
        Q = torch.zeros(m, n, dtype=torch.float64)
        q = torch.randn(n, dtype=torch.float64)
        Q[0] = q / q.norm()
        for i in range(m - 1):
            w = d * Q[i]
            for _ in range(2):
                w -= Q.T @ (Q @ w)
            Q[i + 1] = w / w.norm()

    out["authors"] = timed(authors)
    return out


def bench_model(name: str, bases: list[str], rounds: int, batch: int, k: int, period: int) -> dict:
    model, loss, x, y = make_model(name, batch)
    n = sum(p.numel() for p in model.parameters())
    objective = Objective(model, loss)
    state0 = {kk: v.clone() for kk, v in model.state_dict().items()}

    def grad_eval() -> None:
        model.zero_grad(set_to_none=True)
        mean_loss(model(x), y, loss).backward()

    for _ in range(2):
        grad_eval()
    t_grad = statistics.median(timed(grad_eval) for _ in range(max(3, rounds // 2)))

    # one ESE per (Hessian-product mode, re-orthogonalisation mode); the base does not matter
    ese, lam, passes = {}, {}, {}
    for key in [f"{h}/{r}" for h in ("forward_over_reverse", "reverse_over_reverse") for r in REORTH]:
        hvp_mode, reorth = key.split("/")
        base = make_base_optimizer("heavy_ball", model.parameters(), 1e-3)
        fosi = FOSI(
            base,
            lambda out, yy: mean_loss(out, yy, loss),
            (x, y),
            model=model,
            k=k,
            ese_period=period,
            reorth=reorth,
            hvp_mode=hvp_mode,
        )
        box = {}
        ese[key] = timed(lambda fosi=fosi, box=box: box.update(res=fosi.run_ese()))
        res = box["res"]
        lam[key], passes[key], m = res.eigenvalues, res.reorth_passes, res.iterations
    default_key = f"{DEFAULTS['hvp_mode']}/{DEFAULTS['reorth']}"
    # one product alone (reused point, as inside an ESE), to split the ESE into products and
    # re-orthogonalisation; and the one-off set-up of the reused product
    v = torch.randn(n)
    t_hvp, t_setup = {}, {}
    for hvp_mode in ("forward_over_reverse", "reverse_over_reverse"):
        fosi.hvp_mode = hvp_mode
        box = {}
        t_setup[hvp_mode] = timed(lambda box=box: box.update(h=fosi._hvp((x, y))))
        hvp = box["h"]
        hvp(v)
        t_hvp[hvp_mode] = statistics.median(timed(lambda hvp=hvp: hvp(v)) for _ in range(3))
    ref = lam["forward_over_reverse/twice"]
    rel_diff = max(float(((val - ref).abs() / ref.abs()).max()) for val in lam.values())
    # the floor of a FOSI step: two bare passes over V̂ (V̂g and θ += V̂ᵀc), as gemv on the blocks
    V = torch.randn(k, n)
    blocks = list(torch.split(V, [p.numel() for p in model.parameters()], dim=1))
    flats = [torch.randn(p.numel()) for p in model.parameters()]

    def two_passes() -> None:
        c = torch.zeros(k)
        for b, f in zip(blocks, flats):
            c.addmv_(b, f)
        for b, f in zip(blocks, flats):
            f.addmv_(b.T, c, alpha=1e-12)

    two_passes()
    t_floor = statistics.median(timed(two_passes) for _ in range(5))

    rows = []
    for base_name in bases:
        model.load_state_dict(state0)
        lr = BASE_LR[base_name]
        base_algo = TorchOptimizerAlgorithm(objective, make_base_optimizer(base_name, model.parameters(), lr))
        fosi_opt = FOSI(
            make_base_optimizer(base_name, model.parameters(), lr),
            lambda out, yy: mean_loss(out, yy, loss),
            (x, y),
            model=model,
            k=k,
            ese_period=period,
        )
        fosi_opt.set_basis(fosi.V.clone(), fosi.eigenvalues.clone())  # skip a third ESE: same basis
        fosi_algo = FOSIAlgorithm(objective, fosi_opt)
        for _ in range(2):
            base_algo.step((x, y))
            fosi_algo.step((x, y))
        tb, tf = [], []
        for _ in range(rounds):  # interleaved, so background load hits both alike
            tb.append(timed(lambda a=base_algo: a.step((x, y))))
            tf.append(timed(lambda a=fosi_algo: a.step((x, y))))
        t_base, t_fosi = statistics.median(tb), statistics.median(tf)
        ese_s = ese[default_key]
        rows.append(
            {
                "base": base_name,
                "fast_path": fosi_opt._fast_path_kind() is not None,
                "base_step_s": t_base,
                "fosi_step_s": t_fosi,
                "fosi_over_base": t_fosi / t_base,
                "amortised_over_base": (t_fosi + ese_s / period) / t_base,
                "two_pass_floor_over_base": (t_base + t_floor) / t_base,
            }
        )
    return {
        "model": name,
        "params": n,
        "batch": batch,
        "k": k,
        "lanczos_iters": m,
        "grad_s": t_grad,
        "hvp_s": t_hvp,
        "hvp_over_grad": {mode: t / t_grad for mode, t in t_hvp.items()},
        "hvp_setup_over_grad": {mode: t / t_grad for mode, t in t_setup.items()},
        "ese_default": default_key,
        "ese_s": ese,
        "ese_grads": {key: t / t_grad for key, t in ese.items()},
        "ese_grads_per_iter": {key: t / t_grad / m for key, t in ese.items()},
        "reorth_passes": passes,
        "eigenvalue_max_rel_diff_between_modes": rel_diff,
        "lambda_hat": ref.tolist(),
        "two_pass_floor_s": t_floor,
        "reorth_s": reorth_cost(n, m),
        "steps": rows,
    }


def report(meta: dict, results: list[dict], args: argparse.Namespace) -> None:
    load = meta["loadavg_before"][0], meta["loadavg_after"][0]
    print(
        f"FOSI benchmark (torch {meta['torch']}, {meta['threads']} thread(s), {meta['clock']} clock, "
        f"load {load[0]:.1f} -> {load[1]:.1f}); T = {args.period}"
    )
    for r in results:
        print(
            f"\n{r['model']}: {r['params'] / 1e6:.2f}M params, batch {r['batch']}, k = {r['k']}, "
            f"m = {r['lanczos_iters']}, gradient {1e3 * r['grad_s']:.1f} ms"
        )
        for mode, g in r["hvp_over_grad"].items():
            print(
                f"  Hessian product {mode}: {g:.2f} grads per product "
                f"(+{r['hvp_setup_over_grad'][mode]:.1f} grads set-up per ESE)"
            )
        for key in r["ese_s"]:
            mark = "  <- default" if key == r["ese_default"] else ""
            print(
                f"  ESE [{key:31s}] {r['ese_s'][key]:5.1f} s = {r['ese_grads'][key]:4.0f} grads "
                f"= {r['ese_grads_per_iter'][key]:.2f} grads/iter, {r['reorth_passes'][key]} GS passes{mark}"
            )
        ro = r["reorth_s"]
        print(
            f"  re-orthogonalisation alone: ours twice {ro['twice']:.2f} s, dgks {ro['dgks']:.2f} s, "
            f"partial {ro['partial']:.2f} s (float32 operator {ro['partial_f32_operator']:.2f} s), "
            f"authors' full-basis {ro['authors']:.2f} s; "
            f"λ̂ max rel diff between ESE modes "
            f"{r['eigenvalue_max_rel_diff_between_modes']:.1e}"
        )
        print(
            f"  {'base':11s} {'base ms':>8s} {'fosi ms':>8s} {'fosi/base':>9s} {'amortised':>9s} "
            f"{'2-pass floor':>12s}  path"
        )
        for s in r["steps"]:
            print(
                f"  {s['base']:11s} {1e3 * s['base_step_s']:8.1f} {1e3 * s['fosi_step_s']:8.1f} "
                f"{s['fosi_over_base']:9.3f} {s['amortised_over_base']:9.3f} "
                f"{s['two_pass_floor_over_base']:12.3f}  {'sgd-fast' if s['fast_path'] else 'generic'}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["autoencoder", "mlp"], choices=["autoencoder", "mlp"])
    parser.add_argument("--bases", nargs="+", default=["heavy_ball", "adam", "gd"], choices=list(BASE_LR))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=300)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--period", type=int, default=800, help="T for the amortised ratio")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: thread CPU time with 1 torch thread (for a CPU shared with other jobs)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "benchmarks" / "fosi.json")
    args = parser.parse_args()
    if args.clock == "cpu":
        CLOCK["clock"] = time.thread_time
        torch.set_num_threads(1)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = [
        bench_model(m, args.bases, args.rounds, args.batch_size, args.k, args.period) for m in args.models
    ]
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "cpu_count": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "rounds": args.rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")

    report(meta, results, args)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
