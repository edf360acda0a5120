"""Fast Gauss-Newton building blocks (Korbit & Zanon 2026, arXiv 2605.06081).

Softmax cross-entropy is rewritten exactly as ``ℓ = softplus(s)`` of one scalar per example, the
true-vs-rest margin ``s = logsumexp_{j≠*} z_j − z_*``. Its curvature ``φ''(s) = p_* p_†`` times the
rank-one ``J_sᵀ J_s`` is FGN's curvature; the damped step lives in the b-dimensional row space.
This module holds the pieces both FGN implementations share:

* the batched margin map and its logit-space gradient ``a = ∇_z s = ρ_full − e_y`` (paper 2.7),
* the weights ``√q = √(p_* p_†)`` and ``r̃ = √(p_†/p_*)``, computed from the margin and never
  from ``p`` (which underflows for confident examples),
* the dispersion diagnostic ``ξ = 1 − ‖ρ‖²`` (paper 3.6),
* the closed-form Gram of an affine head (Appendix F.2),
* a fixed-length CG for the b×b row-space system,
* input checks run before any update (labels in range, C ≥ 2, finite logits),
* ``linear_maps``: JVP and VJP closures of a map from one linearisation, shared with SGN.

Dense float64 references for every identity live in ``tests/curvature/test_fgn_identities.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import vjp

log = logging.getLogger(__name__)

#: Margins are clamped to ±MARGIN_CLAMP before forming √q and r̃. At |s| = 80 both factors are
#: e^{±40} (finite in float32) and their product √q·r̃ = p_† is unchanged, so the clamp only
#: alters curvature weights that are already below e^{-40}; see docs/fgn.md.
MARGIN_CLAMP = 80.0


# -- input checks ----------------------------------------------------------------------------------
#: ``check_finite`` settings of FGN and SGN (as RACS's): ``None`` or ``"auto"`` (eager on the CPU,
#: deferred elsewhere), ``"eager"`` or ``"deferred"``.
CHECK_FINITE = (None, "auto", "eager", "deferred")


def resolve_check_finite(check_finite: str | None, device: torch.device) -> str:
    """``"eager"`` or ``"deferred"`` for a ``check_finite`` setting (automatic: eager on the CPU).

    Args:
        check_finite: ``None`` or ``"auto"`` (automatic), ``"eager"`` or ``"deferred"``.
        device: The parameters' device.

    Returns:
        ``"eager"`` or ``"deferred"``.

    Raises:
        ValueError: If ``check_finite`` is none of :data:`CHECK_FINITE`.
    """
    if check_finite not in CHECK_FINITE:
        raise ValueError(f"check_finite must be one of {CHECK_FINITE}, got {check_finite!r}")
    if check_finite in (None, "auto"):
        return "eager" if device.type == "cpu" else "deferred"
    return check_finite


def keep_first_failure(pending: Tensor | None, flags: Tensor) -> Tensor:
    """Accumulate :func:`batch_flags` over steps: the first failing batch's flags, else the newest.

    Args:
        pending: The accumulated flags so far, or ``None``.
        flags: This step's flags.

    Returns:
        The flags :func:`raise_batch_errors` should see at the next check.
    """
    if pending is None:
        return flags
    return torch.where(batch_ok(pending), flags, pending)


def _check_batch_shapes(logits: Tensor, y: Tensor) -> None:
    """The checks that need no value of the batch (shapes, dtypes, C ≥ 2)."""
    if logits.dim() != 2:
        raise ValueError(
            f"FGN/SGN need class logits of shape (batch, C); the model returned shape {tuple(logits.shape)}"
        )
    num_classes = logits.shape[1]
    if num_classes < 2:
        raise ValueError(
            f"the true-vs-rest margin needs at least C = 2 classes; the model has C = {num_classes}"
        )
    if y.dtype.is_floating_point or y.dtype == torch.bool:
        raise ValueError(f"labels must be integer class indices, got dtype {y.dtype}")
    if y.shape != logits.shape[:1]:
        raise ValueError(
            f"labels of shape {tuple(y.shape)} do not match logits of shape {tuple(logits.shape)}"
        )
    if y.numel() == 0:
        raise ValueError("empty batch")


def batch_flags(logits: Tensor, y: Tensor) -> Tensor:
    """The value checks of :func:`check_classification_batch` as one device tensor (no host read).

    Runs the shape checks (which need no value) first.

    Args:
        logits: Model outputs, shape ``(b, C)``.
        y: Integer class labels, shape ``(b,)``.

    Returns:
        A float64 ``(5,)`` tensor: ``[label < 0, label ≥ C, logits not finite, min label,
        max label]`` (flags as 0/1); read it with :func:`raise_batch_errors`.

    Raises:
        ValueError: On the shape checks of :func:`check_classification_batch`.
    """
    _check_batch_shapes(logits, y)
    lo, hi = torch.aminmax(logits)  # one pass; nan propagates, ±inf shows in the extremes
    y_lo, y_hi = torch.aminmax(y)
    return torch.stack(
        [
            y_lo < 0,
            y_hi >= logits.shape[1],
            torch.logical_not(torch.isfinite(lo) & torch.isfinite(hi)),
            y_lo,
            y_hi,
        ]
    ).to(torch.float64)


def batch_ok(flags: Tensor) -> Tensor:
    """A 0-d boolean device tensor: whether :func:`batch_flags` found nothing wrong.

    Args:
        flags: The result of :func:`batch_flags`.

    Returns:
        ``True`` when the labels are in range and the logits finite.
    """
    return flags.narrow(0, 0, 3).sum() == 0


def raise_batch_errors(flags: list[float], num_classes: int) -> None:
    """Raise the error a read :func:`batch_flags` describes (nothing when the batch is fine).

    Args:
        flags: ``batch_flags(...).tolist()``.
        num_classes: C.

    Raises:
        ValueError: If a label lies outside ``[0, C)``.
        FloatingPointError: If a logit is NaN or infinite.
    """
    if flags[0] or flags[1]:
        raise ValueError(
            f"labels must lie in [0, {num_classes}); this batch has labels in [{int(flags[3])}, {int(flags[4])}]"
        )
    if flags[2]:
        raise FloatingPointError(
            "non-finite logits (nan/inf) at the current parameters; no update was made "
            "(the previous step diverged or the inputs hold nan/inf)"
        )


def check_classification_batch(logits: Tensor, y: Tensor) -> None:
    """Raise a clear error before any update when the batch cannot define a margin.

    One host synchronisation for all checks (labels in ``[0, C)``, finite logits); the deferred
    form (:func:`batch_flags` on the device, read later with :func:`raise_batch_errors`) makes none.

    Args:
        logits: Model outputs, shape ``(b, C)``.
        y: Integer class labels, shape ``(b,)``.

    Raises:
        ValueError: If the logits are not 2-D, ``C < 2``, the labels are not integer, have the
            wrong shape, are empty or lie outside ``[0, C)``.
        FloatingPointError: If a logit is NaN or infinite.
    """
    raise_batch_errors(batch_flags(logits, y).tolist(), logits.shape[1])


# -- the margin map ----------------------------------------------------------------------------------
def true_class_mask(logits: Tensor, y: Tensor) -> Tensor:
    """Boolean ``(b, C)`` mask of the true classes.

    An ``arange`` comparison: traceable, unlike ``F.one_hot``, which checks label values on the
    host.

    Args:
        logits: ``(b, C)`` logits (only their shape and device are used).
        y: ``(b,)`` integer labels.

    Returns:
        The ``(b, C)`` mask, ``True`` at ``(i, y_i)``.
    """
    return torch.arange(logits.shape[1], device=logits.device) == y.unsqueeze(1)


def true_vs_rest_margin(logits: Tensor, y: Tensor) -> Tensor:
    """``s_i = logsumexp_{j≠y_i} z_ij − z_{i,y_i}`` (paper 2.3), differentiable in ``logits``.

    The true class is masked to −inf, so the competitor softmax in the backward pass gives it
    weight exactly 0 (no nan: its tangent/cotangent is also 0).

    Args:
        logits: ``(b, C)`` logits z.
        y: ``(b,)`` integer labels.

    Returns:
        The ``(b,)`` margins s.
    """
    mask = true_class_mask(logits, y)
    competitors = logits.masked_fill(mask, float("-inf"))
    true = logits.gather(1, y.unsqueeze(1)).squeeze(1)
    return torch.logsumexp(competitors, dim=1) - true


def competitor_distribution(logits: Tensor, y: Tensor) -> Tensor:
    """``ρ_full``: softmax over the competitors scattered back to length C (0 at the true class).

    Computed as a softmax of the masked logits, not as ``p_j / p_†`` (paper 2.6; stable when
    ``p_†`` underflows).

    Args:
        logits: ``(b, C)`` logits.
        y: ``(b,)`` integer labels.

    Returns:
        The ``(b, C)`` competitor distribution ρ_full.
    """
    return torch.softmax(logits.masked_fill(true_class_mask(logits, y), float("-inf")), dim=1)


def margin_logit_gradient(logits: Tensor, y: Tensor) -> Tensor:
    """Logit-space gradient of the margin, ``a_i = ∇_z s_i = ρ_full,i − e_{y_i}`` (paper 2.7).

    Args:
        logits: ``(b, C)`` logits.
        y: ``(b,)`` integer labels.

    Returns:
        ``a``, shape ``(b, C)``.
    """
    rho = competitor_distribution(logits, y)
    return rho - true_class_mask(logits, y).to(rho.dtype)


def margin_terms(logits: Tensor, y: Tensor, inplace: bool = False) -> tuple[Tensor, Tensor]:
    """Margins ``s`` and ``a = ∇_z s = ρ_full − e_y`` in few passes over the logits.

    The true class is knocked out with a ``scatter`` of −inf (b entries, no b×C mask). The
    competitor softmax is one in-place pass sequence over the b×C buffer: row max ``m``,
    ``exp(z − m)`` (0 at the true class), row sum ``S``, ``ρ = exp(z − m) / S``; the same ``m`` and
    ``S`` give ``logsumexp_{j≠y} z_j = m + log S`` and hence ``s`` (the values of
    :func:`competitor_distribution` and ``torch.logsumexp`` to rounding, but one exponential pass and
    no b×C temporaries instead of two and three). ``a`` is ``ρ`` with −1 scattered into the true
    class (``ρ_y = 0``). The dispersion follows from ``a`` as ``ξ = 2 − ‖a‖²``. With
    ``inplace=True`` the logits tensor itself becomes ``a`` (the closed-form step owns its logits);
    otherwise it is left untouched. Needs finite logits and ``C ≥ 2`` (every row has a finite
    competitor), which :func:`check_classification_batch` ensures.

    Args:
        logits: ``(b, C)`` finite logits.
        y: ``(b,)`` integer labels.
        inplace: Overwrite ``logits`` with ``a`` instead of allocating a copy.

    Returns:
        ``(s, a)``: the ``(b,)`` margins and the ``(b, C)`` gradients.
    """
    index = y.unsqueeze(1)
    true = logits.gather(1, index).squeeze(1)
    a = logits if inplace else logits.clone()
    a.scatter_(1, index, float("-inf"))
    row_max = a.amax(dim=1, keepdim=True)
    a.sub_(row_max).exp_()
    row_sum = a.sum(dim=1, keepdim=True)
    a.div_(row_sum)
    a.scatter_(1, index, -1.0)
    lse = (row_max + row_sum.log()).squeeze(1)
    return lse - true, a


def dispersion_from_gradient(a: Tensor) -> Tensor:
    """Dispersion ``ξ = 1 − ‖ρ‖² = 2 − ‖a‖²`` from the margin gradient ``a = ρ − e_y``.

    Args:
        a: ``(..., C)`` margin gradients.

    Returns:
        ξ, shape ``a.shape[:-1]``.
    """
    return 2.0 - torch.linalg.vector_norm(a, dim=-1).square()


def dispersion(rho: Tensor) -> Tensor:
    """Dispersion ``ξ_i = 1 − ‖ρ_i‖²`` of the competitor distribution (paper 3.6).

    0 for one-hot ρ, at most ``1 − 1/(C−1)``; ``p_† ξ`` is the trace of the logit-space
    curvature FGN drops.

    Args:
        rho: ``(..., C)`` competitor distributions.

    Returns:
        ξ, shape ``rho.shape[:-1]``.
    """
    return 1.0 - (rho * rho).sum(dim=-1)


def fgn_weights(s: Tensor, clamp: float = MARGIN_CLAMP) -> tuple[Tensor, Tensor]:
    """``(√q, r̃)`` with ``q = p_* p_† = φ''(s)`` and ``r̃ = √(p_†/p_*) = e^{s/2}`` (paper 4.5).

    ``√q = exp(−½(softplus(s) + softplus(−s)))`` uses ``−log p_* = softplus(s)`` and
    ``−log p_† = softplus(−s)``, so it neither underflows to 0/0 nor needs ``p``.

    Args:
        s: Margins, any shape.
        clamp: Margins are clamped to ``±clamp`` first (:data:`MARGIN_CLAMP`).

    Returns:
        ``(√q, r̃)``, each shaped like ``s``.
    """
    sc = s.clamp(-clamp, clamp)
    sqrt_q = torch.exp(-0.5 * (F.softplus(sc) + F.softplus(-sc)))
    r_tilde = torch.exp(0.5 * sc)
    return sqrt_q, r_tilde


# -- closed-form affine head -----------------------------------------------------------------------
def affine_gram(
    h: Tensor, a: Tensor, sqrt_q: Tensor | None = None, bias: bool = True, blocks: int = 1
) -> Tensor:
    """Row-space Gram of the margin map of ``z = W h + b`` (Appendix F.2).

    ``∂s_i/∂W = a_i h_iᵀ`` and ``∂s_i/∂b = a_i``, so ``(J Jᵀ)_ij = (h_iᵀh_j + 1)(a_iᵀa_j)``; the
    ``+1`` is the bias. With ``sqrt_q`` the whitened ``K = √q√qᵀ ∘ J Jᵀ`` is returned. Two matmuls,
    ``b²·D + b²·C``, and no autograd.

    ``blocks > 1`` exploits symmetry, as a BLAS ``syrk`` would (PyTorch exposes none): the rows
    are split into ``blocks`` groups and only the ``blocks(blocks+1)/2`` upper block pairs are
    multiplied, each combined (``+1``, ``∘``, ``√q`` scaling) while it is small and mirrored into
    the lower triangle. 4 blocks do 62.5 % of the multiply-adds, which pays on CPUs; on GPUs the
    extra small kernels usually do not (keep 1).

    Args:
        h: ``(b, D)`` head inputs (features).
        a: ``(b, C)`` margin gradients (:func:`margin_terms`).
        sqrt_q: ``(b,)`` curvature weights √q, or ``None`` for the unwhitened ``J Jᵀ``.
        bias: Whether the head has a bias (the ``+1``).
        blocks: Number of row blocks for the symmetric product.

    Returns:
        The ``(b, b)`` Gram matrix.
    """
    b = h.shape[0]
    if blocks <= 1 or b < 2 * blocks:
        gram = h @ h.T
        if bias:
            gram.add_(1.0)
        gram.mul_(a @ a.T)
        if sqrt_q is not None:
            gram.mul_(sqrt_q.unsqueeze(1)).mul_(sqrt_q.unsqueeze(0))
        return gram
    gram = torch.empty(b, b, dtype=h.dtype, device=h.device)
    bounds = [round(k * b / blocks) for k in range(blocks + 1)]
    for i in range(blocks):
        ri = slice(bounds[i], bounds[i + 1])
        for j in range(i, blocks):
            rj = slice(bounds[j], bounds[j + 1])
            block = h[ri] @ h[rj].T
            if bias:
                block.add_(1.0)
            block.mul_(a[ri] @ a[rj].T)
            if sqrt_q is not None:
                block.mul_(sqrt_q[ri, None]).mul_(sqrt_q[None, rj])
            gram[ri, rj] = block
            if j != i:
                gram[rj, ri] = block.T
    return gram


# -- CG on the b×b row-space system -----------------------------------------------------------------
def row_space_cg(
    matvec: Callable[[Tensor], Tensor],
    rhs: Tensor,
    tol: float = 1e-5,
    maxiter: int = 5,
    early_exit: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Hestenes-Stiefel CG from ``x0 = 0`` for the SPD ``b×b`` system ``B u = r̃``.

    FGN needs its own CG rather than the project's generic ``curvature.cg``: the unknown is one
    small vector, so every iteration can be written with masked (``torch.where``) updates and no
    data-dependent Python branch. With ``early_exit=False`` the loop always runs ``maxiter`` times
    (converged or broken-down iterations become no-ops), which is what ``torch.compile`` /
    CUDA graphs need; with ``early_exit=True`` (eager default) it stops as soon as no iteration is
    active, at the cost of one host sync per iteration.

    Stopping rule (SciPy/JAX semantics, paper defaults): iterate while ``k < maxiter`` and
    ``‖r_k‖ > tol·‖rhs‖`` (``atol = 0``). A non-positive ``pᵀBp`` (breakdown from round-off on
    a nearly singular system) ends the solve without using that direction.

    Args:
        matvec: ``u ↦ B u`` on b-vectors.
        rhs: The right-hand side r̃, shape ``(b,)``.
        tol: Relative residual tolerance.
        maxiter: Number of iterations (the paper's default 5).
        early_exit: Stop the Python loop once no iteration is active (see above).

    Returns:
        ``(u, info)`` with ``info`` holding tensors ``iters`` (int), ``rel_residual``
        (``‖r‖/‖rhs‖`` of the recursively updated residual) and ``breakdown`` (bool).
    """
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    p = r.clone()
    rs = torch.dot(r, r)
    rhs_norm2 = rs.clone()
    threshold = (tol * tol) * rhs_norm2
    iters = torch.zeros((), dtype=torch.long, device=rhs.device)
    # pᵀBp of the last active iteration (1: none yet); a non-positive (or NaN) one was a breakdown
    last_curvature = torch.ones((), dtype=rs.dtype, device=rhs.device)
    active = rs > threshold  # while active, rs > threshold ≥ 0: rs_new / rs needs no guard
    for _ in range(maxiter):
        if early_exit and not bool(active):
            break
        bp = matvec(p)
        curvature = torch.dot(p, bp)
        last_curvature = torch.where(active, curvature, last_curvature)
        step = active & (curvature > 0)
        alpha = torch.where(step, rs / curvature, 0.0)  # 0 for a masked iteration: x, r unchanged
        x = x + alpha * p
        r = r - alpha * bp
        rs_new = torch.dot(r, r)
        beta = rs_new / rs  # only used where step holds
        p = torch.where(step, r + beta * p, p)
        rs = torch.where(step, rs_new, rs)
        iters = iters + step
        active = step & (rs > threshold)
    breakdown = torch.logical_not(last_curvature > 0)
    rel = torch.sqrt(rs / torch.where(rhs_norm2 > 0, rhs_norm2, torch.ones_like(rhs_norm2)))
    return x, {"iters": iters, "rel_residual": rel, "breakdown": breakdown}


def log_breakdown(method: str, step: int, info: dict[str, Any]) -> None:
    """Log a CG breakdown once per occurrence.

    The step itself is still taken with the iterate reached before the breakdown, which is a
    descent direction.

    Args:
        method: Method name for the message (``"FGN"``, ``"SGN"``).
        step: Outer step number.
        info: The ``info`` dict of :func:`row_space_cg` (its ``iters`` is logged).
    """
    log.warning(
        "%s step %d: CG breakdown (non-positive curvature p^T B p from round-off) after %d iterations; "
        "the solve was ended there",
        method,
        step,
        int(info["iters"]),
    )


# -- linearisation ------------------------------------------------------------------------------------
def linear_maps(
    fn: Callable[[dict[str, Tensor]], Tensor],
    params: dict[str, Tensor],
    has_aux: bool = False,
) -> tuple[Any, Callable[[Tensor], dict[str, Tensor]], Callable[[dict[str, Tensor]], Tensor], Any]:
    """One linearisation of ``fn`` at ``params``: ``(out, vjp_fn, jvp_fn, aux)``.

    ``vjp_fn(u) = Jᵀu`` reuses the forward graph. ``jvp_fn(v) = J v`` is obtained by the
    *transpose trick*: ``u ↦ Jᵀu`` is linear, so its own VJP is ``v ↦ J v``. The graph of
    ``vjp_fn`` is recorded during its first call (a product the caller needs anyway) and reused
    by every ``jvp_fn`` call; each ``J v`` then costs one backward pass over that graph and needs
    no second forward.
    We use it instead of ``torch.func.linearize`` (which re-traces the forward with ``make_fx``
    on every outer step: ~1 s per step for a 2048×1024 head on 2 CPU cores) and of
    ``torch.func.jvp`` (which recomputes the primal each call).

    Args:
        fn: Maps a name → tensor dict to an output tensor (and an auxiliary value with
            ``has_aux``).
        params: The point of linearisation.
        has_aux: ``fn`` returns ``(out, aux)``.

    Returns:
        ``(out, vjp_fn, jvp_fn, aux)``: the output, ``u ↦ Jᵀu`` (to a parameter dict),
        ``v ↦ J v`` (from a parameter dict) and the auxiliary value (``None`` without
        ``has_aux``).
    """
    if has_aux:
        out, pullback, aux = vjp(fn, params, has_aux=True)
    else:
        out, pullback = vjp(fn, params)
        aux = None

    def raw_vjp(u: Tensor) -> dict[str, Tensor]:
        return pullback(u)[0]

    state: dict[str, Any] = {}

    def vjp_fn(u: Tensor) -> dict[str, Tensor]:
        if "pushforward" in state:
            return raw_vjp(u)
        # first call: record this VJP's graph as well, so J·v needs no extra pass to build it
        result, state["pushforward"] = vjp(raw_vjp, u)
        return result

    def jvp_fn(v: dict[str, Tensor]) -> Tensor:
        if "pushforward" not in state:
            vjp_fn(torch.zeros_like(out))
        return state["pushforward"](v)[0]

    return out, vjp_fn, jvp_fn, aux
