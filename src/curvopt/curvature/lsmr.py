"""LSMR (Fong & Saunders 2011) on torch tensors, with the SHF paper's validation-merit stopping.

Why our own solver instead of ``scipy.sparse.linalg.lsmr``:

* the operators are JVP/VJP closures on torch tensors (possibly on a GPU); SciPy would force a
  host round-trip and float64 numpy vectors every iteration;
* SHF-LSMR (Algorithm 6 of the paper) stops LSMR on a *validation merit* evaluated at
  geometrically spaced iterations, which SciPy cannot express;
* SciPy has no preconditioner argument; right diagonal preconditioning is built in here.

The recurrences, including the estimates of ‖r̄‖ (extra rotations on β̈/β̂/τ̃), ‖Ā‖, cond(Ā) and
‖Āᵀr̄‖ = |ζ̄|, follow Fong & Saunders' paper as SciPy implements them, so with merit stopping off the
iterates, ``istop`` and ``itn`` match SciPy's (tests/curvature/test_shf_lsmr.py). All recurrence scalars are
python floats (float64) whatever the vector dtype: the bidiagonalisation accumulates round-off and
the paper ran in Float64. An iteration reads the device once: ``‖u‖`` and ``‖v‖`` stacked (the
normalisations divide by them on the device); SciPy's tests take ``‖x‖`` along with the next
iteration's read, and the validation merit, when given, is read at its scheduled iterations.

Problem solved (``A`` is m×n, ``c`` the optional right preconditioner, ``damp`` = λ)::

    min_x  ‖A diag(c) x − b‖² + λ² ‖x − x0‖²

i.e. with a warm start the damping pulls toward ``x0`` (the increment is what LSMR builds), exactly
as SciPy's ``lsmr(..., x0=)`` and the paper's Eq. (19) do. ``x`` is the preconditioned variable
(the paper's y); the original-space point is ``c ∘ x`` (:attr:`LSMRResult.solution`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

Matvec = Callable[[Tensor], Tensor]

#: istop → stop reason. 0–7 are SciPy's codes; 8–11 are ours.
STOP_REASONS: dict[int, str] = {
    0: "x0_is_solution",  # A^T b = 0 (or A^T r0 = 0): nothing to do
    1: "compatible",  # ‖r‖/‖b‖ <= btol + atol ‖A‖‖x‖/‖b‖
    2: "atol",  # ‖Āᵀr̄‖ / (‖Ā‖ ‖r̄‖) <= atol: least-squares solution good enough
    3: "conlim",  # cond(Ā) >= conlim
    4: "compatible_eps",
    5: "atol_eps",
    6: "conlim_eps",
    7: "maxiter",
    8: "merit_ftol",  # validation merit stagnated (paper: f_k == f_min and small relative progress)
    9: "merit_recover",  # validation merit did not recover its minimum within `recover` iterations
    10: "breakdown",  # β_{k+1} = 0 or α_{k+1} = 0: the Krylov space is exhausted, x_k is exact
    11: "nonfinite",  # a recurrence scalar or the merit became NaN/inf
}


@dataclass
class LSMRResult:
    """SciPy's eight return values plus diagnostics.

    Iterating (or indexing 0–7) yields ``(x, istop, itn, normr, normar, norma, conda, normx)`` in
    SciPy's order, so ``x, istop, itn, *_ = lsmr(...)`` works as a drop-in replacement.

    Attributes:
        x: The solution in the preconditioned variable (a tensor, or numpy in numpy mode).
        istop: Stop code, a key of :data:`STOP_REASONS`.
        itn: Number of iterations run.
        normr: Estimate of ``‖r̄‖``, the residual norm of the (damped) problem.
        normar: Estimate of ``‖Āᵀr̄‖``.
        norma: Estimate of the Frobenius norm ``‖Ā‖``.
        conda: Estimate of ``cond(Ā)``.
        normx: ``‖x‖``.
        stop_reason: ``STOP_REASONS[istop]``.
        merit_history: ``(iteration, merit value)`` at every merit evaluation; iteration 0 is
            φ(x0).
        best_itn: Iteration of the lowest merit (0 = x0); ``None`` without a merit.
        best_merit: The lowest merit; ``None`` without a (finite) merit.
        returned_best: ``True`` when ``x`` is the best-merit iterate, not the last one.
        precond: The right preconditioner ``c`` used, or ``None``.
    """

    x: Any
    istop: int
    itn: int
    normr: float
    normar: float
    norma: float
    conda: float
    normx: float
    stop_reason: str = ""
    #: (iteration, merit value) at every merit evaluation; iteration 0 is φ(x0)
    merit_history: list[tuple[int, float]] = field(default_factory=list)
    best_itn: int | None = None  # iteration of the lowest merit (0 = x0)
    best_merit: float | None = None
    returned_best: bool = False  # True when `x` is the best-merit iterate, not the last one
    precond: Tensor | None = None

    def _scipy(self) -> tuple:
        return (self.x, self.istop, self.itn, self.normr, self.normar, self.norma, self.conda, self.normx)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._scipy())

    def __getitem__(self, index: int) -> Any:
        return self._scipy()[index]

    def __len__(self) -> int:
        return 8

    @property
    def solution(self) -> Any:
        """The original-space point ``c ∘ x`` (``x`` itself without a preconditioner)."""
        return self.x if self.precond is None else self.precond * self.x


def sym_ortho(a: float, b: float) -> tuple[float, float, float]:
    """Stable Givens rotation of ``(a, b)``.

    Args:
        a: First component.
        b: Second component (the one rotated to 0).

    Returns:
        ``(c, s, r)`` with ``r = hypot(a, b) >= 0``, ``c = a/r``, ``s = b/r``.
    """
    if b == 0.0:
        return (math.copysign(1.0, a) if a != 0.0 else 1.0), 0.0, abs(a)
    if a == 0.0:
        return 0.0, math.copysign(1.0, b), abs(b)
    if abs(b) > abs(a):
        tau = a / b
        s = math.copysign(1.0, b) / math.sqrt(1.0 + tau * tau)
        c = s * tau
        r = b / s
    else:
        tau = b / a
        c = math.copysign(1.0, a) / math.sqrt(1.0 + tau * tau)
        s = c * tau
        r = a / c
    return c, s, r


def _norm(t: Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


def as_operator(A: Any) -> tuple[Matvec, Matvec, tuple[int, int], bool]:
    """Turn the accepted kinds of operator into ``(matvec, rmatvec, shape, numpy_mode)``.

    Args:
        A: One of

            * a dense or sparse torch matrix;
            * ``(matvec, rmatvec, shape)``, or any object with ``matvec``/``rmatvec``/``shape``
              whose methods take and return torch tensors (a "torch LinearOperator");
            * a numpy array, scipy sparse matrix or ``scipy.sparse.linalg.LinearOperator``: the
              vectors are converted at each call and the solution is returned as numpy
              (``numpy_mode``).

    Returns:
        ``(matvec, rmatvec, (m, n), numpy_mode)``: ``v ↦ A v``, ``u ↦ Aᵀ u`` on torch vectors,
        the shape, and whether ``A`` is a numpy/SciPy object.

    Raises:
        ValueError: If a tensor ``A`` is not 2-D.
        TypeError: If ``A`` is of none of the kinds above.
    """
    if isinstance(A, Tensor):
        if A.dim() != 2:
            raise ValueError(f"A must be a matrix, got shape {tuple(A.shape)}")
        return (lambda v: A @ v), (lambda u: A.mH @ u), (int(A.shape[0]), int(A.shape[1])), False
    if isinstance(A, tuple) and len(A) == 3 and callable(A[0]) and callable(A[1]):
        return A[0], A[1], (int(A[2][0]), int(A[2][1])), False
    module = type(A).__module__
    if isinstance(A, np.ndarray) or module.startswith("scipy"):
        import scipy.sparse.linalg as spla

        op = spla.aslinearoperator(A)

        def mv(v: Tensor) -> Tensor:
            return torch.from_numpy(np.asarray(op.matvec(v.cpu().numpy())).reshape(-1))

        def rmv(u: Tensor) -> Tensor:
            return torch.from_numpy(np.asarray(op.rmatvec(u.cpu().numpy())).reshape(-1))

        return mv, rmv, (int(op.shape[0]), int(op.shape[1])), True
    if hasattr(A, "matvec") and hasattr(A, "rmatvec") and hasattr(A, "shape"):
        return A.matvec, A.rmatvec, (int(A.shape[0]), int(A.shape[1])), False
    raise TypeError(f"cannot use {type(A).__name__} as an operator; pass (matvec, rmatvec, shape)")


@torch.no_grad()
def lsmr(
    A: Any,
    b: Any,
    damp: float = 0.0,
    atol: float = 1e-6,
    btol: float = 1e-6,
    conlim: float = 1e8,
    maxiter: int | None = None,
    show: bool = False,
    x0: Any = None,
    *,
    precond: Tensor | None = None,
    merit: Callable[[Tensor], float] | None = None,
    ftol: float = 1e-5,
    miniter: int = 50,
    recover: int = 100,
    merit_first: int = 5,
    merit_growth: float = 1.25,
    return_best: bool = False,
    damp_center: str = "x0",
    callback: Callable[[int, Tensor], None] | None = None,
) -> LSMRResult:
    """Solve ``min ‖A diag(c) x − b‖² + damp² ‖x − x0‖²`` by LSMR.

    Arguments up to ``x0`` mirror :func:`scipy.sparse.linalg.lsmr`; the result unpacks to
    SciPy's ``(x, istop, itn, normr, normar, norma, conda, normx)``. Breakdown (β or α becoming
    exactly 0) finishes the current iteration — whose iterate is then the exact minimiser on the
    Krylov space — and stops.

    Args:
        A: The m×n operator, any kind :func:`as_operator` accepts.
        b: Right-hand side of length m (torch, or numpy with a numpy/SciPy ``A``).
        damp: Damping λ (the paper's regulariser; λ² multiplies the penalty).
        atol: Tolerance of SciPy's tests on ``‖Āᵀr̄‖/(‖Ā‖‖r̄‖)`` (and, with ``btol``, on the
            relative residual).
        btol: Relative residual tolerance of SciPy's compatibility test (ignored with a merit).
        conlim: Stop when the estimate of ``cond(Ā)`` reaches it (ignored with a merit).
        maxiter: Iteration cap; defaults to ``min(m, n)``.
        show: Print a short iteration log.
        x0: Starting point (in the preconditioned variable); ``None`` starts from 0.
        precond: Vector ``c`` of right diagonal preconditioning: LSMR runs on ``v ↦ A(c∘v)``,
            ``u ↦ c∘(Aᵀu)``; ``x``, ``x0`` and the merit's argument are in that scaled
            variable.
        merit: SHF's validation merit φ (Algorithm 6), a function of the current ``x``. When
            given, it is evaluated at ``x0`` and at iterations ``k = merit_first,
            ceil(merit_growth·k), …`` (capped at ``maxiter``), and

            * stops with ``merit_ftol`` when ``k > miniter``, φ_k is the lowest so far and
              ``(φ_prev − φ_k)/φ_k < (k − k_prev)·ftol`` (Martens-style relative progress);
            * stops with ``merit_recover`` when ``k > miniter``, φ_k is above the minimum and
              more than ``recover`` iterations have passed since it;
            * of SciPy's tests only ``test2 = ‖Āᵀr̄‖/(‖Ā‖‖r̄‖) <= atol`` stays on (the paper's
              rule); ``btol`` and ``conlim`` are ignored.
        ftol: Relative-progress tolerance of the ``merit_ftol`` stop, per iteration.
        miniter: Iterations before either merit stop may fire.
        recover: Iterations the merit may stay above its minimum before ``merit_recover``.
        merit_first: First iteration at which the merit is evaluated after ``x0``.
        merit_growth: Growth factor of the merit evaluation points.
        return_best: Return the best-merit iterate instead of the last one (the paper's
            Algorithm 6 tracks it but returns the last iterate).
        damp_center: What the damping pulls toward when ``x0`` is given. ``"x0"`` (default;
            SciPy, the paper's Eq. (19) and Algorithm 6): ``min ‖A diag(c) x − b‖² +
            damp²‖x − x0‖²``. ``"zero"`` (the normal equations ``(AᵀA + λ²I)d = Aᵀb`` of the
            paper's Algorithm 1, x0 only a starting point): ``min ‖A diag(c) x − b‖² +
            damp²‖x‖²``, solved as the undamped problem ``min ‖[A diag(c); damp·I] x − [b; 0]‖``
            from x0 (‖Ā‖, ‖r̄‖ and the atol test are those of the stacked operator). Without
            ``x0`` (or with ``damp = 0``) the two are the same problem.
        callback: Called as ``callback(itn, x)`` after every iteration (tests, diagnostics).

    Returns:
        An :class:`LSMRResult`.

    Raises:
        ValueError: If ``damp_center`` is unknown or ``b`` does not match ``A``'s rows.
        TypeError: If ``A`` is not a usable operator, or ``damp_center="zero"`` is combined with
            a numpy/SciPy operator.
    """
    if damp_center not in ("x0", "zero"):
        raise ValueError(f"damp_center must be 'x0' or 'zero', got {damp_center!r}")
    if damp_center == "zero" and x0 is not None and float(damp) != 0.0:
        return _lsmr_damped_toward_zero(
            A,
            b,
            damp,
            x0,
            precond,
            atol=atol,
            btol=btol,
            conlim=conlim,
            maxiter=maxiter,
            show=show,
            merit=merit,
            ftol=ftol,
            miniter=miniter,
            recover=recover,
            merit_first=merit_first,
            merit_growth=merit_growth,
            return_best=return_best,
            callback=callback,
        )
    prob = _Problem.build(A, b, precond)
    maxiter = int(min(prob.m, prob.n) if maxiter is None else maxiter)
    damp = float(damp)
    s, normb = _initialise(prob, x0)
    if s.normar == 0 or normb == 0:  # Aᵀb = 0 (or Aᵀr0 = 0): x0 is the solution
        if normb == 0 and x0 is None:
            s.x.zero_()
        return _finish(prob, s, None, istop=0, itn=0, show=False)
    tracker = None
    if merit is not None:
        tracker = _MeritTracker(
            merit, maxiter, ftol, miniter, recover, merit_first, merit_growth, return_best
        )
        tracker.start(s.x)
    if show:
        print(f"LSMR: {prob.m}x{prob.n}, damp={damp:.3e}, atol={atol:.1e}, maxiter={maxiter}")
    ctol = 1.0 / conlim if conlim > 0 else 0.0

    # One host read per iteration: ‖u‖ and ‖v‖ of the bidiagonalisation, stacked. SciPy's tests
    # also need ‖x_k‖; it rides on the next iteration's read (the test of iteration k is decided
    # there, before anything of iteration k+1 reaches the state or x), and is read on its own only
    # after the last iteration. A stop found that way costs the next iteration's two products.
    itn, istop = 0, 0
    pending: Tensor | None = None  # ‖x_itn‖ on the device, awaiting SciPy's tests of iteration itn
    pending_test2 = math.nan
    while itn < maxiter:
        norms = _bidiagonalise_device(s, prob)
        host = torch.stack(norms if pending is None else [*norms, pending]).tolist()
        if pending is not None:
            istop = _scipy_stop_code(s, itn, pending_test2, normb, host[2], atol, btol, ctol, maxiter, show)
            pending = None
            if istop:
                break
        itn += 1
        _bidiagonalise_host(s, host[0], host[1])
        rot = _rotate(s, damp)
        _update_iterate(s, rot)
        _estimate_residual_norm(s, rot)
        test2 = _estimate_operator_norms(s, rot, itn)
        if callback is not None:
            callback(itn, s.x)
        if not all(math.isfinite(t) for t in (s.normr, s.normar, s.zeta, s.rho, s.rhobar)):
            istop = 11
        elif tracker is not None:
            istop = _merit_stop_code(tracker, s, itn, test2, atol, maxiter)
        elif itn >= maxiter:
            istop = _scipy_stop_code(s, itn, test2, normb, _norm(s.x), atol, btol, ctol, maxiter, show)
        else:
            pending, pending_test2 = torch.linalg.vector_norm(s.x), test2
        if istop:
            break
    return _finish(prob, s, tracker, istop, itn, show)


# -- LSMR's phases ---------------------------------------------------------------------------------
# One iteration of Fong & Saunders' LSMR, in their notation and SciPy's order:
#   _bidiagonalise_*          Golub–Kahan: β_{k+1} u_{k+1} = A v_k − α_k u_k, α_{k+1} v_{k+1} = Aᵀu_{k+1} − β_{k+1} v_k
#   _rotate                   P̂_k (damping), P_k (B → R) and P̄_k (Rᵀ → R̄): ρ, ρ̄, θ, θ̄, ζ, ζ̄
#   _update_iterate           h̄_k, x_k, h_{k+1}
#   _estimate_residual_norm   ‖r̄_k‖ from Q̂, Q and Q̃ applied to the right-hand side
#   _estimate_operator_norms  ‖Ā‖, cond(Ā) and ‖Āᵀr̄_k‖ = |ζ̄_{k+1}|
# then one of the two stopping rules: SHF's (Algorithm 6, _merit_stop_code) or SciPy's
# (_scipy_stop_code). The phases share one mutable _LSMRState and must run in this order: each
# reads the scalars of the current iteration that the previous one wrote.


@dataclass(slots=True)
class _Problem:
    """The operator and right-hand side as the iteration sees them: torch vectors, ``A diag(c)``."""

    matvec: Matvec  # v ↦ A(c∘v)
    rmatvec: Matvec  # u ↦ Aᵀu; the c∘ is fused into the bidiagonalisation update
    m: int
    n: int
    b: Tensor
    c: Tensor | None  # the right preconditioner
    numpy_mode: bool  # A came from numpy/SciPy: b, x0 and the returned x are numpy

    @classmethod
    def build(cls, A: Any, b: Any, precond: Tensor | None) -> _Problem:
        """Check ``b`` against ``A``, pick the working dtype and fold ``c`` into the product."""
        matvec, rmatvec, (m, n), numpy_mode = as_operator(A)
        b_t = torch.as_tensor(np.asarray(b) if numpy_mode else b)
        if b_t.dim() > 1:
            b_t = b_t.squeeze()
        if numpy_mode:
            b_t = b_t.to(torch.float64)
        if b_t.numel() != m:
            raise ValueError(f"b has {b_t.numel()} entries, A has {m} rows")
        dtype, device = b_t.dtype, b_t.device
        if not dtype.is_floating_point and not dtype.is_complex:
            dtype = torch.float64
            b_t = b_t.to(dtype)
        c = None if precond is None else torch.as_tensor(precond, dtype=dtype, device=device).reshape(-1)
        if c is not None:
            # v ↦ A(c∘v) through one scratch vector (no per-iteration allocation); the c∘ of
            # u ↦ c∘Aᵀu is applied in the bidiagonalisation update (_bidiagonalise_device)
            scratch = torch.empty(n, dtype=dtype, device=device)
            mv0 = matvec
            matvec = lambda v: mv0(torch.mul(c, v, out=scratch))
        return cls(matvec, rmatvec, m, n, b_t, c, numpy_mode)

    def out(self, x: Tensor) -> Any:
        """``x`` in the caller's kind (numpy in numpy mode)."""
        return x.cpu().numpy() if self.numpy_mode else x


@dataclass(slots=True)
class _LSMRState:
    """Everything one LSMR iteration carries to the next (Fong & Saunders' notation).

    Vectors in parameter space are stored as (scalar, buffer) pairs, v = sv·vt, h = sh·ht,
    h̄ = shb·hbt: normalising v and the axpby updates then cost one fused pass each instead of
    two (on CPU these passes over P-sized vectors rival the J·v/Jᵀu products at small batches).
    All scalars are python floats (float64) whatever the vector dtype.
    """

    # Golub–Kahan bidiagonalisation
    u: Tensor
    vt: Tensor
    sv: float
    alpha: float
    beta: float
    # the iterate and the directions h, h̄
    x: Tensor
    ht: Tensor
    sh: float
    hbt: Tensor
    shb: float
    # rotations P̂, P, P̄
    zetabar: float
    alphabar: float
    rho: float
    rhobar: float
    cbar: float
    sbar: float
    zeta: float
    # ‖r̄‖ estimation (rotations Q̂, Q, Q̃ on the right-hand side)
    betadd: float
    betad: float
    rhodold: float
    tautildeold: float
    thetatilde: float
    dsum: float
    # ‖Ā‖ and cond(Ā) estimation
    norma2: float
    maxrbar: float
    minrbar: float
    # the current estimates
    normr: float
    normar: float
    norma: float
    conda: float


class _Rotations(NamedTuple):
    """The scalars of one iteration's rotations that the later phases of that iteration need."""

    chat: float  # P̂_k (damping)
    shat: float
    cc: float  # P_k
    ss: float
    rhoold: float  # ρ_{k−1}
    rhobarold: float  # ρ̄_{k−1}
    thetanew: float  # θ_{k+1}
    thetabar: float  # θ̄_k
    rhotemp: float  # c̄_{k−1} ρ_k, for the cond(Ā) estimate
    zetaold: float  # ζ_{k−1}


def _initialise(prob: _Problem, x0: Any) -> tuple[_LSMRState, float]:
    """First bidiagonalisation step β₁u₁ = b − A x0, α₁v₁ = Aᵀu₁ and the recurrences' start values.

    Returns the state and ‖b‖ (SciPy's order of initialisation).
    """
    dtype, device, n = prob.b.dtype, prob.b.device, prob.n
    u = prob.b.clone()
    if x0 is None:
        x = torch.zeros(n, dtype=dtype, device=device)
        normb = beta = _norm(prob.b)
    else:
        x = torch.as_tensor(np.asarray(x0) if prob.numpy_mode else x0).to(dtype=dtype, device=device)
        x = x.reshape(-1).clone()
        u = u - prob.matvec(x).to(dtype)
        # ‖b‖ and ‖b − A x0‖ in one read
        normb, beta = torch.stack([torch.linalg.vector_norm(prob.b), torch.linalg.vector_norm(u)]).tolist()
    if beta > 0:
        u.mul_(1.0 / beta)
        vt = prob.rmatvec(u).to(dtype=dtype, copy=True)
        if prob.c is not None:
            vt.mul_(prob.c)
        alpha = _norm(vt)
    else:
        vt = torch.zeros(n, dtype=dtype, device=device)
        alpha = 0.0
    sv = 1.0 / alpha if alpha > 0 else 1.0
    state = _LSMRState(
        u=u,
        vt=vt,
        sv=sv,
        alpha=alpha,
        beta=beta,
        x=x,
        ht=vt.clone(),
        sh=sv,
        hbt=torch.zeros(n, dtype=dtype, device=device),
        shb=1.0,
        zetabar=alpha * beta,
        alphabar=alpha,
        rho=1.0,  # the paper's Algorithm 6 prints ρ0 ← 0, a typo (0/0 in the first h̄ update)
        rhobar=1.0,
        cbar=1.0,
        sbar=0.0,
        zeta=0.0,
        betadd=beta,
        betad=0.0,
        rhodold=1.0,
        tautildeold=0.0,
        thetatilde=0.0,
        dsum=0.0,
        norma2=alpha * alpha,
        maxrbar=0.0,
        minrbar=1e100,
        normr=beta,
        normar=alpha * beta,
        norma=math.sqrt(alpha * alpha),
        conda=1.0,
    )
    return state, normb


def _bidiagonalise_device(s: _LSMRState, prob: _Problem) -> list[Tensor]:
    """Golub–Kahan step on the device: β u ← A v − α u, then α v ← c∘Aᵀu − β v, with v = sv·vt.

    ``β = |sv|·‖u‖`` stays on the device here: ``u ← sign(sv)·u/‖u‖`` and
    ``vt ← vt − c∘Aᵀu/(β·sv)`` divide by the 0-d tensor ``d = sign(sv)·‖u‖`` (``β·sv = sv²·d``).
    A zero ``‖u‖`` (breakdown) is clamped to the smallest normal number: u is then 0, so ``Aᵀu = 0``
    and vt keeps its value, as the stopping rules expect. :func:`_bidiagonalise_host` finishes the
    step with the two norms read back.

    Returns:
        ``[‖u‖, ‖vt‖]`` as 0-d device tensors, to be read in one go.
    """
    # u ← (A vt − (alpha/sv) u) = (A v − alpha u)/sv, one fused pass (operator outputs are read,
    # never modified, so operators may return a reused buffer)
    torch.add(prob.matvec(s.vt), s.u, alpha=-s.alpha / s.sv, out=s.u)
    nu = torch.linalg.vector_norm(s.u)
    d = torch.clamp_min(nu, torch.finfo(nu.dtype).tiny)
    if s.sv < 0:
        d = d.neg()
    s.u.div_(d)
    # vt ← vt − c∘Aᵀu/(beta·sv) = −(c∘Aᵀu − beta·v)/(beta·sv)
    atu = prob.rmatvec(s.u)
    if prob.c is not None:
        atu = torch.mul(atu, prob.c)
    s.vt.addcdiv_(atu, d, value=-1.0 / (s.sv * s.sv))
    return [nu, torch.linalg.vector_norm(s.vt)]


def _bidiagonalise_host(s: _LSMRState, nu: float, nv: float) -> None:
    """β = |sv|·‖u‖, α = |β·sv|·‖vt‖ and the new sv from the norms :func:`_bidiagonalise_device` read.

    ``beta == 0`` (or ``alpha == 0``) is the breakdown the stopping rules look for; α and v are
    then left as they were.
    """
    s.beta = abs(s.sv) * nu
    if s.beta > 0:
        s.alpha = abs(s.beta * s.sv) * nv
        s.sv = -math.copysign(1.0, s.sv) / nv if nv > 0 else 1.0


def _rotate(s: _LSMRState, damp: float) -> _Rotations:
    """Rotation P̂_k (damping), then P_k turning B into R, then P̄_k turning Rᵀ into R̄."""
    chat, shat, alphahat = sym_ortho(s.alphabar, damp)
    rhoold = s.rho
    cc, ss, s.rho = sym_ortho(alphahat, s.beta)
    thetanew = ss * s.alpha
    s.alphabar = cc * s.alpha
    rhobarold = s.rhobar
    zetaold = s.zeta
    thetabar = s.sbar * s.rho
    rhotemp = s.cbar * s.rho
    s.cbar, s.sbar, s.rhobar = sym_ortho(s.cbar * s.rho, thetanew)
    s.zeta = s.cbar * s.zetabar
    s.zetabar = -s.sbar * s.zetabar
    return _Rotations(chat, shat, cc, ss, rhoold, rhobarold, thetanew, thetabar, rhotemp, zetaold)


def _update_iterate(s: _LSMRState, r: _Rotations) -> None:
    """h̄, x and h updates, each one fused pass over a parameter-sized vector."""
    # h̄ ← h − (θ̄ρ/(ρ_old ρ̄_old)) h̄ = sh·(ht − (θ̄ρ/(ρ_old ρ̄_old))(shb/sh) hbt)
    torch.add(s.ht, s.hbt, alpha=-(r.thetabar * s.rho / (r.rhoold * r.rhobarold)) * s.shb / s.sh, out=s.hbt)
    s.shb = s.sh
    s.x.add_(s.hbt, alpha=s.zeta / (s.rho * s.rhobar) * s.shb)
    # h ← v − (θ/ρ) h = sv·(vt − (θ/ρ)(sh/sv) ht)
    torch.add(s.vt, s.ht, alpha=-(r.thetanew / s.rho) * s.sh / s.sv, out=s.ht)
    s.sh = s.sv


def _estimate_residual_norm(s: _LSMRState, r: _Rotations) -> None:
    """‖r̄‖ estimate: rotations Q̂, Q and Q̃ applied to the right-hand side (extra rotations on β̈/β̂/τ̃).

    Scalar work only; without it the compatibility test (SciPy's test1) and ``normr`` are unknown.
    """
    betaacute = r.chat * s.betadd
    betacheck = -r.shat * s.betadd
    betahat = r.cc * betaacute
    s.betadd = -r.ss * betaacute
    thetatildeold = s.thetatilde
    ctildeold, stildeold, rhotildeold = sym_ortho(s.rhodold, r.thetabar)
    s.thetatilde = stildeold * s.rhobar
    s.rhodold = ctildeold * s.rhobar
    s.betad = -stildeold * s.betad + ctildeold * betahat
    s.tautildeold = (r.zetaold - thetatildeold * s.tautildeold) / rhotildeold
    taud = (s.zeta - s.thetatilde * s.tautildeold) / s.rhodold
    s.dsum += betacheck * betacheck
    s.normr = math.sqrt(s.dsum + (s.betad - taud) ** 2 + s.betadd * s.betadd)


def _estimate_operator_norms(s: _LSMRState, r: _Rotations, itn: int) -> float:
    """‖Ā‖ (Frobenius, from the α's and β's), cond(Ā) (from the ρ̄'s) and ‖Āᵀr̄‖ = |ζ̄|.

    Returns:
        SciPy's ``test2 = ‖Āᵀr̄‖ / (‖Ā‖ ‖r̄‖)``, the test both stopping rules keep.
    """
    s.norma2 += s.beta * s.beta
    s.norma = math.sqrt(s.norma2)
    s.norma2 += s.alpha * s.alpha
    s.maxrbar = max(s.maxrbar, r.rhobarold)
    if itn > 1:
        s.minrbar = min(s.minrbar, r.rhobarold)
    s.conda = max(s.maxrbar, r.rhotemp) / min(s.minrbar, r.rhotemp)
    s.normar = abs(s.zetabar)
    return s.normar / (s.norma * s.normr) if s.norma * s.normr != 0 else math.inf


class _MeritTracker:
    """SHF's validation-merit bookkeeping (Algorithm 6): φ at geometrically spaced iterations.

    Kept apart from the recurrences because the merit is the expensive part (a forward pass over
    the validation batch): it is evaluated only at ``k = merit_first, ceil(growth·k), …``.
    """

    def __init__(
        self,
        merit: Callable[[Tensor], float],
        maxiter: int,
        ftol: float,
        miniter: int,
        recover: int,
        first: int,
        growth: float,
        keep_best: bool,
    ) -> None:
        self.merit, self.maxiter, self.ftol = merit, maxiter, ftol
        self.miniter, self.recover, self.growth, self.keep_best = miniter, recover, growth, keep_best
        self.f_min = math.inf
        self.k_min = 0
        self.k_prev = 0
        self.k_next = min(int(first), maxiter)
        self.x_min: Tensor | None = None
        self.history: list[tuple[int, float]] = []
        self.f_prev = math.nan

    def start(self, x: Tensor) -> None:
        """φ(x0): the reference of the first progress test, and the best point so far."""
        self.f_prev = float(self.merit(x))
        self.history.append((0, self.f_prev))
        self.f_min, self.k_min = (self.f_prev, 0) if math.isfinite(self.f_prev) else (math.inf, 0)
        if self.keep_best:
            self.x_min = x.clone()

    def evaluate(self, itn: int, x: Tensor) -> int:
        """φ at a scheduled iteration and the two merit stops.

        Returns:
            11 (φ not finite), 8 (``merit_ftol``), 9 (``merit_recover``) or 0 (go on; the next
            evaluation point is then scheduled).
        """
        f_k = float(self.merit(x))
        self.history.append((itn, f_k))
        if f_k < self.f_min:
            self.f_min, self.k_min = f_k, itn
            if self.keep_best:
                self.x_min = x.clone()
        if not math.isfinite(f_k):
            return 11
        if (
            itn > self.miniter
            and f_k == self.f_min
            and (self.f_prev - f_k) / f_k < (itn - self.k_prev) * self.ftol
        ):
            return 8
        if itn > self.miniter and f_k > self.f_min and itn > self.k_min + self.recover:
            return 9
        self.k_next = min(math.ceil(self.growth * self.k_next), self.maxiter)
        self.k_prev, self.f_prev = itn, f_k
        return 0

    @property
    def best_merit(self) -> float | None:
        """The lowest merit seen, ``None`` if none was finite."""
        return self.f_min if math.isfinite(self.f_min) else None


def _merit_stop_code(
    tracker: _MeritTracker, s: _LSMRState, itn: int, test2: float, atol: float, maxiter: int
) -> int:
    """Stopping rule with a merit (Algorithm 6): SciPy's ``test2 <= atol``, breakdown, the merit.

    ``btol`` and ``conlim`` play no part: Algorithm 6 has no such tests (docs/decisions.md).

    Returns:
        The ``istop`` code, 0 to go on.
    """
    if test2 <= atol:
        return 2
    if s.beta == 0 or s.alpha == 0:
        return 10
    if itn == tracker.k_next:
        code = tracker.evaluate(itn, s.x)
        if code:
            return code
    return 7 if itn >= maxiter else 0


def _scipy_stop_code(
    s: _LSMRState,
    itn: int,
    test2: float,
    normb: float,
    normx: float,
    atol: float,
    btol: float,
    ctol: float,
    maxiter: int,
    show: bool,
) -> int:
    """SciPy's stopping rules without a merit; a later (lower-numbered) test overrides an earlier one.

    ``normx`` is ``‖x_itn‖``, read by the caller (with the next iteration's norms).

    Returns:
        The ``istop`` code, 0 to go on (10 when the Krylov space is exhausted without a test
        firing, which cannot happen in exact arithmetic and is kept as a guard).
    """
    test1 = s.normr / normb
    test3 = 1.0 / s.conda
    t1 = test1 / (1.0 + s.norma * normx / normb)
    rtol = btol + atol * s.norma * normx / normb
    istop = 0
    if itn >= maxiter:
        istop = 7
    if 1 + test3 <= 1:
        istop = 6
    if 1 + test2 <= 1:
        istop = 5
    if 1 + t1 <= 1:
        istop = 4
    if test3 <= ctol:
        istop = 3
    if test2 <= atol:
        istop = 2
    if test1 <= rtol:
        istop = 1
    if show and (itn <= 10 or itn % 10 == 0 or istop):
        print(f"{itn:6d} normr={s.normr:10.3e} normar={s.normar:10.3e} test1={test1:8.1e} test2={test2:8.1e}")
    if istop == 0 and (s.beta == 0 or s.alpha == 0):
        istop = 10
    return istop


def _finish(
    prob: _Problem, s: _LSMRState, tracker: _MeritTracker | None, istop: int, itn: int, show: bool
) -> LSMRResult:
    """The result: the last iterate, or the best-merit one when ``return_best`` asked for it."""
    x, returned_best = s.x, False
    if tracker is not None and tracker.x_min is not None and tracker.k_min != itn:
        x, returned_best = tracker.x_min, True
    normx = _norm(x)
    if show:
        print(f"LSMR stop: {STOP_REASONS[istop]} itn={itn} normr={s.normr:.3e} normar={s.normar:.3e}")
    return LSMRResult(
        prob.out(x),
        istop,
        itn,
        s.normr,
        s.normar,
        s.norma,
        s.conda,
        normx,
        STOP_REASONS[istop],
        merit_history=tracker.history if tracker is not None else [],
        best_itn=tracker.k_min if tracker is not None else None,
        best_merit=tracker.best_merit if tracker is not None else None,
        returned_best=returned_best,
        precond=prob.c,
    )


def _lsmr_damped_toward_zero(
    A: Any, b: Any, damp: float, x0: Any, precond: Tensor | None, **kw: Any
) -> LSMRResult:
    """LSMR for ``damp_center="zero"``: no damping, on the stacked ``[A diag(c); λI]``.

    The right-hand side is ``[b; 0]`` and the solve starts at x0, so the damping pulls toward 0
    whatever the starting point.
    """
    matvec, rmatvec, (m, n), numpy_mode = as_operator(A)
    if numpy_mode:
        raise TypeError("damp_center='zero' takes torch operators (a tensor or (matvec, rmatvec, shape))")
    b_t = torch.as_tensor(b).reshape(-1)
    lam = float(damp)
    c = None if precond is None else torch.as_tensor(precond, dtype=b_t.dtype, device=b_t.device).reshape(-1)
    out = torch.empty(m + n, dtype=b_t.dtype, device=b_t.device)
    out_top, out_bottom = out[:m], out[m:]  # views built once, not per product
    scratch = torch.empty(n, dtype=b_t.dtype, device=b_t.device)
    halves: dict[tuple, tuple[Tensor, Tensor]] = {}  # LSMR passes the same u storage every time

    def mv(v: Tensor) -> Tensor:
        av = matvec(v if c is None else torch.mul(c, v, out=scratch))
        out_top.copy_(av if av.dim() == 1 else av.reshape(-1))
        torch.mul(v, lam, out=out_bottom)
        return out

    def rmv(u: Tensor) -> Tensor:
        key = (u.data_ptr(), u.stride())
        if key not in halves:
            halves.clear()
            halves[key] = (u[:m], u[m:])
        u_top, u_bottom = halves[key]
        top = rmatvec(u_top)
        if c is not None:
            return (top * c).add_(u_bottom, alpha=lam)
        return torch.add(top, u_bottom, alpha=lam)

    b_aug = torch.cat([b_t, torch.zeros(n, dtype=b_t.dtype, device=b_t.device)])
    res = lsmr((mv, rmv, (m + n, n)), b_aug, damp=0.0, x0=x0, **kw)
    res.precond = c
    return res
