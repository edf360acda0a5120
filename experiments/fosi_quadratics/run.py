"""Run the FOSI paper's quadratic experiments and write one run record per optimizer/setting.

    python -m experiments.fosi_quadratics.run all            # Q1–Q4 (a minute or two on 2 cores)
    python -m experiments.fosi_quadratics.run q1 q2          # some of them

Records go to ``results/fosi_quadratics/<experiment>/<run>/{config.yaml, metrics.jsonl,
summary.json}`` through the loop's ``RunRecorder`` (one ``{"step": t, "f": f(θ_t)}`` row per
iteration, t = 0..200 or 250); at the end each experiment is packed into
``<experiment>/{metrics.parquet, runs.jsonl}`` (``curvopt.analysis.pack``; ``--no-pack`` keeps the
run directories), so ~4,400 runs are two files each. ``figures.py`` draws Figures 3, 4, 7, 8, 9
from these records only.
By default (``--curves plotted``) the runs no figure draws as a curve (Q3 outside the four Fig. 8
functions, all of Q4: Figs 7 and 9 use f(θ₂₀₀)) keep only the rows t = 0 and t = last, so the
records stay small enough to commit; ``--curves all`` writes every iteration of every run.

Experiments (paper §4.3, A.4, B.2; docs/fosi.md, "Quadratic experiments"; the settings are the paper's,
there is no quick profile):

* ``q1_fig3``: n ∈ {100, 1500} × λ₁ ∈ {5, 10, 20, 50, 200} × 6 optimizers, 200 iterations.
* ``q2_fig4``: GD vs FOSI-GD (k = 9, α = 1, η = 0.001 for both), 250 iterations.
* ``q3_fig7_fig8``: the (b, ζ) grid (20 × 26 functions) × 6 optimizers, 200 iterations.
* ``q4_fig9_lr``: f_{1.12,90}, 120 learning rates × 8 optimizers (c = 1 and c = ∞), β = 0.9.
* ``q4_fig9_momentum``: f_{1.12,90}, 50 learning rates × 5 optimizers; each run holds the curves
  for all 40 momenta β ∈ [0.7, 1) as columns ``f_beta_<β>`` and ``f`` = the best β's curve
  (smallest f(θ₂₀₀), NaN counted as +∞).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

# numpy/scipy (OpenBLAS) threads fight torch's on a shared CPU: 10x slower QR in special_ortho_group
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from curvopt.analysis.pack import (  # noqa: E402
    PACKED_METRICS,
    PACKED_RUNS,
    experiments_under,
    loose_run_dirs,
    pack_experiment,
)
from curvopt.training.records import RunRecorder, environment_info, git_commit  # noqa: E402
from experiments.fosi_quadratics import quadratics as q  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = ("q1", "q2", "q3", "q4")
ROOT_NAME = "fosi_quadratics"
Q4_FUNCTION = (1.12, 90)
FIG8_FUNCTIONS = ((1.12, 90), (1.16, 90), (1.12, 50), (1.16, 50))  # the learning curves of Fig. 8
Q4_OPTIMIZERS_LR = (
    "adam",
    "fosi_adam",
    "hb",
    "fosi_hb_c1",
    "fosi_hb_cinf",
    "gd",
    "fosi_gd_c1",
    "fosi_gd_cinf",
)
Q4_OPTIMIZERS_MOMENTUM = ("adam", "fosi_adam", "hb", "fosi_hb_c1", "fosi_hb_cinf")


_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def _json_number(x: float) -> str:
    """A float as RunRecorder writes it: JSON number, or the strings "nan"/"inf"/"-inf"."""
    return repr(x) if math.isfinite(x) else f'"{x}"'


def _finite_or_inf(x: float) -> float:
    return x if math.isfinite(x) else math.inf


class RecordWriter:
    """One experiment's records: ``<root>/<experiment>/<run_id>/``."""

    def __init__(self, root: Path, experiment: str, curves: str = "plotted") -> None:
        self.dir = root / experiment
        self.experiment = experiment
        self.curves = curves
        self.commit = git_commit(REPO)
        self.env = environment_info(torch.device("cpu"))
        self.count = 0

    def write(
        self,
        run_id: str,
        config: dict[str, Any],
        curves: dict[str, np.ndarray],
        summary: dict[str, Any],
        plotted: bool = True,
    ) -> None:
        """``curves['f']`` (and any extra columns) hold one value per iteration. A run whose curve
        no figure draws (``plotted=False``) keeps only the rows t = 0 and t = last in its
        metrics.jsonl unless the writer was made with ``curves="all"`` (the full Q3/Q4 records are
        ~110 MB; the figures use f(θ₂₀₀) of those runs only)."""
        rec = RunRecorder(self.dir / run_id)
        try:
            full_config = {"experiment": self.experiment, "run_id": run_id, "profile": "paper", **config}
            rec.write_config(yaml.dump(full_config, Dumper=_Dumper, sort_keys=False))
            # the recorder's row format, written in one go (600k rows for Q3; per-row flushes
            # would dominate the whole experiment)
            keys = list(curves)
            columns = [[_json_number(x) for x in curves[k].tolist()] for k in keys]
            last = len(columns[0]) - 1
            full = plotted or self.curves == "all"
            steps = range(last + 1) if full else (0, last)
            lines = [
                "{"
                + ", ".join([f'"step": {t}'] + [f'"{k}": {col[t]}' for k, col in zip(keys, columns)])
                + "}\n"
                for t in steps
            ]
            rec.close()
            rec.metrics_path.write_text("".join(lines))
            f = curves["f"]
            rec.write_summary(
                {
                    "status": "completed",
                    "experiment": self.experiment,
                    "run_id": run_id,
                    "setting": config,
                    "f_initial": float(f[0]),
                    "f_final": float(f[-1]),
                    "iterations": len(f) - 1,
                    "diverged": bool(not np.isfinite(f[-1]) or f[-1] > f[0]),
                    "metrics_rows": "every iteration" if full else f"t = 0 and {last} only",
                    "git_commit": self.commit,
                    "environment": self.env,
                    **summary,
                }
            )
        finally:
            rec.close()
        self.count += 1


def _fosi_lr(name: str, base: float, scale: float) -> float:
    """FOSI-GD/-HB take the base lr × λ̂₁/λ̂_k (c = ∞); FOSI-Adam never scales."""
    return base * scale if name in ("fosi_gd", "fosi_hb") else base


def _ese_config(e: q.ESEResult, k: int) -> dict[str, Any]:
    return {
        "k": k,
        "l": 0,
        "lanczos_iters": 4 * k,
        "lanczos_seed": 0,
        "lambda_hat_1": float(e.eigenvalues[-1]),
        "lambda_hat_k": float(e.eigenvalues[0]),
    }


def run_q1(root: Path, curves: str = "plotted") -> int:
    out = RecordWriter(root, "q1_fig3", curves)
    for n in (100, 1500):
        for lam1 in (5, 10, 20, 50, 200):
            p = q.q1_problem(n, lam1)
            e = q.ese(p, k=10)
            bases = [q.base_lr(name, p.eigenvalues) for name in q.OPTIMIZERS]
            lrs = [_fosi_lr(name, base, e.scale) for name, base in zip(q.OPTIMIZERS, bases)]
            f_all = q.run_batch(
                p.H,
                p.theta0,
                q.OPTIMIZERS,
                200,
                torch.tensor(lrs),
                0.9,
                eigenvalues=e.eigenvalues,
                eigenvectors=e.eigenvectors,
            )[0]
            for j, name in enumerate(q.OPTIMIZERS):
                cfg = {
                    "figure": 3,
                    "optimizer": name,
                    "label": q.LABELS[name],
                    "n": n,
                    "lambda1": lam1,
                    "base_lr": bases[j],
                    "lr": lrs[j],
                    "lr_scale": lrs[j] / bases[j],
                    "beta": 0.9,
                    "beta2": 0.999,
                    "iterations": 200,
                    "dtype": "float64",
                    **(_ese_config(e, 10) if name.startswith("fosi") else {}),
                }
                out.write(f"n{n}_lambda{lam1}_{name}", cfg, {"f": f_all[j].numpy()}, {})
    return out.count


def run_q2(root: Path, curves: str = "plotted") -> int:
    out = RecordWriter(root, "q2_fig4", curves)
    p = q.q2_problem()
    e = q.ese(p, k=9)
    kappa = float(p.eigenvalues[0] / p.eigenvalues[-1])
    f_all = q.run_batch(
        p.H, p.theta0, ["gd", "fosi_gd"], 250, 1e-3, eigenvalues=e.eigenvalues, eigenvectors=e.eigenvectors
    )[0]
    for j, name in enumerate(("gd", "fosi_gd")):
        f = f_all[j]
        cfg = {
            "figure": 4,
            "optimizer": name,
            "label": q.LABELS[name],
            "n": 100,
            "lr": 1e-3,
            "alpha": 1.0,
            "iterations": 250,
            "dtype": "float64",
            "condition_number": kappa,
            **(_ese_config(e, 9) if name == "fosi_gd" else {}),
        }
        if name == "fosi_gd":
            # Lemma 4 case 3: α > ηλ_{k+1}, so κ̃ = α/(ηλ_n) = 1/(0.001·0.01) = 1e5 > κ = 1e3
            cfg["effective_condition_number"] = 1.0 / (1e-3 * float(p.eigenvalues[-1]))
        out.write(name, cfg, {"f": f.numpy()}, {})
    return out.count


def run_q3(root: Path, curves: str = "plotted", rotation: str = "legacy") -> int:
    out = RecordWriter(root, "q3_fig7_fig8", curves)
    bs, zetas = q.q3_grid()
    problems, eses, settings = [], [], []
    for zeta in zetas:
        for b in bs:
            p = q.q3_problem(float(b), int(zeta), rotation=rotation)
            problems.append(p)
            eses.append(q.ese(p, k=10))
            settings.append((float(b), int(zeta)))
    H = torch.stack([p.H for p in problems])
    theta0 = torch.stack([p.theta0 for p in problems])
    evals = torch.stack([e.eigenvalues for e in eses])
    evecs = torch.stack([e.eigenvectors for e in eses])
    scales = torch.tensor([e.scale for e in eses], dtype=torch.float64)
    base = torch.tensor([[q.base_lr(name, p.eigenvalues) for name in q.OPTIMIZERS] for p in problems])
    scaled = torch.tensor([name in ("fosi_gd", "fosi_hb") for name in q.OPTIMIZERS])
    lr = torch.where(scaled, base * scales[:, None], base)  # (functions, optimizers)
    f_all = q.run_batch(H, theta0, q.OPTIMIZERS, 200, lr, 0.9, eigenvalues=evals, eigenvectors=evecs).numpy()
    for j, name in enumerate(q.OPTIMIZERS):
        for i, (b, zeta) in enumerate(settings):
            cfg = {
                "figure": "7,8",
                "optimizer": name,
                "label": q.LABELS[name],
                "n": 100,
                "b": round(b, 6),
                "zeta": zeta,
                "base_lr": float(base[i, j]),
                "lr": float(lr[i, j]),
                "beta": 0.9,
                "beta2": 0.999,
                "iterations": 200,
                "dtype": "float64",
                "rotation_seed": 1234,
                "rotation": rotation,
                **(_ese_config(eses[i], 10) if name.startswith("fosi") else {}),
            }
            plotted = (round(b, 3), zeta) in FIG8_FUNCTIONS
            out.write(f"b{b:.3f}_zeta{zeta:03d}_{name}", cfg, {"f": f_all[i, j]}, {}, plotted=plotted)
    return out.count


def _q4_rule(opt: str) -> tuple[str, bool]:
    """(update rule, whether the lr is scaled by λ̂₁/λ̂₁₀) of a Fig. 9 optimizer name."""
    if opt.endswith("_cinf"):
        return opt[: -len("_cinf")], True
    if opt.endswith("_c1"):
        return opt[: -len("_c1")], False
    return opt, False


def run_q4(root: Path, curves: str = "plotted", rotation: str = "legacy") -> int:
    b, zeta = Q4_FUNCTION
    p = q.q3_problem(b, zeta, rotation=rotation)
    e = q.ese(p, k=10)
    count = 0
    # (a) fixed momentum 0.9
    etas = np.concatenate(
        (np.logspace(-5, -1, 50), np.linspace(0.10001, 1.0, 50), np.linspace(1.1, 10.0, 20))
    )
    out = RecordWriter(root, "q4_fig9_lr", curves)
    rules, lrs = [], []
    for opt in Q4_OPTIMIZERS_LR:
        rule, scaled = _q4_rule(opt)
        rules += [rule] * len(etas)
        lrs += [float(eta) * (e.scale if scaled else 1.0) for eta in etas]
    f_all = q.run_batch(
        p.H,
        p.theta0,
        rules,
        200,
        torch.tensor(lrs),
        0.9,
        eigenvalues=e.eigenvalues,
        eigenvectors=e.eigenvectors,
    )[0].numpy()
    for j, opt in enumerate(Q4_OPTIMIZERS_LR):
        rule, scaled = _q4_rule(opt)
        for i, eta in enumerate(etas):
            row = j * len(etas) + i
            cfg = {
                "figure": "9a",
                "optimizer": opt,
                "rule": rule,
                "c": "inf" if scaled else 1,
                "b": b,
                "zeta": zeta,
                "rotation": rotation,
                "eta": float(eta),
                "lr": lrs[row],
                "beta": 0.9,
                "beta2": 0.999,
                "iterations": 200,
                "dtype": "float64",
                **(_ese_config(e, 10) if rule.startswith("fosi") else {}),
            }
            out.write(f"{opt}_eta{i:03d}", cfg, {"f": f_all[row]}, {}, plotted=False)
    count += out.count
    # (b) best momentum in [0.7, 1)
    etas = np.logspace(-4, 1, 50)
    betas = np.linspace(0.7, 1.0, 40, endpoint=False)
    out = RecordWriter(root, "q4_fig9_momentum", curves)
    eta_grid, beta_grid = np.meshgrid(etas, betas, indexing="ij")  # (50, 40)
    rules, lrs, moms = [], [], []
    for opt in Q4_OPTIMIZERS_MOMENTUM:
        rule, scaled = _q4_rule(opt)
        rules += [rule] * eta_grid.size
        lrs += list(eta_grid.reshape(-1) * (e.scale if scaled else 1.0))
        moms += list(beta_grid.reshape(-1))
    f_all = q.run_batch(
        p.H,
        p.theta0,
        rules,
        200,
        torch.tensor(lrs),
        torch.tensor(moms),
        eigenvalues=e.eigenvalues,
        eigenvectors=e.eigenvectors,
    )[0].numpy()
    for jo, opt in enumerate(Q4_OPTIMIZERS_MOMENTUM):
        rule, scaled = _q4_rule(opt)
        f = f_all[jo * eta_grid.size : (jo + 1) * eta_grid.size].reshape(len(etas), len(betas), -1)
        for i, eta in enumerate(etas):
            finals = np.array([_finite_or_inf(float(x)) for x in f[i, :, -1]])
            j = int(np.argmin(finals))
            curves = {"f": f[i, j]}
            curves.update({f"f_beta_{beta:.4f}": f[i, jj] for jj, beta in enumerate(betas)})
            cfg = {
                "figure": "9b",
                "optimizer": opt,
                "rule": rule,
                "c": "inf" if scaled else 1,
                "b": b,
                "zeta": zeta,
                "rotation": rotation,
                "eta": float(eta),
                "lr": float(lrs[jo * eta_grid.size + i * len(betas)]),
                "betas": [float(x) for x in betas],
                "beta2": 0.999,
                "iterations": 200,
                "dtype": "float64",
                **(_ese_config(e, 10) if rule.startswith("fosi") else {}),
            }
            summary = {
                "best_beta": float(betas[j]),
                "f_final_by_beta": {f"{beta:.4f}": float(f[i, jj, -1]) for jj, beta in enumerate(betas)},
            }
            out.write(f"{opt}_eta{i:03d}", cfg, curves, summary, plotted=False)
    count += out.count
    return count


RUNNERS = {"q1": run_q1, "q2": run_q2, "q3": run_q3, "q4": run_q4}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("experiments", nargs="+", choices=[*EXPERIMENTS, "all"])
    parser.add_argument("--results-dir", type=Path, default=REPO / "results" / ROOT_NAME)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 avoids oversubscription on a shared CPU)"
    )
    parser.add_argument(
        "--curves",
        choices=["plotted", "all"],
        default="plotted",
        help="plotted: every iteration for the runs a figure draws as a curve (Q1, Q2, the four Fig. 8 "
        "functions), t = 0 and t = last for the rest (~7 MB); all: every iteration everywhere (~110 MB)",
    )
    parser.add_argument(
        "--rotation",
        choices=list(q.ROTATIONS),
        default="legacy",
        help="Q3/Q4 block rotation: legacy = the authors' scipy (< 1.16) special_ortho_group under numpy "
        "seed 1234 (default); scipy = the installed scipy's (a different matrix for the same seed)",
    )
    parser.add_argument(
        "--no-pack",
        dest="pack",
        action="store_false",
        help="keep one directory per run instead of packing each experiment into metrics.parquet + "
        "runs.jsonl at the end (curvopt.analysis.pack)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    chosen = EXPERIMENTS if "all" in args.experiments else tuple(dict.fromkeys(args.experiments))
    for name in chosen:
        t0 = time.perf_counter()
        extra = {"rotation": args.rotation} if name in ("q3", "q4") else {}
        runs = RUNNERS[name](args.results_dir, args.curves, **extra)
        print(f"{name}: {runs} runs in {time.perf_counter() - t0:.1f} s -> {args.results_dir}", flush=True)
    if args.pack:
        for exp in experiments_under(args.results_dir):
            if loose_run_dirs(exp):
                res = pack_experiment(exp)
                print(f"packed {exp}: {res.runs} runs -> {PACKED_METRICS} + {PACKED_RUNS}", flush=True)


if __name__ == "__main__":
    main()
