"""SGN: stochastic (generalised) Gauss-Newton with the full softmax GGN (Gargiani et al. 2020).

SGN is the FGN paper's second-order baseline.

One step on a batch of ``b`` examples solves the damped system
``(H_GGN + λI) d = −g`` with ``H_GGN = (1/b) Σ_i J_iᵀ (diag p_i − p_i p_iᵀ) J_i`` by truncated CG in
parameter space, warm-started from the previous step's (unscaled) direction, then sets
``w ← w + α d``. Every curvature product goes through the C×C softmax covariance, which is what
FGN avoids. Paper defaults (docs/fgn.md, "Usage"): α 0.1, constant λ 1.0, 5 CG iterations,
tolerance 1e-5 relative to ‖g‖, warm start on. CG's inner products are taken in the vectors'
dtype (JAX/SciPy ``cg`` semantics, as FGN's row-space CG): float64 accumulation
(``cg_float64_dots=True``) copies every d-vector to float64 and cost ~40 % of an SGN step on a
2M-parameter head on one CPU core, which would flatter FGN in the timing comparisons.

The logits map is linearised once per step through ``torch.func`` (the same
:func:`~curvopt.curvature.fgn_ops.linear_maps` FGN uses, so the two are timed on equal terms);
the JVP/VJP closures are reused by every CG iteration.

Logged per step: ``loss``, ``cg_iters``, ``cg_residual`` (``‖(H+λI)d + g‖/‖g‖``, the recursively
updated CG residual), ``cg_breakdown``, ``xi_mean`` and ``dropped_trace_mean`` (FGN's dispersion
diagnostics, for comparison), ``grad_norm``, ``step_norm``, ``lr``, ``damping``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from curvopt.api import AlgorithmBase, Batch, DataBundle
from curvopt.curvature.cg import cg
from curvopt.curvature.fgn_ops import (
    check_classification_batch,
    competitor_distribution,
    dispersion,
    linear_maps,
    log_breakdown,
    true_class_mask,
    true_vs_rest_margin,
)
from curvopt.objective import Objective, Params, flatten, unflatten


def softmax_ggn_output_product(probs: Tensor, u: Tensor) -> Tensor:
    """Softmax cross-entropy output Hessian times ``u``, ``(diag p − p pᵀ) u``, row by row.

    Args:
        probs: ``(b, C)`` softmax probabilities.
        u: ``(b, C)`` logit-space vectors.

    Returns:
        The ``(b, C)`` products.
    """
    pu = probs * u
    return pu - probs * pu.sum(dim=1, keepdim=True)


def _tree_dot(a: Params, b: Params) -> Tensor:
    """Inner product without temporaries (one fused pass per tensor)."""
    return sum(torch.vdot(x.reshape(-1), b[k].reshape(-1)) for k, x in a.items())


def _finite_positive(value: Any) -> bool:
    """Whether ``value`` is a real number, finite and > 0 (NaN, inf and bools are not)."""
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


class SGN(AlgorithmBase):
    """Full-softmax-GGN damped Newton step with warm-started parameter-space CG (an ``Algorithm``).

    See the module docstring; defaults are the FGN paper's settings for its baseline.

    Args:
        objective: A ``cross_entropy`` objective whose model returns ``(b, C)`` logits.
        lr: Step size α (> 0).
        damping: Constant damping λ (> 0) of ``(H_GGN + λI) d = −g``.
        cg_tol: CG tolerance relative to ``‖g‖``.
        cg_maxiter: CG iteration cap (≥ 1).
        warm_start: Start CG from the previous step's unscaled direction.
        log_dispersion: Also log FGN's dispersion diagnostics ``xi_mean`` and
            ``dropped_trace_mean``.
        cg_float64_dots: Accumulate CG inner products in float64 (default: the vectors' dtype,
            JAX/SciPy ``cg`` semantics).

    Raises:
        ValueError: If the loss is not cross-entropy or a setting is out of range (``lr`` and
            ``damping`` must be finite positive numbers; NaN and inf are refused).
        TypeError: If a trainable parameter is complex (or not floating point).

    Example:
        SGN is an :class:`~curvopt.api.Algorithm`: ``step(batch)`` does the forward, the CG
        solve and the update itself (no ``zero_grad``/``backward`` for the caller):

        >>> import torch
        >>> from curvopt.objective import Objective
        >>> from curvopt.optim import SGN
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> sgn = SGN(Objective(model, "cross_entropy"), lr=0.1, damping=1.0)
        >>> for _ in range(3):
        ...     info = sgn.step((x, y))
        >>> sgn.steps, info["cg_iters"] <= 5
        (3, True)
    """

    def __init__(
        self,
        objective: Objective,
        lr: float = 0.1,
        damping: float = 1.0,
        cg_tol: float = 1e-5,
        cg_maxiter: int = 5,
        warm_start: bool = True,
        log_dispersion: bool = True,
        cg_float64_dots: bool = False,
    ) -> None:
        if objective.loss_kind != "cross_entropy":
            raise ValueError(
                f"SGN here is the softmax cross-entropy baseline; got loss {objective.loss_kind!r}"
            )
        if not (_finite_positive(lr) and _finite_positive(damping)):
            raise ValueError(
                f"SGN needs lr and damping to be finite positive numbers (got lr={lr}, damping={damping})"
            )
        for p in objective.model.parameters():
            if p.requires_grad and not p.is_floating_point():
                raise TypeError(
                    f"SGN supports real floating-point parameters only, got {p.dtype} (shape {tuple(p.shape)})"
                )
        if cg_maxiter < 1 or not cg_tol >= 0:  # NaN tolerance fails too
            raise ValueError(f"need cg_maxiter >= 1 and cg_tol >= 0 (got {cg_maxiter}, {cg_tol})")
        self.objective = objective
        self.lr = float(lr)
        self.damping = float(damping)
        self.cg_tol = float(cg_tol)
        self.cg_maxiter = int(cg_maxiter)
        self.warm_start = bool(warm_start)
        self.log_dispersion = bool(log_dispersion)
        self.cg_dot_dtype = torch.float64 if cg_float64_dots else None
        self.previous: Params | None = None
        self.steps = 0

    def ggn_operator(self, params: Params, x: Tensor, y: Tensor) -> tuple[Tensor, Params, Callable]:
        """The damped GGN system at ``params``, from one linearisation of the logits map.

        Args:
            params: The point (name → tensor dict).
            x: Input batch.
            y: Integer labels.

        Returns:
            ``(logits, g, operator)``: the detached logits, the mean-loss gradient as a
            parameter dict, and ``v ↦ (H_GGN + λI) v`` on flat vectors (what
            :func:`curvopt.curvature.cg.cg` works on).

        Raises:
            ValueError: If the batch cannot define a margin.
            FloatingPointError: If the logits are not finite.
        """
        z, vjp_z, jvp_z, _ = linear_maps(lambda p: self.objective.forward(p, x), params)
        z = z.detach()
        check_classification_batch(z, y)
        b = z.shape[0]
        with torch.no_grad():
            probs = torch.softmax(z, dim=1)
            residual = probs - true_class_mask(z, y).to(probs.dtype)  # p − y
        grad = vjp_z(residual / b)
        lam = self.damping

        def operator(v: Tensor) -> Tensor:
            out = vjp_z(softmax_ggn_output_product(probs, jvp_z(unflatten(v, params))) / b)
            return flatten(out).add_(v, alpha=lam)

        return z, grad, operator

    def step(self, batch: Batch) -> dict[str, Any]:
        """One SGN update ``w ← w + α d`` on ``batch``.

        Args:
            batch: ``(x, y)`` with integer labels in ``[0, C)``.

        Returns:
            The logged scalars of the module docstring plus ``cg_stop``.
        """
        x, y = batch
        params = self.objective.params()
        z, grad, operator = self.ggn_operator(params, x, y)
        rhs = flatten(grad).neg_()
        x0 = self.previous if self.warm_start else None
        result = cg(
            operator, rhs, x0=x0, tol=self.cg_tol, maxiter=self.cg_maxiter, dot_dtype=self.cg_dot_dtype
        )
        direction = unflatten(result.x, params)
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
        self.previous = result.x if self.warm_start else None
        keys = list(stats)
        out: dict[str, Any] = dict(zip(keys, torch.stack([stats[k].double() for k in keys]).tolist()))
        breakdown = result.stop_reason in ("negative_curvature", "breakdown")
        out.update(
            cg_iters=int(result.iterations),
            cg_residual=float(result.rel_residual),
            cg_breakdown=int(breakdown),
            cg_stop=result.stop_reason,
            lr=self.lr,
            damping=self.damping,
        )
        if breakdown:
            log_breakdown("SGN", self.steps, {"iters": result.iterations})
        self.steps += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """The step counter and the warm start.

        Returns:
            ``{"steps": int, "previous": flat tensor or None}``.
        """
        return {"steps": self.steps, "previous": self.previous}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step counter and the warm start.

        Args:
            state: A dict returned by :meth:`state_dict`.
        """
        self.steps = int(state.get("steps", 0))
        self.previous = state.get("previous")


def build_sgn(objective: Objective, data: DataBundle | None = None, **cfg: Any) -> SGN:
    """Factory for the loop (``conf/optimizer/sgn.yaml``).

    Args:
        objective: The model and its cross-entropy loss.
        data: The run's data (unused).
        **cfg: Keyword arguments of :class:`SGN`.

    Returns:
        The :class:`SGN` algorithm.

    Example:
        >>> import torch
        >>> from curvopt.api import DataBundle
        >>> from curvopt.objective import Objective
        >>> from curvopt.optim import build_sgn
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> alg = build_sgn(Objective(model, "cross_entropy"), DataBundle(train=(x, y)), lr=0.1)
        >>> for _ in range(2):
        ...     info = alg.step((x, y))
        >>> type(alg).__name__, "loss" in info
        ('SGN', True)
    """
    del data
    return SGN(objective, **cfg)
