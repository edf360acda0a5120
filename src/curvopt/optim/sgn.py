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

Host reads (a GPU step waits for each): on the CPU the defaults keep the project's CG (two host
reads per iteration, early exit) and the eager batch checks; on an accelerator (``"auto"``) CG runs
``cg_maxiter`` masked iterations on the device (:func:`fixed_length_cg`, the same iterates), the
batch is checked on the device (``check_finite="deferred"``) and the step reads the host once, at the
end, for the logged scalars; ``host_stats=False`` leaves that read to the caller
(:meth:`SGN.read_stats`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from curvopt.api import AlgorithmBase, Batch, DataBundle
from curvopt.curvature.cg import STOP_REASONS, cg
from curvopt.curvature.fgn_ops import (
    batch_flags,
    batch_ok,
    check_classification_batch,
    competitor_distribution,
    dispersion,
    linear_maps,
    true_class_mask,
    true_vs_rest_margin,
)
from curvopt.objective import Objective, Params, flatten, unflatten
from curvopt.optim.checks import FLAG, Range
from curvopt.optim.fgn import GaussNewtonChecks


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


def fixed_length_cg(
    matvec: Callable[[Tensor], Tensor],
    b: Tensor,
    x0: Tensor | None = None,
    tol: float = 1e-5,
    maxiter: int = 5,
    dot_dtype: torch.dtype | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`curvopt.curvature.cg.cg` (no preconditioner) with every decision on the device.

    The same iterates, stopping rule (``‖r‖ ≤ tol·‖b‖``, also before the first iteration) and stop
    reasons as ``cg``, but the loop always runs ``maxiter`` times: once the solve has stopped, the
    remaining iterations are masked no-ops (``torch.where``), so no scalar is read on the host. The
    step sizes are 0-d tensors instead of Python floats, so an iterate can differ from ``cg``'s in
    the last bit (a separate multiply and add instead of one fused ``add(alpha=…)``).

    Args:
        matvec: ``v ↦ A v`` on flat vectors (SPD ``A``).
        b: Right-hand side, a 1-D tensor.
        x0: Starting point; ``None`` starts from 0 (and saves one product).
        tol: Relative residual tolerance.
        maxiter: Number of iterations run (the cap of ``cg``).
        dot_dtype: ``torch.float64`` to accumulate inner products in float64, ``None`` for the
            vectors' dtype (as ``cg``'s ``dot_dtype``).

    Returns:
        ``(x, info)`` with 0-d tensors ``iters`` (completed iterations), ``rnorm`` (``‖r‖`` of
        the recursively updated residual, float64), ``b_norm`` (float64) and ``stop`` (the index
        of the stop reason in :data:`curvopt.curvature.cg.STOP_REASONS`).
    """

    def dot(u: Tensor, v: Tensor) -> Tensor:
        if dot_dtype is None:
            return torch.dot(u, v)
        return torch.dot(u.to(dot_dtype), v.to(dot_dtype))

    def norm64(sq: Tensor) -> Tensor:  # sqrt(max(sq, 0)) in float64, as cg's Python floats
        return sq.to(torch.float64).clamp_min(0.0).sqrt()

    inf = math.inf
    x = torch.zeros_like(b) if x0 is None else x0.clone().to(b)
    r = b.clone() if x0 is None else b - matvec(x)
    b_norm = norm64(dot(b, b))
    threshold = b_norm * tol
    rz = dot(r, r)
    rnorm = norm64(rz)
    # active: cg has not returned. While active, rz = rᵀr is finite and > 0 (rnorm > threshold ≥ 0)
    # and p is finite, so a masked update (α = 0) leaves x exactly as it is.
    active = (rnorm > threshold) & (rnorm < inf)
    iters = torch.zeros((), dtype=torch.long, device=b.device)
    last_pap = torch.full((), math.nan, dtype=rz.dtype, device=b.device)
    p = r.clone()
    for _ in range(maxiter):
        ap = matvec(p)
        pap = dot(p, ap)
        ok = active & (pap > 0) & (pap < inf)  # cg: breakdown if pᵀAp is not finite, else ≤ 0: negative
        last_pap = torch.where(active, pap, last_pap)
        alpha = torch.where(ok, rz / pap, 0.0)
        x = torch.addcmul(x, alpha, p)
        r = torch.addcmul(r, alpha, ap, value=-1)  # ap may be inf once stopped; r is unused then
        rr = dot(r, r)
        rnorm_new = norm64(rr)
        rnorm = torch.where(ok, rnorm_new, rnorm)
        iters = iters + ok
        active = ok & (rnorm_new > threshold) & (rnorm_new < inf)  # converged, or rᵀr not finite
        p = torch.where(active, torch.addcmul(r, rr / rz, p), p)
        rz = torch.where(active, rr, rz)
    # why it stopped: converged ⇔ the last accepted ‖r‖ met the tolerance; a stop on pᵀAp ≤ 0 (finite)
    # is negative curvature; anything else (non-finite ‖r₀‖, pᵀAp or rᵀr) a breakdown
    negative = (last_pap <= 0) & (last_pap > -inf)
    code = torch.where(
        (rnorm <= threshold) & (rnorm < inf),
        STOP_REASONS.index("converged"),
        torch.where(negative, STOP_REASONS.index("negative_curvature"), STOP_REASONS.index("breakdown")),
    )
    code = torch.where(active, STOP_REASONS.index("maxiter"), code)
    return x, {"iters": iters, "rnorm": rnorm, "b_norm": b_norm, "stop": code}


#: SGN's own settings (besides :data:`~curvopt.optim.checks.GN_STEP_RANGES`, shared with FGN).
SGN_RANGES: dict[str, Range] = {
    "warm_start": FLAG,
    "log_dispersion": FLAG,
    "cg_float64_dots": FLAG,
}


class SGN(GaussNewtonChecks, AlgorithmBase):
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
        cg_early_exit: ``True``: the project's :func:`~curvopt.curvature.cg.cg` (Python-float
            scalars, two host reads per iteration, stops once converged); ``False``:
            :func:`fixed_length_cg` (all ``cg_maxiter`` iterations, the stopped ones masked, no
            host read; the same iterates to rounding); ``"auto"``: ``True`` on the CPU,
            ``False`` on an accelerator.
        check_finite: ``"eager"``: the batch checks (finite logits, labels in ``[0, C)``) read
            the host before the update; ``"deferred"``: they run on the device, the update (and
            the warm start) is gated on them with ``torch.where`` and the error is raised at the
            step's one read of its logged scalars, parameters untouched; with
            ``host_stats=False`` by :meth:`read_stats` of that step's scalars or by
            :meth:`raise_if_nonfinite` (every deferred step since its last call); ``None``
            (default) or ``"auto"``: eager on the CPU, deferred on an accelerator.
        host_stats: ``True``: :meth:`step` returns Python numbers (one stacked host read at the
            end of the step); ``False``: 0-d device tensors and no host read, for
            :meth:`read_stats` when the caller logs.

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

    log_name = "SGN"

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
        cg_early_exit: bool | str = "auto",
        check_finite: str | None = None,
        host_stats: bool = True,
    ) -> None:
        self._init_step(objective, locals(), SGN_RANGES)
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
        z, grad, operator, _, _ = self._linearise(params, x, y, deferred=False)
        return z, grad, operator

    def _linearise(
        self, params: Params, x: Tensor, y: Tensor, deferred: bool
    ) -> tuple[Tensor, Params, Callable, Tensor, Tensor | None]:
        """:meth:`ggn_operator` plus the labels to use and the deferred checks' flags."""
        z, vjp_z, jvp_z, _ = linear_maps(lambda p: self.objective.forward(p, x), params)
        z = z.detach()
        flags = None
        if deferred:
            flags = batch_flags(z, y)
            y = y.clamp(0, z.shape[1] - 1)  # out-of-range labels must not index on the device
        else:
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

        return z, grad, operator, y, flags

    def step(self, batch: Batch) -> dict[str, Any]:
        """One SGN update ``w ← w + α d`` on ``batch``.

        Args:
            batch: ``(x, y)`` with integer labels in ``[0, C)``.

        Returns:
            The logged scalars of the module docstring plus ``cg_stop``: Python numbers, or with
            ``host_stats=False`` 0-d tensors (and the pending checks) for :meth:`read_stats`.

        Raises:
            ValueError: If the batch cannot define a margin (no update is made).
            FloatingPointError: If the logits are not finite (no update is made).
        """
        x, y = batch
        params = self.objective.params()
        deferred = self.check_finite == "deferred"
        z, grad, operator, y, flags = self._linearise(params, x, y, deferred)
        rhs = flatten(grad).neg_()
        x0 = self.previous if self.warm_start else None
        if self.cg_early_exit:
            result = cg(
                operator, rhs, x0=x0, tol=self.cg_tol, maxiter=self.cg_maxiter, dot_dtype=self.cg_dot_dtype
            )
            solution = result.x
            info = None
        else:
            solution, info = fixed_length_cg(
                operator, rhs, x0=x0, tol=self.cg_tol, maxiter=self.cg_maxiter, dot_dtype=self.cg_dot_dtype
            )
            result = None
        with torch.no_grad():
            step_vector = solution
            if flags is not None:  # a refused batch changes nothing (nan included)
                ok = batch_ok(flags)
                step_vector = torch.where(ok, solution, 0.0)
                solution = step_vector if x0 is None else torch.where(ok, solution, x0)
            direction = unflatten(step_vector, params)
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
            if info is not None:
                b_norm = info["b_norm"]
                stats["cg_iters"] = info["iters"]
                stats["cg_residual"] = torch.where(b_norm > 0, info["rnorm"] / b_norm, info["rnorm"])
                stats["cg_stop"] = info["stop"]
        out: dict[str, Any] = dict(stats)
        if result is not None:
            out.update(
                cg_iters=int(result.iterations),
                cg_residual=float(result.rel_residual),
                cg_stop=result.stop_reason,
            )
        out.update(lr=self.lr, damping=self.damping, _checks=(flags, z.shape[1], self.steps))
        if self.host_stats:
            out = self.read_stats(out)  # raises a deferred error before anything below
        else:
            self._defer_checks(flags, z.shape[1])
        self.previous = solution if self.warm_start else None
        self.steps += 1
        return out

    def _cg_breakdown(self, out: dict[str, Any]) -> bool:
        if not isinstance(out["cg_stop"], str):
            out["cg_stop"] = STOP_REASONS[int(out["cg_stop"])]
        return out["cg_stop"] in ("negative_curvature", "breakdown")

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
