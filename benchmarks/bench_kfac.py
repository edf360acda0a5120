"""K-FAC's input factors Ā on the FOSI AE task: the im2col reference against the fast path.

    python -m benchmarks.bench_kfac                  # batch 256 (the paper's), 5 rounds
    python -m benchmarks.bench_kfac --batch 64 --rounds 3

For each Kronecker block of the convolutional autoencoder (CIFAR-10 shapes, random inputs), one
capture forward, then, interleaved and median over rounds:

* ``reference``: ``rows = activation_rows(...)`` (``F.unfold`` of the zero-dilated input for
  transposed convolutions, a transposed copy, a concatenated column of ones) and
  ``rows.t() @ rows / M``: the factor as the module defines it and as it was computed before the
  fast path;
* ``fast``: ``input_factor`` (both in ``curvopt.curvature.kfac_factors``: channels-last patches
  gathered once, the bias from column sums, and for strided transposed convolutions only the taps
  that meet input pixels);
* ``quad model``: the 2×2 curvature matrix of the adaptive lr/momentum fit, from two GGN-vector
  products (JVP + VJP each, as before) against ``Objective.ggn_gram`` (two JVPs);
* ``step``: one whole K-FAC step (adaptive lr/momentum, factors every step), for the share.

Both factors are compared (max abs difference) so a fast path that drifts is seen here too. The
ratio is what to read; absolute times depend on the machine and its load (recorded). Writes
results/benchmarks/kfac.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from curvopt.curvature.kfac_factors import activation_rows, input_factor
from curvopt.models.conv_ae import conv_autoencoder
from curvopt.objective import Objective
from curvopt.optim.kfac import KFAC

ROOT = Path(__file__).resolve().parents[1]


def _timed(fn) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "benchmarks" / "kfac.json")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.rounds < 1:
        ap.error("--batch and --rounds must be positive")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = conv_autoencoder()
    x = torch.rand(args.batch, 3, 32, 32) * 2 - 1
    kfac = KFAC(Objective(model, "squared_error"), lr="adaptive", momentum="adaptive")
    kfac._capturing = True
    with torch.no_grad():
        model(x)
    kfac._capturing = False
    blocks = [b for b in kfac.blocks if b.kind != "diag"]

    def reference(b):
        rows = activation_rows(b.kind, b.module, b.inputs, b.has_bias)
        return rows.t() @ rows / rows.shape[0]

    def fast(b):
        return input_factor(b.kind, b.module, b.inputs, b.has_bias)

    per_block = []
    for b in blocks:
        ref_t, fast_t = [], []
        for _ in range(args.rounds):
            ref_t.append(_timed(lambda b=b: reference(b)))
            fast_t.append(_timed(lambda b=b: fast(b)))
        err = float((reference(b) - fast(b)).abs().max())
        scale = float(reference(b).abs().max())
        per_block.append(
            {
                "block": b.name,
                "kind": b.kind,
                "dim": int(fast(b).shape[0]),
                "reference_s": statistics.median(ref_t),
                "fast_s": statistics.median(fast_t),
                "max_abs_diff_rel": err / scale if scale else err,
            }
        )
    for b in kfac.blocks:
        b.inputs = None
    steps = [_timed(lambda: kfac.step((x, x))) for _ in range(max(2, args.rounds // 2))]

    # the quadratic model's curvature on the two update directions (Δ and the previous δ)
    obj = kfac._curv_objective
    params = {n: p.detach() for n, p in zip(kfac.names, kfac.params, strict=True)}
    vs = [{n: torch.randn_like(p) for n, p in params.items()} for _ in range(2)]

    def via_products():
        cv = [obj.ggn_vp(params, x, x, v) for v in vs]
        return torch.tensor(
            [[sum(float((vs[i][n] * cv[j][n]).sum()) for n in params) for j in range(2)] for i in range(2)]
        )

    qm_ref, qm_fast = [], []
    for _ in range(args.rounds):
        qm_ref.append(_timed(via_products))
        qm_fast.append(_timed(lambda: obj.ggn_gram(params, x, x, vs)))
    qm_diff = float(
        (via_products() - obj.ggn_gram(params, x, x, vs)).abs().max() / via_products().abs().max()
    )
    ref_total = sum(r["reference_s"] for r in per_block)
    fast_total = sum(r["fast_s"] for r in per_block)
    out = {
        "benchmark": "kfac_input_factor",
        "model": "conv_autoencoder (FOSI AE, CIFAR-10 shapes)",
        "batch": args.batch,
        "rounds": args.rounds,
        "threads": args.threads,
        "clock": "thread_time",
        "torch": torch.__version__,
        "loadavg": os.getloadavg(),
        "blocks": per_block,
        "reference_total_s": ref_total,
        "fast_total_s": fast_total,
        "speedup": ref_total / fast_total,
        "quad_model_ggn_vp_s": statistics.median(qm_ref),
        "quad_model_ggn_gram_s": statistics.median(qm_fast),
        "quad_model_speedup": statistics.median(qm_ref) / statistics.median(qm_fast),
        "quad_model_max_diff_rel": qm_diff,
        "kfac_step_s": statistics.median(steps),
        "note": "kfac_step_s uses both fast paths; the factors' share is fast_total_s / kfac_step_s",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for r in per_block:
        print(
            f"{r['block']:<14} {r['kind']:<6} d={r['dim']:<4} reference {r['reference_s'] * 1e3:8.1f} ms  "
            f"fast {r['fast_s'] * 1e3:7.1f} ms  x{r['reference_s'] / r['fast_s']:5.1f}  diff {r['max_abs_diff_rel']:.1e}"
        )
    print(
        f"all input factors: reference {ref_total:.3f} s, fast {fast_total:.3f} s (x{out['speedup']:.1f}); "
        f"one K-FAC step (fast paths) {out['kfac_step_s']:.3f} s -> {args.out}"
    )
    print(
        f"quadratic model on 2 directions: ggn_vp {out['quad_model_ggn_vp_s']:.3f} s, ggn_gram "
        f"{out['quad_model_ggn_gram_s']:.3f} s (x{out['quad_model_speedup']:.1f}, diff {qm_diff:.1e})"
    )
    return out


if __name__ == "__main__":
    main()
