"""Preconditioned conjugate gradient on matrix-free operators (flat torch vectors).

Two solvers share one iteration (:func:`_pcg_iterations`):

* :func:`cg` — the textbook PCG with a relative-residual stop, used by any method that wants a
  plain truncated solve of ``A x = b`` (SGN, FGN variants, tests).
* :func:`martens_cg` — the variant in James Martens' HF code (``conjgrad_1``): it stops on the
  *relative progress of the quadratic model* ``φ(x) = ½ xᵀAx − bᵀx`` rather than on the residual
  (the residual of a damped Gauss-Newton system is a poor proxy for how much the model still
  decreases), and it keeps a geometric set of intermediate iterates for CG-backtracking.

Both stop cleanly when ``pᵀAp ≤ 0`` (negative or zero curvature along the search direction —
possible when the operator is only approximately SPD, e.g. in float32 or with a tiny damping)
and return the last iterate *before* that direction, which is still a descent direction for φ.

The preconditioner is either a callable ``z = precond(r)`` applying ``M⁻¹``, or a tensor holding
the diagonal of ``M`` (then ``z = r / M``), which is the form Martens' code uses.

On a GPU each iteration reads the device once: ``α`` and ``β`` stay 0-d device tensors, and the
iteration's inner products (``pᵀAp``, ``rᵀr``, ``rᵀz`` and Martens' φ) come back in one stacked
read (``benchmarks/dispatch_solvers.py`` counts it; tests/curvature/test_solver_dispatch.py holds
the budget).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

MatVec = Callable[[Tensor], Tensor]
Precond = Callable[[Tensor], Tensor] | Tensor | None

STOP_REASONS = ("converged", "maxiter", "negative_curvature", "breakdown")


@dataclass
class CGResult:
    """Outcome of :func:`cg`.

    Attributes:
        x: The final iterate (flat vector).
        iterations: Number of completed CG iterations.
        residual_norms: ``residual_norms[i]`` is ``‖b − A x_i‖`` of the recursively updated
            residual after ``i`` iterations (``residual_norms[0]`` belongs to ``x0``).
        stop_reason: One of :data:`STOP_REASONS`.
        b_norm: ``‖b‖``, the scale of the relative residual.
    """

    x: Tensor
    iterations: int
    residual_norms: list[float]
    stop_reason: str
    b_norm: float = 0.0

    @property
    def rel_residual(self) -> float:
        """Final ``‖r‖/‖b‖`` (``‖r‖`` itself when ``b = 0``)."""
        last = self.residual_norms[-1]
        return last / self.b_norm if self.b_norm > 0 else last


@dataclass
class MartensCGResult:
    """Outcome of :func:`martens_cg`.

    Attributes:
        x: The final iterate (the warm start of the next solve in Martens' code).
        iterations: Number of completed CG iterations.
        phi: ``phi[i]`` is ``φ(x_i) = ½ x_iᵀAx_i − bᵀx_i`` after ``i`` iterations (``phi[0]``
            at ``x0``).
        stored: ``(i, x_i)`` for every ``i = ceil(5·1.3^j)`` reached, plus the final iterate,
            in increasing ``i`` — the candidates of CG-backtracking.
        stop_reason: One of :data:`STOP_REASONS`.
        residual_norms: ``‖b − A x_i‖`` of the recursively updated residual per iteration.
    """

    x: Tensor
    iterations: int
    phi: list[float]
    stored: list[tuple[int, Tensor]]
    stop_reason: str
    residual_norms: list[float] = field(default_factory=list)

    @property
    def stored_indices(self) -> list[int]:
        """The iteration numbers ``i`` of :attr:`stored`, in increasing order."""
        return [i for i, _ in self.stored]


def _as_precond(precond: Precond) -> Callable[[Tensor], Tensor] | None:
    if precond is None:
        return None
    if isinstance(precond, Tensor):
        diag = precond
        if not bool(torch.all(diag > 0)):
            raise ValueError("a diagonal preconditioner must be strictly positive")
        return lambda r: r / diag
    if callable(precond):
        return precond
    raise TypeError(f"precond must be None, a Tensor (diag of M) or a callable, got {type(precond)}")


def _dot(a: Tensor, b: Tensor) -> float:
    """Inner product accumulated in float64 (CG scalars lose accuracy fast in float32)."""
    return float(torch.dot(a.reshape(-1).double(), b.reshape(-1).double()))


def _native_dot(a: Tensor, b: Tensor) -> float:
    """Inner product in the vectors' own dtype (JAX/SciPy ``cg`` semantics).

    One BLAS ``dot``, no float64 copies: ~7x cheaper than :func:`_dot` on a 2M-vector on one CPU
    core.
    """
    return float(torch.dot(a.reshape(-1), b.reshape(-1)))


def _pcg_iterations(
    matvec: MatVec,
    b: Tensor,
    x0: Tensor | None,
    precond: Precond,
    maxiter: int,
    should_stop: Callable[[int, Tensor, Tensor, float], bool],
    on_iterate: Callable[[int, Tensor, Tensor, float | None], None] | None = None,
    wide: bool = True,
    extra: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> tuple[Tensor, int, str, list[float]]:
    """Core PCG loop shared by both solvers: one host read per iteration.

    ``should_stop(i, x, r, rnorm)`` is asked after every completed iteration ``i`` (and once with
    ``i = 0`` before the first one); ``on_iterate(i, x, r, e)`` sees every completed iterate, with
    ``e`` the host value of ``extra(x, r)`` (a 0-d device tensor in the dots' dtype, e.g. φ's inner
    product; ``None`` without ``extra``).

    The scalars stay on the device: ``α = rᵀz/pᵀAp`` and ``β = r'ᵀz'/rᵀz`` are 0-d tensors
    applied by ``addcmul``, and the iteration's dots ``pᵀAp``, ``rᵀr``, ``rᵀz`` (and ``extra``)
    come back to the host in one stacked read after the iterate, residual and direction updates. A
    stop that the read reveals (non-positive or non-finite ``pᵀAp``) returns the previous iterate,
    which the loop still holds (the updates make new tensors), so the outcome is the textbook
    order's: the same iterates, stops and iteration counts, to the rounding of a fused
    multiply-add. Inner products are accumulated in float64 (``wide``) or in the vectors' dtype.
    Without a preconditioner ``rᵀz = rᵀr`` reuses the residual's dot. ``matvec`` always receives
    the same direction vector (updated in place) and may return a reused buffer: its result is
    read before the next call.
    Returns ``(x, iterations, stop_reason, residual_norms)``.
    """
    apply_m = _as_precond(precond)
    cast: Callable[[Tensor], Tensor] = (lambda t: t.double()) if wide else (lambda t: t)
    x = torch.zeros_like(b) if x0 is None else x0.clone().to(b)
    r = b.clone() if x0 is None else b - matvec(x)

    def dots(x: Tensor, r: Tensor) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
        """``z = M⁻¹r``, ``rᵀr``, ``rᵀz`` and ``extra`` on the device."""
        rd = cast(r)
        rr = torch.dot(rd, rd)
        if apply_m is None:
            z, rz = r, rr
            tail = []
        else:
            z = apply_m(r)
            rz = torch.dot(rd, cast(z))
            tail = [rz]
        if extra is not None:
            tail.append(extra(x, r))
        return z, rr, rz, tail

    z, rr_t, rz_t, tail = dots(x, r)
    host = torch.stack([rr_t, *tail]).tolist()  # the solve's first read
    rr = host[0]
    rz = rr if apply_m is None else host[1]
    rnorms = [math.sqrt(max(rr, 0.0))]
    if on_iterate is not None:
        on_iterate(0, x, r, host[-1] if extra is not None else None)
    if not math.isfinite(rnorms[0]):
        return x, 0, "breakdown", rnorms
    if should_stop(0, x, r, rnorms[0]):
        return x, 0, "converged", rnorms
    p = z.clone()
    for i in range(1, maxiter + 1):
        if rnorms[-1] == 0.0:
            # exact solution reached (possible in float64 on tiny systems): stop, nothing to do
            return x, i - 1, "converged", rnorms
        if not (rz > 0 and math.isfinite(rz)):
            # r ≠ 0 but rᵀM⁻¹r ≤ 0: the preconditioner is not positive definite (or overflow)
            return x, i - 1, "breakdown", rnorms
        ap = matvec(p)
        pap_t = torch.dot(cast(p), cast(ap))
        alpha = rz_t / pap_t
        x_new = torch.addcmul(x, p, alpha)  # x + α p, one pass; x stays for a curvature stop
        r = torch.addcmul(r, ap, alpha, value=-1.0)
        z, rr_t, rz_new_t, tail = dots(x_new, r)
        # z + β p in place (used only if the solve goes on): matvec sees one vector storage
        torch.addcmul(z, p, rz_new_t / rz_t, out=p)
        host = torch.stack([pap_t, rr_t, *tail]).tolist()  # the iteration's one host read
        pap = host[0]
        if not math.isfinite(pap):
            return x, i - 1, "breakdown", rnorms
        if pap <= 0:
            return x, i - 1, "negative_curvature", rnorms
        x = x_new
        rr = host[1]
        rnorms.append(math.sqrt(max(rr, 0.0)))
        if on_iterate is not None:
            on_iterate(i, x, r, host[-1] if extra is not None else None)
        if should_stop(i, x, r, rnorms[-1]):
            return x, i, "converged", rnorms
        rz = rr if apply_m is None else host[2]
        rz_t = rz_new_t
    return x, maxiter, "maxiter", rnorms


def cg(
    matvec: MatVec,
    b: Tensor,
    x0: Tensor | None = None,
    precond: Precond = None,
    tol: float = 1e-5,
    maxiter: int | None = None,
    miniter: int = 0,
    callback: Callable[[int, Tensor, Tensor], None] | None = None,
    atol: float = 0.0,
    dot_dtype: torch.dtype | None = torch.float64,
) -> CGResult:
    """Solve ``A x = b`` for SPD ``A`` given as ``matvec``, by preconditioned CG.

    Stops (``'converged'``) as soon as ``‖r_i‖ ≤ max(tol·‖b‖, atol)`` and ``i ≥ miniter``; the
    residual is the recursively updated one (no extra product). Negative curvature and
    breakdown return the last good iterate (see module docstring).

    Args:
        matvec: ``v ↦ A v`` on flat vectors.
        b: Right-hand side, a 1-D tensor.
        x0: Starting point; ``None`` starts from 0 (and saves one product).
        precond: ``M⁻¹`` as a callable ``r ↦ z``, or the (positive) diagonal of ``M`` as a
            tensor, or ``None``.
        tol: Relative residual tolerance.
        maxiter: Iteration cap; defaults to the dimension ``b.numel()``.
        miniter: Iterations to run before the tolerance test may stop the solve.
        callback: Called as ``callback(i, x_i, r_i)`` for every iterate including ``x_0``.
        atol: Absolute residual tolerance.
        dot_dtype: Inner products accumulated in ``torch.float64`` (default) or, with ``None``,
            in the vectors' own dtype (cheaper on large vectors; what JAX's and SciPy's ``cg``
            do).

    Returns:
        A :class:`CGResult`.

    Raises:
        ValueError: If ``b`` is not 1-D, a tolerance or iteration count is negative, or
            ``dot_dtype`` is neither ``torch.float64`` nor ``None``.
        TypeError: If ``precond`` is of an unsupported type.
    """
    if dot_dtype not in (torch.float64, None):
        raise ValueError(f"dot_dtype must be torch.float64 or None, got {dot_dtype}")
    wide = dot_dtype == torch.float64
    dot = _dot if wide else _native_dot
    if b.dim() != 1:
        raise ValueError(f"cg works on flat vectors; got b of shape {tuple(b.shape)}")
    if maxiter is None:
        maxiter = b.numel()
    if maxiter < 0 or miniter < 0 or tol < 0 or atol < 0:
        raise ValueError("maxiter, miniter, tol and atol must be non-negative")
    b_norm = math.sqrt(dot(b, b))
    threshold = max(tol * b_norm, atol)

    def should_stop(i: int, x: Tensor, r: Tensor, rnorm: float) -> bool:
        return i >= miniter and rnorm <= threshold

    on_iterate = None if callback is None else (lambda i, x, r, _: callback(i, x, r))
    x, iters, reason, rnorms = _pcg_iterations(matvec, b, x0, precond, maxiter, should_stop, on_iterate, wide)
    return CGResult(x=x, iterations=iters, residual_norms=rnorms, stop_reason=reason, b_norm=b_norm)


def martens_store_indices(maxiter: int, start: float = 5.0, factor: float = 1.3) -> list[int]:
    """The iterations at which Martens' CG stores its iterate.

    These are ``ceil(5·1.3^j)`` ≤ ``maxiter`` (5, 7, 9, 11, 15, 19, 25, …), computed by repeated
    multiplication as his code does.

    Args:
        maxiter: Largest iteration to include.
        start: First (unrounded) storage point.
        factor: Growth factor between storage points.

    Returns:
        The increasing list of iteration numbers.
    """
    out, nxt = [], start
    while math.ceil(nxt) <= maxiter:
        out.append(math.ceil(nxt))
        nxt *= factor
    return out


def martens_progress_stop(
    phi: list[float], i: int, gap_ratio: float = 0.1, min_gap: int = 10, tol: float = 5e-4
) -> bool:
    """Martens' relative-progress rule at iteration ``i`` (``phi[j] = φ(x_j)``).

    With ``k = max(min_gap, ceil(gap_ratio·i))``: stop when ``i > k``, ``φ_{i−k} < 0`` and
    ``(φ_i − φ_{i−k}) / φ_i < k·tol`` — i.e. the average per-iteration relative decrease of the
    quadratic over the last ``k`` iterations fell below ``tol``. (φ_i < φ_{i−k} < 0, so the ratio
    is positive and small once progress stalls.)

    Args:
        phi: Values ``φ(x_0), …, φ(x_i)``.
        i: Current iteration.
        gap_ratio: Look-back window as a fraction of ``i``.
        min_gap: Smallest look-back window ``k``.
        tol: Per-iteration relative-progress tolerance.

    Returns:
        ``True`` when the solve should stop.
    """
    k = max(min_gap, math.ceil(gap_ratio * i))
    if i <= k:
        return False
    prev, cur = phi[i - k], phi[i]
    if not prev < 0 or cur == 0.0:
        return False
    return (cur - prev) / cur < k * tol


def martens_cg(
    matvec: MatVec,
    b: Tensor,
    x0: Tensor | None = None,
    precond: Precond = None,
    maxiter: int = 250,
    miniter: int = 1,
    progress_tol: float = 5e-4,
    gap_ratio: float = 0.1,
    min_gap: int = 10,
    store_start: float = 5.0,
    store_factor: float = 1.3,
) -> MartensCGResult:
    """Martens' ``conjgrad_1``: PCG for ``A x = b`` stopped on the quadratic's progress.

    ``φ(x_i) = ½ x_iᵀ A x_i − bᵀ x_i`` is tracked for free as ``½ (−b − r_i)ᵀ x_i`` (``r = b − Ax``).
    The solve stops after iteration ``i ≥ miniter`` when :func:`martens_progress_stop` fires, after
    ``maxiter`` iterations, or on non-positive curvature (keeping ``x_{i−1}``). The caller does the
    warm start (Martens: ``x0 = 0.95·`` previous final iterate).

    Args:
        matvec: ``v ↦ A v`` on flat vectors (the damped Gauss-Newton product).
        b: Right-hand side, a 1-D tensor (minus the gradient).
        x0: Starting point; ``None`` starts from 0.
        precond: As in :func:`cg` (Martens passes the diagonal of ``M``).
        maxiter: Iteration cap (Martens: 250).
        miniter: Iterations before the progress test may stop the solve.
        progress_tol: ``tol`` of :func:`martens_progress_stop` (Martens: 5e-4).
        gap_ratio: Look-back window as a fraction of ``i`` (Martens: 0.1).
        min_gap: Smallest look-back window (Martens: 10).
        store_start: First storage point of :func:`martens_store_indices`.
        store_factor: Growth factor of the storage points.

    Returns:
        A :class:`MartensCGResult`.

    Raises:
        ValueError: If ``b`` is not 1-D or ``maxiter < 1`` or ``miniter < 0``.
    """
    if b.dim() != 1:
        raise ValueError(f"martens_cg works on flat vectors; got b of shape {tuple(b.shape)}")
    if maxiter < 1 or miniter < 0:
        raise ValueError("need maxiter >= 1 and miniter >= 0")
    store_at = set(martens_store_indices(maxiter, store_start, store_factor))
    phi: list[float] = []
    stored: list[tuple[int, Tensor]] = []
    neg_b = -b

    def phi_dot(x: Tensor, r: Tensor) -> Tensor:
        # 2φ(x) = (−b − r)ᵀx in float64 on the device; read with the iteration's other dots
        return torch.dot(torch.sub(neg_b, r).double(), x.double())

    def on_iterate(i: int, x: Tensor, r: Tensor, phi2: float | None) -> None:
        assert phi2 is not None
        phi.append(0.5 * phi2)
        if i in store_at:
            stored.append((i, x.clone()))

    def should_stop(i: int, x: Tensor, r: Tensor, rnorm: float) -> bool:
        if i == 0:
            return rnorm == 0.0  # x0 solves the system exactly: nothing to do
        return i >= miniter and martens_progress_stop(phi, i, gap_ratio, min_gap, progress_tol)

    x, iters, reason, rnorms = _pcg_iterations(
        matvec, b, x0, precond, maxiter, should_stop, on_iterate, wide=True, extra=phi_dot
    )
    if not stored or stored[-1][0] != iters:
        stored.append((iters, x.clone()))
    return MartensCGResult(
        x=x, iterations=iters, phi=phi, stored=stored, stop_reason=reason, residual_norms=rnorms
    )
