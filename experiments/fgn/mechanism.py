"""FGN Figure 2 measurements: (a) time per update against C, (b) the output-space trace
decomposition against ξ, (c) the step-quality ratio against ξ (paper §5.1, Appendix F.1).

Pure computation; ``fig2.py`` turns the results into records and the figure.
"""

from __future__ import annotations

import math
import os
import platform
import time
from typing import Any

import numpy as np
import torch

from curvopt.models.linear_head import linear_head
from curvopt.objective import Objective
from curvopt.optim.fgn import FGN
from curvopt.optim.sgn import SGN
from curvopt.training.algorithm import TorchOptimizerAlgorithm

METHODS = ("adam", "sgn", "fgn_generic", "fgn_affine")


# -- (b) trace decomposition -------------------------------------------------------------------------
def competitor_mixture(alpha: float, num_classes: int) -> np.ndarray:
    """``ρ(α) = (1−α) e_1 + α·1/(C−1)``: one-hot at α = 0, uniform at α = 1."""
    rho = np.full(num_classes - 1, alpha / (num_classes - 1))
    rho[0] += 1.0 - alpha
    return rho


def trace_decomposition(p_star: float, num_classes: int, alphas: np.ndarray) -> dict[str, np.ndarray]:
    """Traces of the softmax covariance and its FGN split along ρ(α) (paper 3.3, C.11).

    Closed forms ``τ_ret = p_*p_†(2−ξ)``, ``τ_drop = p_†ξ``, ``τ_full = 2p_*p_† + p_†²ξ`` are
    returned together with the traces of the explicitly built C×C matrices (a numerical check of
    the identity ``τ_full = τ_ret + τ_drop`` that the panel plots)."""
    p_dag = 1.0 - p_star
    out: dict[str, list[float]] = {k: [] for k in ("alpha", "xi", "tau_ret", "tau_drop", "tau_full")}
    out.update({f"{k}_matrix": [] for k in ("tau_ret", "tau_drop", "tau_full")})
    for alpha in alphas:
        rho = competitor_mixture(float(alpha), num_classes)
        xi = 1.0 - float(rho @ rho)
        p = np.concatenate([[p_star], p_dag * rho])
        a = np.concatenate([[-1.0], rho])  # ∇_z s in the order (*, −*)
        full = np.diag(p) - np.outer(p, p)
        kept = p_star * p_dag * np.outer(a, a)
        dropped = np.zeros_like(full)
        dropped[1:, 1:] = p_dag * (np.diag(rho) - np.outer(rho, rho))
        out["alpha"].append(float(alpha))
        out["xi"].append(xi)
        out["tau_ret"].append(p_star * p_dag * (2.0 - xi))
        out["tau_drop"].append(p_dag * xi)
        out["tau_full"].append(2.0 * p_star * p_dag + p_dag**2 * xi)
        out["tau_ret_matrix"].append(float(np.trace(kept)))
        out["tau_drop_matrix"].append(float(np.trace(dropped)))
        out["tau_full_matrix"].append(float(np.trace(full)))
    return {k: np.asarray(v) for k, v in out.items()}


# -- (c) step quality ---------------------------------------------------------------------------------
def competitor_positions(
    num_classes: int, spacing: str = "linspace", low: float = -1.0, high: float = 1.0
) -> np.ndarray:
    """The ``t_j`` of panel (c): ``C−1`` uniformly spaced values, centred to mean zero (the paper
    gives neither spacing nor range; docs/decisions.md FGN-10: ``linspace(−1, 1)`` by default,
    ascending, so ``e_1`` is the ``t = low`` competitor). ``spacing='integers'``: ``j − mean(j)``."""
    if spacing == "linspace":
        t = np.linspace(low, high, num_classes - 1)
    elif spacing == "integers":
        t = np.arange(num_classes - 1, dtype=float)
    else:
        raise ValueError(f"unknown spacing {spacing!r}; choose linspace or integers")
    return t - t.mean()


def step_quality(
    num_classes: int,
    p_star: float,
    eta: float,
    beta: float,
    t: np.ndarray,
    damping_scales: list[float],
    alphas: np.ndarray,
) -> list[dict[str, float]]:
    """``R_λ(ξ) = Δ(d_FGN)/Δ(d_GGN)`` on the deterministic 2-parameter problem of Appendix F.1.

    ``A`` has rows ``a_* = (−1, η)`` and ``a_j = (1, β t_j)``; ``p = (p_*, p_† ρ(α))``;
    ``g = Aᵀ(p − e_*)``; ``λ_s = s_λ · Tr(H_FGN at ρ = e_1)/2``; ``Δ(d) = −[gᵀd + ½dᵀH_GGN d +
    (λ/2)‖d‖²]``, the damped GGN model decrease, for both steps."""
    p_dag = 1.0 - p_star
    a_star = np.array([-1.0, eta])
    a_comp = np.stack([np.ones_like(t), beta * t], axis=1)  # (C−1, 2)
    A = np.vstack([a_star, a_comp])
    e_star = np.zeros(num_classes)
    e_star[0] = 1.0

    def hessians(rho: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        p = np.concatenate([[p_star], p_dag * rho])
        g = A.T @ (p - e_star)
        h_ggn = A.T @ (np.diag(p) - np.outer(p, p)) @ A
        js = a_comp.T @ rho - a_star
        h_fgn = p_star * p_dag * np.outer(js, js)
        return g, h_ggn, h_fgn

    _, _, h0 = hessians(competitor_mixture(0.0, num_classes))
    rows = []
    for scale in damping_scales:
        lam = scale * np.trace(h0) / 2.0
        for alpha in alphas:
            rho = competitor_mixture(float(alpha), num_classes)
            g, h_ggn, h_fgn = hessians(rho)
            eye = np.eye(2)
            d_ggn = -np.linalg.solve(h_ggn + lam * eye, g)
            d_fgn = -np.linalg.solve(h_fgn + lam * eye, g)

            def decrease(d: np.ndarray, g=g, h_ggn=h_ggn, lam=lam) -> float:
                return float(-(g @ d + 0.5 * d @ h_ggn @ d + 0.5 * lam * d @ d))

            rows.append(
                {
                    "s_lambda": float(scale),
                    "lambda": float(lam),
                    "alpha": float(alpha),
                    "xi": 1.0 - float(rho @ rho),
                    "delta_fgn": decrease(d_fgn),
                    "delta_ggn": decrease(d_ggn),
                    "R": decrease(d_fgn) / decrease(d_ggn),
                }
            )
    return rows


# -- (a) timing -----------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_algorithm(method: str, objective: Objective, settings: dict[str, Any]) -> Any:
    """The four timed methods with the paper's settings (λ = 1, 5 CG iterations, tol 1e-5)."""
    second = {
        "lr": settings.get("alpha", 0.1),
        "damping": settings.get("damping", 1.0),
        "cg_tol": settings.get("cg_tol", 1e-5),
        "cg_maxiter": settings.get("cg_maxiter", 5),
    }
    if method == "adam":
        fused = settings.get("adam_fused", True)
        opt = torch.optim.Adam(
            objective.model.parameters(), lr=settings.get("adam_lr", 3e-4), fused=bool(fused)
        )
        return TorchOptimizerAlgorithm(objective, opt)
    if method == "sgn":
        return SGN(objective, warm_start=True, log_dispersion=False, **second)
    if method == "fgn_generic":
        return FGN(objective, implementation="generic", **second)
    if method == "fgn_affine":
        return FGN(
            objective,
            implementation="affine",
            compile=bool(settings.get("compile", False)),
            cg_early_exit=not settings.get("compile", False),
            **second,
        )
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def time_cell(
    method: str,
    num_classes: int,
    dim: int,
    batch_size: int,
    num_examples: int,
    warmup_steps: int,
    timed_steps: int,
    seed: int = 0,
    device: str = "cpu",
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Steady-state time per update of ``method`` on a linear softmax head ``Z = XW + b`` over
    fixed Gaussian features (labels uniform over C), cycling through ``num_examples / batch_size``
    batches; warm-up steps (and compilation) are excluded. Feature generation is excluded too.

    ``settings['clock']``: ``wall`` (``perf_counter``, CUDA-synchronised; the paper's measure) or
    ``process`` (this process's CPU seconds, which other jobs on a shared CPU cannot inflate; equal
    to uncontended wall time only with one torch thread, and meaningless on a GPU)."""
    settings = settings or {}
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_examples, dim, generator=g).to(dev)
    y = torch.randint(0, num_classes, (num_examples,), generator=g).to(dev)
    torch.manual_seed(seed)
    model = linear_head(dim, num_classes).to(dev)
    objective = Objective(model, "cross_entropy")
    algorithm = make_algorithm(method, objective, settings)
    num_batches = max(1, num_examples // batch_size)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = i % num_batches
        return x[k * batch_size : (k + 1) * batch_size], y[k * batch_size : (k + 1) * batch_size]

    clock = str(settings.get("clock", "wall"))
    if clock not in ("wall", "process"):
        raise ValueError(f"clock must be 'wall' or 'process', got {clock!r}")
    if clock == "process" and dev.type == "cuda":
        raise ValueError("clock='process' counts CPU seconds only; use clock='wall' on a GPU")
    now = time.process_time if clock == "process" else time.perf_counter
    for i in range(warmup_steps):
        algorithm.step(batch(i))
    _sync(dev)
    times, cg_iters = [], []
    for i in range(timed_steps):
        xb, yb = batch(warmup_steps + i)
        _sync(dev)
        t0 = now()
        stats = algorithm.step((xb, yb))
        _sync(dev)
        times.append(now() - t0)
        if "cg_iters" in stats:
            cg_iters.append(stats["cg_iters"])
    arr = np.asarray(times)
    return {
        "method": method,
        "C": int(num_classes),
        "D": int(dim),
        "b": int(batch_size),
        "N": int(num_examples),
        "warmup_steps": int(warmup_steps),
        "timed_steps": int(timed_steps),
        "ms_mean": float(arr.mean() * 1e3),
        "ms_median": float(np.median(arr) * 1e3),
        "ms_min": float(arr.min() * 1e3),
        "cg_iters_mean": float(np.mean(cg_iters)) if cg_iters else math.nan,
        "num_params": int(sum(p.numel() for p in model.parameters())),
        "device": device if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "threads": torch.get_num_threads(),
        "clock": clock,
        "torch": torch.__version__,
        "host": platform.node(),
        "load_avg_1min": os.getloadavg()[0],
        "adam_fused": bool(settings.get("adam_fused", True)) if method == "adam" else None,
        "compiled": bool(settings.get("compile", False)) if method == "fgn_affine" else False,
    }
