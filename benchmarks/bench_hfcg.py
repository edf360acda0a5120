"""Where one HF-CG conjugate-gradient iteration's time goes (MNIST autoencoder, one chunk of n cases).

    python -m benchmarks.bench_hfcg --device cuda --sizes 6250          # the MNIST paper chunk
    python -m benchmarks.bench_hfcg --sizes 300 --iters 10 --reps 2      # a CPU check in seconds

On an H200 an MNIST HF-CG paper run spends 6.1 ms per CG iteration at n = 6,250 (the smoke-probe
slice), while one Gauss-Newton product at n = 6,000 takes 3.5 ms (``bench_shf``). This splits the
iteration, per n (seconds, minimum over ``--reps``):

* ``gv``: HF-CG's own Gauss-Newton product (``HFCG._ggn_operator``, the cached MLP products);
* ``damped``: the product CG calls, ``G v + wc·mask·v + λ v``;
* ``cg_iter``: one iteration of ``martens_cg`` with that operator and a diagonal preconditioner,
  run for exactly ``--iters`` iterations (``progress_tol = 0``: the progress test never stops it);
* ``cg_rest``: the same solve with a free operator (``v ↦ c ⊙ v``, a precomputed positive ``c``):
  the iteration's vector work, float64 dot products, host synchronisations and the
  progress bookkeeping without the product;
* ``syncs_per_iter``: device-to-host reads per iteration (:class:`curvopt.profiling.DispatchCounter`'s
  host reads: scalar reads and the ``Tensor.tolist()`` CG uses for its one stacked read), each a
  synchronisation on a GPU.

The loss is squared error on random data (the network and its products are the paper's; the
output nonlinearity changes only an element-wise factor). Writes ``results/benchmarks/hfcg.json``
(``--out``); on a GPU, ``results/benchmarks/cuda/hfcg.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

from curvopt.curvature.cg import martens_cg  # noqa: E402
from curvopt.models.mlp import autoencoder  # noqa: E402
from curvopt.objective import Objective  # noqa: E402
from curvopt.optim.hf_cg import HFCG, weight_mask  # noqa: E402
from curvopt.profiling import DispatchCounter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _timeit(fn, reps: int, device: torch.device) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(n: int, iters: int, reps: int, device: torch.device, dtype: torch.dtype) -> dict:
    """The row of the module docstring for chunk size ``n``."""
    torch.manual_seed(0)
    model = autoencoder([784, 1000, 500, 250, 30], init="sparse", sparse_init_count=10, sparse_init_std=1.5)
    obj = Objective(model.to(device=device, dtype=dtype), "squared_error")
    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.rand(n, 784, generator=gen, device=device, dtype=dtype)
    alg = HFCG(obj, _bundle(x), numchunks=1, shuffle=False)
    params = obj.params()
    gv = alg._ggn_operator(params, x, x)
    mask = weight_mask(params)
    wc, lam = alg.cfg["weight_cost"], 1.0
    numel = mask.numel()
    v = torch.randn(numel, generator=gen, device=device, dtype=dtype)
    b = torch.randn(numel, generator=gen, device=device, dtype=dtype)
    precond = torch.rand(numel, generator=gen, device=device, dtype=dtype).add_(0.5)
    diag = torch.rand(numel, generator=gen, device=device, dtype=dtype).add_(0.5)

    def damped(w):
        return gv(w).add_(w * mask, alpha=wc).add_(w, alpha=lam)

    def solve(op):
        return martens_cg(op, b, precond=precond, maxiter=iters, miniter=iters, progress_tol=0.0)

    row: dict = {"n": n, "num_params": numel, "iters": iters}
    row["gv"] = _timeit(lambda: gv(v), reps, device)
    row["damped"] = _timeit(lambda: damped(v), reps, device)
    row["cg_iter"] = _timeit(lambda: solve(damped), reps, device) / iters
    row["cg_rest"] = _timeit(lambda: solve(lambda w: w * diag), reps, device) / iters
    with DispatchCounter() as counter:  # scalar reads, masks and Tensor.tolist() calls
        res = solve(lambda w: w * diag)
    row["syncs_per_iter"] = counter.host_reads / max(res.iterations, 1)
    row["product_share"] = row["damped"] / row["cg_iter"]
    return row


def _bundle(x: torch.Tensor):
    from curvopt.api import DataBundle

    return DataBundle(train=(x, x))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 6250])
    parser.add_argument("--iters", type=int, default=50, help="CG iterations per timed solve")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for n in args.sizes:
        rows.append(measure(n, args.iters, args.reps, device, dtype))
        r = rows[-1]
        print(
            f"n={n}: GN product {1e3 * r['gv']:.3f} ms, damped {1e3 * r['damped']:.3f} ms, CG iteration "
            f"{1e3 * r['cg_iter']:.3f} ms (rest without the product {1e3 * r['cg_rest']:.3f} ms), "
            f"{r['syncs_per_iter']:.1f} host reads per iteration",
            flush=True,
        )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    payload = {
        "benchmark": "hfcg_cg_iteration",
        "device": device.type,
        "device_name": name,
        "dtype": args.dtype,
        "tf32": torch.backends.cuda.matmul.allow_tf32 if device.type == "cuda" else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "clock": "wall (CUDA-synchronised)" if device.type == "cuda" else "wall",
        "load_average_1m": os.getloadavg()[0],
        "platform": platform.platform(),
        "rows": rows,
    }
    default = (
        ROOT
        / "results"
        / "benchmarks"
        / ("hfcg.json" if device.type == "cpu" else f"{device.type}/hfcg.json")
    )
    out = Path(args.out) if args.out else default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
