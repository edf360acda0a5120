"""SHF-LSMR audit: why LSMR stops after a handful of iterations and why λ falls so slowly.

At a given iterate (the sparse initialisation, or the weights and λ of a run's checkpoint) on a
fresh training batch of size n, it measures

* the top eigenvalues of the preconditioned Gauss-Newton matrix ``M = CᵀJᵀJC`` (``C = diag(c)``,
  Chapelle–Erhan) and of the plain ``JᵀJ``, beside the damping ``λ²`` that LSMR adds to M;
* the resulting condition number of LSMR's damped system, ``κ ≤ (σ²_max + λ²)/λ²``, and the
  iteration count a Krylov method needs for the atol test at that κ;
* what LSMR actually does on that batch (cold and with SHF's warm start): iterations, stop reason,
  ``test2``, and how far the solution is from the damped gradient step ``y ≈ Cᵀg/λ²``;
* the undamped model's predicted reduction against the actual one (ρ) for that step.

Usage (one thread, CPU)::

    python -m experiments.shf.audit --dataset usps --batch 2000 \
        [--checkpoint results/shf_fig2_usps/shf_lsmr_paper_s0/checkpoint.pt] --out results/shf_audit/x.json

``--trajectory`` instead draws, from the run records only, what the two methods did per outer
iteration (λ, inner iterations and LSMR's stop reasons, ρ, batch size, test error vs iteration and
time) to ``results/figures/shf_audit_<dataset>_<profile>.png`` (+ CSV)::

    python -m experiments.shf.audit --trajectory --dataset usps --profile paper

``--work`` compares the two methods at equal curvature work (Σ inner iterations × batch size), an axis
that does not depend on the machine a run had, and writes ``results/shf_audit/work_<dataset>_<profile>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from curvopt.curvature.lsmr import lsmr
from curvopt.curvature.mlp_gn import residual_gauss_newton
from curvopt.errors import EXIT_BAD_INPUT, BadInputError
from curvopt.objective import Objective, flatten, unflatten
from curvopt.optim.shf import chapelle_erhan_precond

REPO_ROOT = Path(__file__).resolve().parents[2]


def build(dataset: str, seed: int, profile: str = "paper"):
    from curvopt.training.build import build_data, build_model, seed_everything
    from experiments.runs import compose_config

    exp = f"shf_fig2_{dataset}" + ("_paper" if profile == "paper" else "")
    cfg = compose_config([f"experiment={exp}", "optimizer=shf_lsmr", f"seed={seed}", "logger=none"])
    seed_everything(seed, True)
    data = build_data(cfg, torch.float32, torch.device("cpu"))
    model, loss = build_model(cfg, torch.float32, torch.device("cpu"))
    return cfg, data, Objective(model, loss)


def top_eigs(apply, n: int, k: int, seed: int) -> list[float]:
    """Largest k eigenvalues of a symmetric PSD operator (float64 ARPACK on float32 products)."""
    import scipy.sparse.linalg as spla

    def mv(v: np.ndarray) -> np.ndarray:
        return apply(torch.from_numpy(v.astype(np.float32))).double().numpy()

    op = spla.LinearOperator((n, n), matvec=mv, dtype=np.float64)
    v0 = np.random.default_rng(seed).standard_normal(n)
    vals = spla.eigsh(op, k=k, which="LA", v0=v0, tol=1e-3, return_eigenvectors=False)
    return sorted((float(x) for x in vals), reverse=True)


def krylov_iters(kappa: float, tol: float) -> int:
    """Iterations a CG-type method needs to cut the error by ``tol`` at condition number κ."""
    if kappa <= 1:
        return 1
    q = (math.sqrt(kappa) - 1) / (math.sqrt(kappa) + 1)
    return max(1, math.ceil(math.log(tol / 2) / math.log(q)))


def audit(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    cfg, data, objective = build(args.dataset, args.seed)
    opt = cfg.optimizer
    lam = float(opt.damping)
    gamma = float(opt.gamma)
    warm_d = None
    step = 0
    if args.checkpoint:
        from curvopt.training.checkpoint import read_checkpoint, verify_checkpoint

        verify_checkpoint(Path(args.checkpoint))  # data only: weights-only, checksum checked first
        state = read_checkpoint(Path(args.checkpoint), torch.device("cpu"))
        objective.model.load_state_dict(state["model"])
        alg = state["algorithm"]
        lam, warm_d, step = float(alg["lam"]), alg["warm_d"], int(state["step"])
    params = objective.params()
    x_train, y_train = data.train
    gen = torch.Generator().manual_seed(args.seed + 1000 * step + 17)
    idx = torch.randperm(x_train.shape[0], generator=gen)[: args.batch]
    x, y = x_train[idx], y_train[idx]
    gn = residual_gauss_newton(objective, params, x, y, True)
    g = gn.gradient()
    c = chapelle_erhan_precond(gn.gn_diag_estimate(gen), True)
    numel = gn.numel

    def m_apply(v: torch.Tensor) -> torch.Tensor:
        return gn.vjp(gn.jvp(v, col_scale=c), col_scale=c).clone()

    def g_apply(v: torch.Tensor) -> torch.Tensor:
        return gn.vjp(gn.jvp(v)).clone()

    t0 = time.perf_counter()
    eig_m = top_eigs(m_apply, numel, args.k, args.seed)
    eig_g = top_eigs(g_apply, numel, args.k, args.seed)
    t_eig = time.perf_counter() - t0
    kappa = (eig_m[0] + lam * lam) / (lam * lam)

    xv, yv = data.val

    def shifted(d: torch.Tensor) -> dict:
        dd = unflatten(d, params)
        return {k: v + dd[k] for k, v in params.items()}

    def val_loss(d: torch.Tensor) -> float:
        with torch.no_grad():
            return float(objective.loss(shifted(d), xv, yv))

    op = (
        lambda v: gn.jvp(v, col_scale=c).reshape(-1),
        lambda u: gn.vjp(u.view(gn.n, -1), col_scale=c),
        (gn.residual.numel(), numel),
    )
    b = -gn.residual.reshape(-1)
    runs = {}
    for name, x0 in (("cold", None), ("warm", None if warm_d is None else warm_d * gamma / c)):
        if name == "warm" and x0 is None:
            continue
        res = lsmr(
            op,
            b,
            damp=lam,
            atol=float(opt.atol),
            btol=0.0,
            conlim=0.0,
            maxiter=int(args.maxiter),
            x0=x0,
            merit=lambda yk: val_loss(c * yk),
            ftol=float(opt.ftol),
            miniter=int(opt.miniter),
            recover=int(opt.recover),
        )
        d = c * res.x
        gd = float(g @ d)
        ad = gn.jvp(d)
        pred = 0.5 * float((ad * ad).sum()) + gd
        with torch.no_grad():
            f1 = float(objective.loss(shifted(d), x, y))
        f0 = gn.loss()
        # the damped gradient step y_g = Cᵀ(−g)/λ² (what the solve reduces to when λ² ≫ σ²_max)
        y_grad = -(c * g) / (lam * lam)
        base = torch.zeros_like(y_grad) if x0 is None else x0
        incr = res.x - base
        cos = float(incr @ y_grad) / (float(incr.norm()) * float(y_grad.norm()) + 1e-30)
        runs[name] = {
            "itn": res.itn,
            "stop": res.stop_reason,
            "normar": res.normar,
            "norma": res.norma,
            "normr": res.normr,
            "test2": res.normar / (res.norma * res.normr),
            "merit_evals": len(res.merit_history),
            "rho": (f1 - f0) / pred if pred < 0 else None,
            "pred_reduction": pred,
            "actual_reduction": f1 - f0,
            "step_norm": float(d.norm()),
            "cos_increment_vs_damped_gradient_step": cos,
            "increment_norm_over_damped_gradient_step": float(incr.norm()) / float(y_grad.norm()),
        }
    out = {
        "dataset": args.dataset,
        "checkpoint": args.checkpoint,
        "step": step,
        "batch": args.batch,
        "lambda": lam,
        "lambda_sq": lam * lam,
        "f_batch": gn.loss(),
        "E_sq_batch": 2 * gn.loss(),
        "grad_norm": float(g.norm()),
        "precond_c_min_median_max": [float(c.min()), float(c.median()), float(c.max())],
        "eig_precond_gn_top": eig_m,
        "eig_gn_top": eig_g,
        "kappa_damped_bound": kappa,
        "krylov_iters_for_1e-6_at_kappa": krylov_iters(kappa, 1e-6),
        "lsmr": runs,
        "eig_time_s": t_eig,
        "num_params": numel,
        "flat_params_norm": float(flatten(params).norm()),
    }
    return out


def trajectory(results: Path, dataset: str, profile: str, out: Path) -> Path:
    """λ, inner iterations, ρ, batch size and test error per outer iteration, from the records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from curvopt.analysis.records import load_runs
    from experiments.plots.common import save_with_csv

    runs = load_runs(results, f"shf_fig2_{dataset}")
    runs = runs[runs["profile"] == profile]
    if runs.empty:
        raise SystemExit(f"no {profile} runs under {results}/shf_fig2_{dataset}/")
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    colours = {"shf_lsmr": "tab:red", "hf_cg": "tab:blue"}
    series = []
    for (method, run_id), run in runs.groupby(["optimizer", "run_id"]):
        run = run.sort_values("step")
        steps = run[run["step"] > 0]
        kw = {"color": colours.get(method), "lw": 1.0, "label": run_id}
        axes[0, 0].plot(steps["step"], steps["damping"], **kw)
        axes[0, 1].plot(steps["step"], steps["inner_iters"], **kw)
        axes[0, 2].plot(steps["step"], steps["rho"].clip(-1, 2), **kw)
        axes[1, 0].plot(steps["step"], steps["batch_size"], **kw)
        ev = run.dropna(subset=["test/E_sq"])
        axes[1, 1].plot(ev["step"], ev["test/E_sq"], **kw)
        axes[1, 2].plot(ev["algo_time_s"], ev["test/E_sq"], **kw)
        cols = [
            "step",
            "algo_time_s",
            "damping",
            "inner_iters",
            "inner_stop",
            "rho",
            "batch_size",
            "test/E_sq",
        ]
        series.append(run[[c for c in cols if c in run]].assign(method=method, run_id=run_id))
        if method == "shf_lsmr" and "inner_stop" in steps:
            stops = steps["inner_stop"].value_counts().to_dict()
            axes[0, 1].text(
                0.02,
                0.95 - 0.07 * len(series),
                f"{run_id} LSMR stops: {stops}",
                transform=axes[0, 1].transAxes,
                fontsize=7,
                va="top",
            )
    titles = [
        ("λ (SHF: λ² added to the preconditioned GN; HF-CG: λ added to G)", "log"),
        ("inner iterations (LSMR / CG)", "log"),
        ("ρ (clipped to [−1, 2])", "linear"),
        ("batch size (HF-CG: curvature chunk)", "linear"),
        ("test E_sq vs outer iteration", "log"),
        ("test E_sq vs algorithm time [s]", "log"),
    ]
    for ax, (title, scale) in zip(axes.flat, titles):
        ax.set_title(title, fontsize=9)
        ax.set_yscale(scale)
        ax.grid(alpha=0.3, which="both")
        ax.set_xlabel("algorithm time [s]" if "time" in title else "outer iteration")
    axes[0, 0].legend(fontsize=7)
    devices = sorted({str(d) for d in runs["device"].dropna().unique()})
    fig.suptitle(
        f"SHF audit, {dataset}: what each method did per outer iteration (profile {profile}; device {', '.join(devices)})"
    )
    fig.tight_layout()
    return save_with_csv(fig, out, [pd.concat(series, ignore_index=True)])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="usps", choices=["usps", "curves", "mnist"])
    p.add_argument("--batch", type=int, default=2000)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--maxiter", type=int, default=1500)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--trajectory", action="store_true", help="draw per-iteration behaviour from the records")
    p.add_argument(
        "--work",
        action="store_true",
        help="compare the methods at equal curvature work (machine-independent) from the records",
    )
    p.add_argument("--profile", default="paper")
    p.add_argument("--results-dir", type=Path, default=Path("results"))
    args = p.parse_args(argv)
    if args.work:
        from curvopt.analysis.records import load_runs
        from experiments.shf.work import work_comparison

        res = work_comparison(load_runs(args.results_dir, f"shf_fig2_{args.dataset}"), args.profile)
        text = json.dumps(res, indent=2)
        print(text)
        out = Path(args.out or args.results_dir / "shf_audit" / f"work_{args.dataset}_{args.profile}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        return
    if args.trajectory:
        out = Path(args.out or args.results_dir / "figures" / f"shf_audit_{args.dataset}_{args.profile}.png")
        print(f"wrote {trajectory(args.results_dir, args.dataset, args.profile, out)}")
        return
    try:
        result = audit(args)
    except BadInputError as err:  # a checkpoint that is damaged, or holds more than data
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
