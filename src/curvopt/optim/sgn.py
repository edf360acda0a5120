"""SGN: stochastic (generalised) Gauss-Newton with the full softmax GGN (Gargiani et al. 2020),
the FGN paper's second-order baseline.

One step on a batch of ``b`` examples solves the damped system
``(H_GGN + λI) d = −g`` with ``H_GGN = (1/b) Σ_i J_iᵀ (diag p_i − p_i p_iᵀ) J_i`` by truncated CG in
parameter space, warm-started from the previous step's (unscaled) direction, then sets
``w ← w + α d``. Every curvature product goes through the C×C softmax covariance, which is what
FGN avoids. Paper defaults (FGN Table / §2.12): α 0.1, constant λ 1.0, 5 CG iterations,
tolerance 1e-5 relative to ‖g‖, warm start on.

The logits map is linearised once per step through ``torch.func`` (the same
:func:`~curvopt.curvature.fgn_ops.linear_maps` FGN uses, so the two are timed on equal terms);
the JVP/VJP closures are reused by every CG iteration.

Logged per step: ``loss``, ``cg_iters``, ``cg_residual`` (``‖(H+λI)d + g‖/‖g‖``, the recursively
updated CG residual), ``cg_breakdown``, ``xi_mean`` and ``dropped_trace_mean`` (FGN's dispersion
diagnostics, for comparison), ``grad_norm``, ``step_norm``, ``lr``, ``damping``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from curvopt.curvature.fgn_ops import (
    check_classification_batch,
    competitor_distribution,
    dispersion,
    linear_maps,
    log_breakdown,
    true_class_mask,
    true_vs_rest_margin,
)
from curvopt.objective import Objective, Params
from curvopt.training.algorithm import AlgorithmBase, Batch, DataBundle


def softmax_ggn_output_product(probs: Tensor, u: Tensor) -> Tensor:
    """``(diag p − p pᵀ) u`` row-wise for ``(b, C)`` probabilities and vectors."""
    pu = probs * u
    return pu - probs * pu.sum(dim=1, keepdim=True)


def _tree_dot(a: Params, b: Params) -> Tensor:
    return sum((x * b[k]).sum() for k, x in a.items())


def param_cg(
    matvec: Callable[[Params], Params],
    rhs: Params,
    x0: Params | None,
    tol: float,
    maxiter: int,
) -> tuple[Params, dict[str, Any]]:
    """CG on parameter dicts (SciPy/JAX semantics: ``‖r‖ ≤ tol·‖rhs‖``, ``atol = 0``; a warm start
    costs one extra product, ``r0 = rhs − A x0``). A non-positive ``pᵀAp`` ends the solve.

    Kept on dicts (no flattening) so an 8 M-parameter head pays no copies per product.
    """
    if x0 is None:
        x = {k: torch.zeros_like(v) for k, v in rhs.items()}
        r = {k: v.clone() for k, v in rhs.items()}
    else:
        x = {k: v.clone() for k, v in x0.items()}
        ax = matvec(x)
        r = {k: rhs[k] - ax[k] for k in rhs}
    rhs_norm = float(torch.sqrt(_tree_dot(rhs, rhs)))
    threshold = tol * rhs_norm
    p = {k: v.clone() for k, v in r.items()}
    rs = float(_tree_dot(r, r))
    iters, breakdown = 0, False
    while iters < maxiter and rs**0.5 > threshold:
        ap = matvec(p)
        curvature = float(_tree_dot(p, ap))
        if not curvature > 0:
            breakdown = True
            break
        alpha = rs / curvature
        for k in x:
            x[k].add_(p[k], alpha=alpha)
            r[k].add_(ap[k], alpha=-alpha)
        rs_new = float(_tree_dot(r, r))
        beta = rs_new / rs
        for k in p:
            p[k].mul_(beta).add_(r[k])
        rs = rs_new
        iters += 1
    rel = rs**0.5 / rhs_norm if rhs_norm > 0 else 0.0
    return x, {"iters": iters, "rel_residual": rel, "breakdown": breakdown}


class SGN(AlgorithmBase):
    """Full-softmax-GGN damped Newton step with warm-started parameter-space CG (see module doc)."""

    def __init__(
        self,
        objective: Objective,
        lr: float = 0.1,
        damping: float = 1.0,
        cg_tol: float = 1e-5,
        cg_maxiter: int = 5,
        warm_start: bool = True,
        log_dispersion: bool = True,
    ) -> None:
        if objective.loss_kind != "cross_entropy":
            raise ValueError(
                f"SGN here is the softmax cross-entropy baseline; got loss {objective.loss_kind!r}"
            )
        if lr <= 0 or damping <= 0:
            raise ValueError(f"SGN needs lr > 0 and damping > 0 (got lr={lr}, damping={damping})")
        if cg_maxiter < 1 or cg_tol < 0:
            raise ValueError(f"need cg_maxiter >= 1 and cg_tol >= 0 (got {cg_maxiter}, {cg_tol})")
        self.objective = objective
        self.lr = float(lr)
        self.damping = float(damping)
        self.cg_tol = float(cg_tol)
        self.cg_maxiter = int(cg_maxiter)
        self.warm_start = bool(warm_start)
        self.log_dispersion = bool(log_dispersion)
        self.previous: Params | None = None
        self.steps = 0

    def ggn_operator(self, params: Params, x: Tensor, y: Tensor) -> tuple[Tensor, Params, Callable]:
        """``(logits, g, v ↦ (H_GGN + λI) v)`` at ``params`` from one linearisation."""
        z, vjp_z, jvp_z, _ = linear_maps(lambda p: self.objective.forward(p, x), params)
        z = z.detach()
        check_classification_batch(z, y)
        b = z.shape[0]
        with torch.no_grad():
            probs = torch.softmax(z, dim=1)
            residual = probs - true_class_mask(z, y).to(probs.dtype)  # p − y
        grad = vjp_z(residual / b)
        lam = self.damping

        def operator(v: Params) -> Params:
            out = vjp_z(softmax_ggn_output_product(probs, jvp_z(v)) / b)
            return {k: t.add_(v[k], alpha=lam) for k, t in out.items()}

        return z, grad, operator

    def step(self, batch: Batch) -> dict[str, Any]:
        x, y = batch
        params = self.objective.params()
        z, grad, operator = self.ggn_operator(params, x, y)
        rhs = {k: -g for k, g in grad.items()}
        x0 = self.previous if self.warm_start else None
        direction, info = param_cg(operator, rhs, x0, self.cg_tol, self.cg_maxiter)
        with torch.no_grad():
            for name, p in params.items():
                p.add_(direction[name], alpha=self.lr)
            stats = {
                "loss": torch.nn.functional.cross_entropy(z, y),
                "grad_norm": torch.sqrt(_tree_dot(grad, grad)),
                "step_norm": torch.sqrt(_tree_dot(direction, direction)),
            }
            if self.log_dispersion:
                s = true_vs_rest_margin(z, y)
                xi = dispersion(competitor_distribution(z, y))
                stats["xi_mean"] = xi.mean()
                stats["dropped_trace_mean"] = (torch.sigmoid(s) * xi).mean()
        self.previous = direction if self.warm_start else None
        keys = list(stats)
        out: dict[str, Any] = dict(zip(keys, torch.stack([stats[k].double() for k in keys]).tolist()))
        out.update(
            cg_iters=int(info["iters"]),
            cg_residual=float(info["rel_residual"]),
            cg_breakdown=int(info["breakdown"]),
            lr=self.lr,
            damping=self.damping,
        )
        if info["breakdown"]:
            log_breakdown("SGN", self.steps, info)
        self.steps += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "previous": self.previous}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))
        self.previous = state.get("previous")


def build_sgn(objective: Objective, data: DataBundle | None = None, **cfg: Any) -> SGN:
    """Factory for the loop (``conf/optimizer/sgn.yaml``): ``build_sgn(objective, data, **cfg)``."""
    del data
    return SGN(objective, **cfg)
