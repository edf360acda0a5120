"""Cost of SHF-LSMR's building blocks on the MNIST autoencoder (784-1000-500-250-30, random data).

    OPENBLAS_NUM_THREADS=1 python -m benchmarks.bench_shf --sizes 300 2000 [--with-6000] [--dtype float64]

Per batch size n, minimum (or ``--stat median``) over ``--reps`` timings (seconds):

* ``grad``: one mini-batch gradient (autograd forward + backward, ``zero_grad(set_to_none=True)``
  as optimizers do: the first-order baseline); ``grad_hand``: the same from the cached
  hand-written forward + Algorithm 5;
* ``setup_<path>``: building the Gauss-Newton operator (cached forward; torch.func: forward with
  the VJP closure plus the ``linearize`` trace on the first J·v);
* ``jvp_vjp_<path>``: one J·v plus one Jᵀ·u with the operator built (``hand`` = paper Algorithms
  4/5, ``func`` = torch.func);
* ``gnv_amortised_<path>``: one GN·v = Jᵀ(Jv) with the set-up spread over ``--amortise`` products;
* ``lsmr_iter_ours`` / ``lsmr_iter_scipy``: one preconditioned LSMR iteration (``--lsmr-iters``
  iterations, divided), ours on torch tensors as SHF runs it (operator A·diag(c) applied per
  layer) vs ``scipy.sparse.linalg.lsmr`` on a ``LinearOperator`` wrapping the same hand-written
  products (numpy ⇄ torch conversions included, as a user would have them);
  ``lsmr_iter_ours_precond_arg``: ours with ``precond=c`` on the plain operator.

Targets (issue): LSMR iteration ≤ 1.3 × JVP+VJP; ours ≤ 0.9 × SciPy per iteration; GN·v (amortised)
≤ 1.4 × gradient. Writes results/benchmarks/shf.json. The CPU may be shared: the load average is
recorded next to the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from curvopt.curvature.lsmr import lsmr  # noqa: E402
from curvopt.curvature.mlp_gn import FuncGaussNewton, MLPGaussNewton  # noqa: E402
from curvopt.models.mlp import autoencoder  # noqa: E402
from curvopt.objective import Objective, mean_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


STAT = {"name": "min", "clock": time.perf_counter}


def timeit(fn, reps: int, device: torch.device, warmup: int = 1) -> float:
    """Minimum (default; the least disturbed by other processes on a shared CPU) or median."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t = STAT["clock"]()
        fn()
        _sync(device)
        times.append(STAT["clock"]() - t)
    return min(times) if STAT["name"] == "min" else statistics.median(times)


def _time_products(op, path, v, u, jv_out, vj_out, reps, device) -> dict:
    """J·v, Jᵀ·u, both, and GN·v, writing into reused output buffers as LSMR and SHF call them."""

    def jvp(w):
        return op.jvp(w, out=jv_out)

    def vjp(r):
        return op.vjp(r, out=vj_out)

    return {
        f"jvp_{path}": timeit(lambda: jvp(v), reps, device),
        f"vjp_{path}": timeit(lambda: vjp(u), reps, device),
        f"jvp_vjp_{path}": timeit(lambda: (jvp(v), vjp(u)), reps, device),
        f"gnv_{path}": timeit(lambda: vjp(jvp(v)), reps, device),
    }


def bench_size(obj: Objective, n: int, args, device, dtype) -> dict:
    g = torch.Generator(device=device).manual_seed(n)
    x = torch.rand(n, 784, generator=g, device=device, dtype=dtype)
    params = obj.params()
    numel = sum(p.numel() for p in params.values())
    v = torch.randn(numel, generator=g, device=device, dtype=dtype)
    u = torch.randn(n, 784, generator=g, device=device, dtype=dtype)
    row: dict = {"n": n, "num_params": numel}

    def grad_once():
        obj.model.zero_grad(set_to_none=True)
        mean_loss(obj.model(x), x, "squared_error").backward()

    row["grad"] = timeit(grad_once, args.reps, device)
    obj.model.zero_grad(set_to_none=True)

    def func_setup():
        op = FuncGaussNewton(obj, params, x, x)
        op.jvp(v)  # builds the linearize trace
        return op

    row["grad_hand"] = timeit(lambda: MLPGaussNewton(obj, params, x, x).gradient(), args.reps, device)

    makers = {"hand": lambda: MLPGaussNewton(obj, params, x, x), "func": func_setup}
    ops = {}
    jv_out, vj_out = torch.empty_like(u), torch.empty_like(v)
    for path, make in makers.items():
        if path == "func" and args.skip_func:
            continue
        row[f"setup_{path}"] = timeit(make, max(1, args.reps // 2), device)
        op = ops[path] = make()
        row.update(_time_products(op, path, v, u, jv_out, vj_out, args.reps, device))
        row[f"gnv_amortised_{path}"] = row[f"gnv_{path}"] + row[f"setup_{path}"] / args.amortise
        row[f"gnv_amortised_over_grad_{path}"] = row[f"gnv_amortised_{path}"] / row["grad"]

    op = ops["hand"]
    c = 1.0 / (1.0 + op.gn_diag_estimate(torch.Generator(device=device).manual_seed(0)).sqrt())
    b = -op.residual.reshape(-1)
    k = args.lsmr_iters
    jv_buf, vj_buf = torch.empty_like(op.residual), torch.empty_like(v)
    # as SHF calls it: the operator applies the preconditioner per layer (A·diag(c))
    A = (
        lambda w: op.jvp(w, out=jv_buf, col_scale=c).reshape(-1),
        lambda r: op.vjp(r.view(n, -1), out=vj_buf, col_scale=c),
        (b.numel(), numel),
    )
    A_plain = (
        lambda w: op.jvp(w, out=jv_buf).reshape(-1),
        lambda r: op.vjp(r.view(n, -1), out=vj_buf),
        (b.numel(), numel),
    )

    def ours():
        res = lsmr(A, b, damp=1.0, atol=0.0, btol=0.0, conlim=0.0, maxiter=k)
        assert res.itn == k, res.stop_reason

    def ours_precond_arg():
        res = lsmr(A_plain, b, damp=1.0, atol=0.0, btol=0.0, conlim=0.0, maxiter=k, precond=c)
        assert res.itn == k, res.stop_reason

    row["lsmr_iter_ours_precond_arg"] = timeit(ours_precond_arg, max(1, args.reps // 2), device) / k

    row["lsmr_iter_ours"] = timeit(ours, max(1, args.reps // 2), device) / k

    import scipy.sparse.linalg as spla

    c_np = c.cpu().double().numpy()

    def mv(w):
        t = torch.from_numpy(np.ascontiguousarray(w * c_np)).to(device=device, dtype=dtype)
        return op.jvp(t).reshape(-1).cpu().double().numpy()

    def rmv(r):
        t = torch.from_numpy(np.ascontiguousarray(r)).to(device=device, dtype=dtype)
        return op.vjp(t.view(n, -1)).cpu().double().numpy() * c_np

    linop = spla.LinearOperator((b.numel(), numel), matvec=mv, rmatvec=rmv, dtype=np.float64)
    b_np = b.cpu().double().numpy()

    def scipy_run():
        out = spla.lsmr(linop, b_np, damp=1.0, atol=0.0, btol=0.0, conlim=0.0, maxiter=k)
        assert out[2] == k

    row["lsmr_iter_scipy"] = timeit(scipy_run, max(1, args.reps // 2), device) / k
    row["lsmr_iter_over_jvp_vjp"] = row["lsmr_iter_ours"] / row["jvp_vjp_hand"]
    row["ours_over_scipy"] = row["lsmr_iter_ours"] / row["lsmr_iter_scipy"]
    if "jvp_vjp_func" in row:
        row["func_over_hand_jvp_vjp"] = row["jvp_vjp_func"] / row["jvp_vjp_hand"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[300, 2000])
    parser.add_argument("--with-6000", action="store_true", help="also n = 6000 (MNIST's n_max)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--lsmr-iters", type=int, default=10)
    parser.add_argument("--amortise", type=int, default=50, help="GN products sharing one set-up")
    parser.add_argument("--skip-func", action="store_true", help="skip the torch.func path")
    parser.add_argument("--out", default=str(ROOT / "results" / "benchmarks" / "shf.json"))
    parser.add_argument("--stat", choices=["min", "median"], default="min", help="statistic over reps")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument(
        "--clock",
        choices=["wall", "process"],
        default="wall",
        help="process = CPU time of this process (with --threads 1: robust to other load on a shared CPU)",
    )
    args = parser.parse_args()
    STAT["name"] = args.stat
    if args.clock == "process":
        STAT["clock"] = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = autoencoder([784, 1000, 500, 250, 30], init="sparse", sparse_init_count=10, sparse_init_std=1.5)
    obj = Objective(model.to(device=device, dtype=dtype), "squared_error")
    sizes = list(args.sizes) + ([6000] if args.with_6000 else [])
    rows = []
    load_before = os.getloadavg()
    for n in sizes:
        rows.append(bench_size(obj, n, args, device, dtype))
        r = rows[-1]
        print(f"n={n} done ({r['lsmr_iter_ours']:.4f}s per LSMR iteration)", flush=True)
    load_after = os.getloadavg()

    cols = [
        ("grad", "grad"),
        ("jvp+vjp hand", "jvp_vjp_hand"),
        ("jvp+vjp func", "jvp_vjp_func"),
        ("setup hand", "setup_hand"),
        ("setup func", "setup_func"),
        ("GNv am. hand", "gnv_amortised_hand"),
        ("GNv am. func", "gnv_amortised_func"),
        ("LSMR it ours", "lsmr_iter_ours"),
        ("LSMR it c-arg", "lsmr_iter_ours_precond_arg"),
        ("LSMR it scipy", "lsmr_iter_scipy"),
    ]
    print(
        f"\nSHF building blocks, {args.dtype} on {device} ({torch.get_num_threads()} threads), "
        f"seconds ({args.stat} over {args.reps} reps, {args.clock} clock)"
    )
    print(f"{'n':>6} " + " ".join(f"{name:>13}" for name, _ in cols))
    for r in rows:
        print(f"{r['n']:>6} " + " ".join(f"{r.get(key, float('nan')):>13.4f}" for _, key in cols))
    print("\nratios (targets: LSMR/JVP+VJP <= 1.3, ours/scipy <= 0.9, GNv(am.)/grad <= 1.4)")
    for r in rows:
        print(
            f"n={r['n']:>5}: LSMR it / JVP+VJP = {r['lsmr_iter_over_jvp_vjp']:.2f}, ours / scipy = "
            f"{r['ours_over_scipy']:.2f}, GNv(am.) / grad: hand {r['gnv_amortised_over_grad_hand']:.2f}"
            + (
                f", func {r['gnv_amortised_over_grad_func']:.2f}"
                if "gnv_amortised_over_grad_func" in r
                else ""
            )
            + (
                f"; func / hand JVP+VJP = {r['func_over_hand_jvp_vjp']:.2f}"
                if "func_over_hand_jvp_vjp" in r
                else ""
            )
        )
    print(f"load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f} on {os.cpu_count()} CPUs")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "shf_building_blocks",
        "model": "784-1000-500-250-30 mirrored logistic autoencoder, sparse init, random data",
        "dtype": args.dtype,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "reps": args.reps,
        "statistic": args.stat,
        "clock": args.clock,
        "lsmr_iters": args.lsmr_iters,
        "amortise": args.amortise,
        "rows": rows,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
