"""Dispatched ops and host reads of the curvature solvers on the MNIST autoencoder (issue 41, item 4).

    python -m benchmarks.dispatch_solvers                      # n = 300, 2,000, 6,000 (minutes on a CPU)
    python -m benchmarks.dispatch_solvers --ns 300 --out x.json

On a GPU a solver iteration waits on the host when it dispatches many small ops (≈ 9.75 µs each on
an H200, :data:`curvopt.profiling.US_PER_OP_H200`) or reads a device value back (each read drains
the launch queue). Both counts depend on the code, not on the device, so they are taken here on the
CPU with :class:`curvopt.profiling.DispatchCounter`, on the real solver paths:

* ``hf_cg CG iteration``: one iteration of Martens' CG inside ``HFCG._solve`` (the damped
  Gauss-Newton product of ``HFCG._ggn_operator``, the diagonal preconditioner, φ and the stopping
  test): the counts of a solve of ``k + 1`` iterations minus those of ``k`` iterations;
* ``hf_cg solve``: a whole ``HFCG._solve`` of ``solve_iters`` iterations (warm start included), so
  the fixed cost per solve is ``solve − iterations × iteration``;
* ``shf LSMR iteration`` / ``shf LSMR solve``: the same for ``SHF._solve`` (Chapelle-Erhan
  preconditioner, warm start, the default ``damping_center="zero"`` operator, the validation merit
  at its scheduled iterations).

Host reads are the counter's (``.item()``, ``float()`` of a tensor, ...) plus every
``Tensor.tolist()`` call, which dispatches no op on a CPU tensor and is counted by patching it.
``flops`` is an fp32 estimate of the row's arithmetic (matrix products and vector passes), so
``flops / device rate`` is a floor time. The data are synthetic, of MNIST's shape (784 inputs in
[0, 1]); op counts do not depend on the data or on ``n``.

``benchmarks/dispatch_solvers_before.json`` holds the rows of the code before issue 41's solver
changes (commit 779e61e9), for the before/after table.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

from curvopt.api import DataBundle  # noqa: E402
from curvopt.models.mlp import autoencoder  # noqa: E402
from curvopt.objective import Objective  # noqa: E402
from curvopt.profiling import DispatchCounter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENCODER = [784, 1000, 500, 250, 30]
SIZES = ENCODER + list(reversed(ENCODER[:-1]))  # 784-1000-500-250-30-250-500-1000-784
NUM_PARAMS = sum(a * b + b for a, b in zip(SIZES[:-1], SIZES[1:]))


def count(fn: Callable[[], Any]) -> dict[str, int]:
    """Run ``fn()`` once and return its ops, views, kernels and host reads (``tolist`` included).

    Args:
        fn: A callable without arguments.

    Returns:
        ``{"ops", "views", "kernels", "host_reads"}``.
    """
    with DispatchCounter() as counter:  # Tensor.tolist() calls count as host reads
        fn()
    return {
        "ops": counter.ops,
        "views": counter.views,
        "kernels": counter.kernels,
        "host_reads": counter.host_reads,
    }


def _diff(a: dict[str, int], b: dict[str, int], k: int) -> dict[str, int]:
    return {key: (b[key] - a[key]) // k for key in a}


def _layers() -> list[tuple[int, int]]:
    return list(zip(SIZES[:-1], SIZES[1:]))


def jvp_flops(n: int) -> int:
    """fp32 FLOPs of one ``J v`` of the hand-written MLP products at batch ``n``.

    Per layer ``S_{ℓ−1} dWᵀ`` and, after the first, ``F Wᵀ`` (2·n·in·out FLOPs each), plus the
    activation factor.

    Args:
        n: Batch size.

    Returns:
        The FLOP count.
    """
    return sum((1 if i == 0 else 2) * 2 * n * a * b + 2 * n * b for i, (a, b) in enumerate(_layers()))


def vjp_flops(n: int) -> int:
    """fp32 FLOPs of one ``Jᵀ U``: per layer ``Fᵀ S_{ℓ−1}`` and, after the first, ``F W``.

    Args:
        n: Batch size.

    Returns:
        The FLOP count.
    """
    return sum((1 if i == 0 else 2) * 2 * n * a * b + 2 * n * b for i, (a, b) in enumerate(_layers()))


def gn_product_flops(n: int) -> int:
    """fp32 FLOPs of one ``Jᵀ(J v)`` pair at batch ``n`` (:func:`jvp_flops` + :func:`vjp_flops`).

    Args:
        n: Batch size.

    Returns:
        The FLOP count.
    """
    return jvp_flops(n) + vjp_flops(n)


def moments_flops(n: int) -> int:
    """fp32 FLOPs of the per-example moments (Chapelle-Erhan's estimate): 3 matmuls per layer but one.

    Args:
        n: Batch size.

    Returns:
        The FLOP count.
    """
    return sum((2 if i == 0 else 3) * 2 * n * a * b + 4 * n * b for i, (a, b) in enumerate(_layers()))


def forward_flops(n: int) -> int:
    """fp32 FLOPs of one forward pass of the autoencoder on ``n`` rows (the merit's cost).

    Args:
        n: Rows.

    Returns:
        The FLOP count.
    """
    return sum(2 * n * a * b + 4 * n * b for a, b in _layers())


def _hfcg(n: int, dtype: torch.dtype = torch.float32) -> tuple[Any, Any, dict[str, Any]]:
    """Martens' setting: linear code layer, logits + sigmoid cross-entropy, sparse init."""
    from curvopt.optim.hf_cg import HFCG, weight_mask

    torch.manual_seed(0)
    model = autoencoder(ENCODER, code_activation=None, output_activation=None, init="sparse")
    obj = Objective(model.to(dtype=dtype), "sigmoid_bce")
    gen = torch.Generator().manual_seed(n)
    x = torch.rand(n, 784, generator=gen, dtype=dtype)
    alg = HFCG(obj, DataBundle(train=(x, x)), numchunks=1, shuffle=False)
    params = obj.params()
    numel = sum(p.numel() for p in params.values())
    ctx = {
        "params": params,
        "x": x,
        "mask": weight_mask(params),
        "g": torch.randn(numel, generator=gen, dtype=dtype) * 1e-2,
        "precond": torch.rand(numel, generator=gen, dtype=dtype).add_(0.5),
        "x0": torch.randn(numel, generator=gen, dtype=dtype) * 1e-3,
    }
    return alg, obj, ctx


def hfcg_rows(n: int, k: int = 3, solve_iters: int = 10) -> list[dict[str, Any]]:
    """The ``hf_cg CG iteration`` and ``hf_cg solve`` rows at chunk size ``n``.

    Args:
        n: Examples in the curvature chunk.
        k: The iteration row is ``solve(k + 1) − solve(k)`` (both below the first stored iterate, 5).
        solve_iters: Iterations of the solve row.

    Returns:
        Two rows.
    """
    alg, _, ctx = _hfcg(n)
    gv = alg._ggn_operator(ctx["params"], ctx["x"], ctx["x"])

    def solve(iters: int) -> Callable[[], Any]:
        def run() -> Any:
            alg.cfg["cg_maxiter"], alg.cfg["cg_miniter"] = iters, 10**9
            alg.prev_solution = ctx["x0"]
            res = alg._solve(gv, ctx["g"], ctx["precond"], ctx["mask"], 1.0)
            assert res.iterations == iters, (res.iterations, res.stop_reason)
            return res

        return run

    p = NUM_PARAMS
    # damped product: G v + wc·mask·v + λ v (3 passes); the iteration's vector work: 4 float64 dots,
    # the x, r, p updates, the preconditioner division and φ's −b − r (≈ 17 passes)
    iter_flops = gn_product_flops(n) + 3 * p + 17 * p
    solve(k)()  # warm-up: the operator allocates its work buffers on first use
    a, b = count(solve(k)), count(solve(k + 1))
    it = {"name": "hf_cg CG iteration", "n": n, **_diff(a, b, 1), "iterations": 1, "flops": iter_flops}
    s = count(solve(solve_iters))
    warm = gn_product_flops(n) + 6 * p  # b − A x0 and the warm start's scaling
    row = {
        "name": "hf_cg solve",
        "n": n,
        **s,
        "iterations": solve_iters,
        "flops": solve_iters * iter_flops + warm,
    }
    return [it, row]


def _shf(n: int, num_val: int, dtype: torch.dtype = torch.float32) -> tuple[Any, dict[str, Any]]:
    """The SHF paper's setting: logistic everywhere, squared error, sparse init (10 / N(0, 1.5²))."""
    from curvopt.curvature.mlp_gn import residual_gauss_newton
    from curvopt.optim.shf import SHF

    torch.manual_seed(0)
    model = autoencoder(ENCODER, init="sparse", sparse_init_count=10, sparse_init_std=1.5)
    obj = Objective(model.to(dtype=dtype), "squared_error")
    gen = torch.Generator().manual_seed(n)
    x = torch.rand(n, 784, generator=gen, dtype=dtype)
    xv = torch.rand(num_val, 784, generator=gen, dtype=dtype)
    alg = SHF(obj, DataBundle(train=(x, x), val=(xv, xv)), batch_size=n, max_batch_size=max(n, 6000))
    params = obj.params()
    gn = residual_gauss_newton(obj, params, x, x, True)
    numel = gn.numel
    ctx = {
        "params": params,
        "gn": gn,
        "g": gn.gradient(),
        "warm_d": torch.randn(numel, generator=gen, dtype=dtype) * 1e-3,
    }
    return alg, ctx


def shf_rows(n: int, k: int = 3, solve_iters: int = 10, num_val: int = 1000) -> list[dict[str, Any]]:
    """The ``shf LSMR iteration`` and ``shf LSMR solve`` rows at batch size ``n``.

    Args:
        n: Batch size (rows of the Gauss-Newton operator's batch).
        k: The iteration row is ``solve(k + 1) − solve(k)`` (both before the merit's first scheduled
            evaluation, at iteration 5).
        solve_iters: Iterations of the solve row (the merit is evaluated at 0, 5, 7, 9 and the last).
        num_val: Validation rows of the merit.

    Returns:
        Two rows.
    """
    alg, ctx = _shf(n, num_val)

    def solve(iters: int) -> Callable[[], Any]:
        def run() -> Any:
            alg.maxiter, alg.cfg["atol"] = iters, 0.0  # run exactly `iters` iterations
            alg.warm_d = ctx["warm_d"]
            res = alg._solve(ctx["gn"], ctx["params"], ctx["g"], n, {})[0]
            assert res.itn == iters, (res.itn, res.stop_reason)
            return res

        return run

    p, m = NUM_PARAMS, n * 784
    # J(c∘v) and c∘Jᵀu, the stacked [J; λI] operator's extra passes, 2 norms, the u/v updates and
    # the h̄, x, h updates (≈ 14 passes over P, 6 over the residual space)
    iter_flops = gn_product_flops(n) + 14 * p + 6 * m
    solve(k)()  # warm-up: the operator allocates its work buffers on first use
    a, b = count(solve(k)), count(solve(k + 1))
    it = {"name": "shf LSMR iteration", "n": n, **_diff(a, b, 1), "iterations": 1, "flops": iter_flops}
    s = count(solve(solve_iters))
    # fixed: the Chapelle-Erhan estimate, b − A x0, A^T u1, merit forwards at 0, 5, 7, 9 and 10
    fixed = moments_flops(n) + gn_product_flops(n) + 5 * forward_flops(num_val)
    row = {
        "name": "shf LSMR solve",
        "n": n,
        **s,
        "iterations": solve_iters,
        "flops": solve_iters * iter_flops + fixed,
    }
    return [it, row]


def solver_rows(ns: tuple[int, ...] = (300, 2000, 6000)) -> list[dict[str, Any]]:
    """Dispatch counts of HF-CG's CG and SHF's LSMR on the MNIST autoencoder, per iteration and solve.

    Args:
        ns: Batch sizes (HF-CG: the curvature chunk; SHF: the LSMR batch).

    Returns:
        Rows with keys ``name``, ``n``, ``ops``, ``views``, ``kernels``, ``host_reads``,
        ``iterations`` and ``flops`` (fp32 estimate), four per ``n``.
    """
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for n in ns:
        rows += hfcg_rows(n)
        rows += shf_rows(n)
    return rows


def main(argv: list[str] | None = None) -> None:
    """Command line: print the rows and write them as JSON.

    Args:
        argv: Arguments (``sys.argv[1:]`` when ``None``).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[300, 2000, 6000])
    parser.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    args = parser.parse_args(argv)
    rows = solver_rows(tuple(args.ns))
    for r in rows:
        print(
            f"{r['name']:<20} n={r['n']:>5}  ops {r['ops']:>6}  views {r['views']:>5}  kernels "
            f"{r['kernels']:>6}  host reads {r['host_reads']:>4}  iterations {r['iterations']:>3}  "
            f"GFLOP {r['flops'] / 1e9:8.2f}",
            flush=True,
        )
    if args.out:
        payload = {"benchmark": "dispatch_solvers", "torch": torch.__version__, "rows": rows}
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
