"""Start-point robustness of FOSI Figures 7-8: how often FOSI-Adam ends at or below Adam when the
eigenvector signs that fix θ₀ are drawn at random.

    python -m experiments.fosi_quadratics.robustness                 # 200 draws per cell, ~1 CPU-min
    python -m experiments.fosi_quadratics.robustness --draws 50

θ₀ of f_{b,ζ} is Σᵢ x₀′ᵢ qᵢ (x₀′ = ½·𝟙, x₀′[1] = 1; qᵢ the eigenvectors of H in ascending
order, ``quadratics.start_point``). An eigenvector's sign is arbitrary (eigh's choice), f(θ₀) does
not depend on it, but Adam's per-coordinate steps do. Each draw s ∈ {±1}ⁿ gives the start
θ₀(s) = Σᵢ sᵢ x₀′ᵢ qᵢ; for every (b, ζ) cell of the grid both optimizers run 200 iterations at the
paper's settings (η = 0.05, β = (0.9, 0.999), FOSI k = 10, one ESE; the Hessian is constant and
the Lanczos start vector is seeded, so the ESE does not depend on θ₀) from each of the same
``--draws`` sign vectors (``torch.Generator`` seed ``--seed``, shared by all cells).

Writes ``results/fosi_quadratics/start_point_robustness.json``: the settings and one row per cell
(draws, how many end with FOSI-Adam ≤ Adam, the share, the quartiles and the worst of the f(θ₂₀₀)
ratio FOSI-Adam / Adam over the draws, and whether the recorded start, eigh's signs, fails).
``figures.py fig7_robustness`` draws the map from it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402

from experiments.fosi_quadratics import quadratics as q  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECORD = "start_point_robustness.json"
ITERS = 200


def sign_draws(draws: int, n: int = 100, seed: int = 0) -> torch.Tensor:
    """(draws, n) random ±1 signs from ``torch.Generator().manual_seed(seed)``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (draws, n), generator=gen, dtype=q.F64) * 2 - 1


def signed_starts(H: torch.Tensor, signs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The start points θ₀(s) = Q diag(s) x₀′ for each row s of ``signs``, and θ₀ with eigh's signs.

    Returns ((draws, n), (n,)); the second equals ``quadratics.q3_problem(...).theta0``.
    """
    _, vecs = torch.linalg.eigh(H)
    x = torch.full((H.shape[0],), 0.5, dtype=q.F64)
    x[1] = 1.0
    return (signs * x) @ vecs.T, q.start_point(vecs)


def _ratio(ff: float, fa: float) -> float:
    if not math.isfinite(ff):
        return math.inf
    return ff / fa if fa > 0 else (1.0 if ff == fa else math.inf)


def run(draws: int = 200, seed: int = 0, chunk: int = 26) -> dict[str, Any]:
    """Adam and FOSI-Adam from ``draws`` signed starts in every cell of the Q3 grid."""
    bs, zetas = q.q3_grid()
    signs = sign_draws(draws, seed=seed)
    cells = [(float(b), int(z)) for z in zetas for b in bs]
    rules = ["adam"] * (draws + 1) + ["fosi_adam"] * (draws + 1)  # run 0 of each: eigh's signs
    rows = []
    t0 = time.perf_counter()
    for start in range(0, len(cells), chunk):
        part = cells[start : start + chunk]
        probs = [q.q3_problem(b, z) for b, z in part]
        eses = [q.ese(p, k=10) for p in probs]
        starts = []
        for p in probs:
            drawn, canonical = signed_starts(p.H, signs)
            th = torch.cat([canonical[None], drawn])
            starts.append(torch.cat([th, th]))
        f = q.run_batch(
            torch.stack([p.H for p in probs]),
            torch.stack(starts),
            rules,
            ITERS,
            q.ADAM_LR,
            0.9,
            eigenvalues=torch.stack([e.eigenvalues for e in eses]),
            eigenvectors=torch.stack([e.eigenvectors for e in eses]),
        )[:, :, -1].numpy()
        for (b, z), p, fc in zip(part, probs, f):
            fa, ff = fc[: draws + 1], fc[draws + 1 :]
            ratios = np.array([_ratio(float(x), float(y)) for x, y in zip(ff[1:], fa[1:])])
            ok = ratios <= 1.0
            rows.append(
                {
                    "b": round(b, 3),
                    "zeta": z,
                    "draws": draws,
                    "fosi_le_adam": int(ok.sum()),
                    "share_fosi_le_adam": float(ok.mean()),
                    "ratio_q25": float(np.quantile(ratios, 0.25)),
                    "ratio_median": float(np.median(ratios)),
                    "ratio_q75": float(np.quantile(ratios, 0.75)),
                    "ratio_max": float(ratios.max()),
                    "f0": float(p.f(p.theta0)),
                    "eigh_signs_adam_f200": float(fa[0]),
                    "eigh_signs_fosi_adam_f200": float(ff[0]),
                    "eigh_signs_fails": bool(_ratio(float(ff[0]), float(fa[0])) > 1.0),
                }
            )
        print(f"{start + len(part)}/{len(cells)} cells, {time.perf_counter() - t0:.0f} s", flush=True)
    return {
        "what": "share of random eigenvector-sign draws (start points) in which FOSI-Adam ends at or below Adam",
        "settings": {
            "iterations": ITERS,
            "adam_lr": q.ADAM_LR,
            "beta1": 0.9,
            "beta2": 0.999,
            "k": 10,
            "rotation": "legacy",
            "rotation_seed": 1234,
            "draws_per_cell": draws,
            "sign_seed": seed,
            "sign_generator": "torch.Generator().manual_seed(seed); the same draws in every cell",
            "start_point": "theta0(s) = sum_i s_i x0'_i q_i, q_i eigh's eigenvectors (ascending), "
            "x0' = 0.5 except x0'[1] = 1",
            "criterion": "f_FOSI-Adam(theta_200) <= f_Adam(theta_200)",
        },
        "cpu_seconds": time.process_time(),
        "cells": rows,
        "summary": summarize(rows),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts over the grid: cells failing with eigh's signs and their shares, and per-draw counts."""
    failing = [r for r in rows if r["eigh_signs_fails"]]
    shares = [r["share_fosi_le_adam"] for r in failing]
    fragile = [r for r in rows if r["share_fosi_le_adam"] < 1.0]
    return {
        "cells": len(rows),
        "draws_per_cell": rows[0]["draws"] if rows else 0,
        "cells_failing_eigh_signs": len(failing),
        "failing_eigh_signs_share_min": min(shares, default=math.nan),
        "failing_eigh_signs_share_max": max(shares, default=math.nan),
        "failing_eigh_signs_share_mean": float(np.mean(shares)) if shares else math.nan,
        "cells_with_any_failing_draw": len(fragile),
        "zeta_of_cells_with_any_failing_draw": sorted({r["zeta"] for r in fragile}),
        "share_min_over_grid": min((r["share_fosi_le_adam"] for r in rows), default=math.nan),
        "share_all_cells_and_draws": float(
            sum(r["fosi_le_adam"] for r in rows) / max(1, sum(r["draws"] for r in rows))
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results-dir", type=Path, default=REPO / "results" / "fosi_quadratics")
    parser.add_argument("--draws", type=int, default=200, help="random sign vectors per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    record = run(args.draws, args.seed)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / RECORD
    path.write_text(json.dumps(record, indent=1) + "\n")
    s = record["summary"]
    print(
        f"{path}: {s['cells']} cells x {s['draws_per_cell']} draws; {s['cells_failing_eigh_signs']} cells fail "
        f"with eigh's signs, FOSI-Adam <= Adam there in {s['failing_eigh_signs_share_min']:.0%}-"
        f"{s['failing_eigh_signs_share_max']:.0%} of draws; cells with any failing draw: "
        f"{s['cells_with_any_failing_draw']} (zeta {s['zeta_of_cells_with_any_failing_draw']})"
    )


if __name__ == "__main__":
    main()
