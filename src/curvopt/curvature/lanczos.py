"""Lanczos with full or partial re-orthogonalisation for the extreme eigenpairs of a symmetric operator.

FOSI's Extreme Spectrum Estimation (ESE, FOSI paper Algorithm 1) needs the k largest and ℓ
smallest eigenpairs of a Hessian that is only available as a matrix-vector product. This module
does that for any callable ``matvec(v) -> A v``; it knows nothing about networks.

Numerics follow the FOSI authors' Lanczos (docs/fosi.md, "Choices where the paper is silent, and
deviations from the authors' code"; docs/decisions.md, FOSI-D, FOSI-Q, FOSI-R), with these
deliberate changes:

* **float64 basis, operator in its own dtype.** All Lanczos arithmetic (basis ``Q``, α, β, the
  tridiagonal ``T``, its eigendecomposition and the Ritz vectors) is float64; each basis vector
  is cast to ``operator_dtype`` (the model's dtype) for the product and the result cast back.
  Lanczos loses orthogonality as Ritz values converge, and float32 makes that visible after a
  dozen iterations on a Hessian.
* **Re-orthogonalisation without redundant passes.** The authors project every new vector twice
  against the whole zero-initialised ``m × n`` basis, i.e. ``4 m n`` float64 reads per iteration
  whatever the iteration. Here the projection runs against the ``i + 1`` rows built so far (one
  gemv each way, so ``Q[: i + 1]`` is read as a block), which is the same arithmetic. With
  ``reorth="twice"`` (default) two classical Gram-Schmidt passes are always made, as the
  authors do; ``reorth="dgks"`` first removes the three-term-recurrence components explicitly
  (O(n)) and then makes one classical Gram-Schmidt pass, repeating it only when the pass removed
  more than 1/√2 of the norm (Daniel-Gragg-Kaufman-Stewart: "twice is enough", and once is
  enough when nothing cancels). That halves the re-orthogonalisation cost again with the same
  orthogonality to working precision (tests/curvature/test_fosi_lanczos.py compares both with eigh).
* **Partial re-orthogonalisation** (``reorth="partial"``, FOSI's default; H. D. Simon, "The
  Lanczos algorithm with partial reorthogonalization", Math. Comp. 42 (1984) 115-142, the scheme
  PROPACK (Larsen) uses). Full orthogonality is more than Lanczos needs: Simon showed that if the
  basis stays *semi-orthogonal*, |q_iᵀq_k| ≤ √ε for i ≠ k, then T is the projection of A onto the
  Krylov space up to O(ε‖A‖), so the Ritz values and (orthonormalised) Ritz vectors are as
  accurate as with full re-orthogonalisation. Orthogonality is lost only gradually (as Ritz values
  converge), and the loss can be tracked without touching the basis: the three-term recurrence
  applied to qₖ and q_i gives ω_{i+1,k} = q_{i+1}ᵀq_k from the rows ω_i, ω_{i−1}, α and β,

      β_i ω_{i+1,k} = β_k ω_{i,k+1} + (α_k − α_i) ω_{i,k} + β_{k−1} ω_{i,k−1} − β_{i−1} ω_{i−1,k},

  O(i) scalar operations per iteration, plus a rounding term ε₁‖T‖ added with the sign that
  increases |ω| (ε₁ = max(ε√n, ε_op): one float64 inner product, or the operator's unit roundoff
  when it is coarser), and ω_{i+1,i} = ε₁‖T‖/β_i. Each iteration subtracts the three-term
  components (O(n)); only when max_k |ω_{i+1,k}| > √ε (float64) is a full classical Gram-Schmidt
  pass made, for this vector *and the next one* (whose recurrence still carries this vector's
  large ω), after which both ω rows restart at ε₁ (a second pass only on DGKS cancellation).
  Semi-orthogonality alone gives Ritz values to working precision but Ritz vectors only to
  O(√ε): a pass removes O(√ε β) components that T does not record. So the pass coefficients are
  kept (A Q = Q (T + C) + β_m q_{m+1} e_mᵀ) and the Ritz pairs come from T + C (see
  :func:`_ritz_with_corrections`); the returned vectors are finally orthonormalised
  symmetrically, V ← (VVᵀ)^{-1/2} V (a change at rounding level; FOSI projects onto them). The
  tests check eigenvalues, vectors, residuals and orthonormality against ``twice`` and eigh.
  With a float32 operator the product itself perturbs every new vector by ~ε₃₂‖A‖, so ω passes
  √ε after one step and every vector is projected: the run is then exactly ``dgks`` (same
  passes, T's own Ritz pairs, no orthonormalisation; tested bitwise), at ``dgks``'s cost. After a breakdown restart every later vector is projected too (the recurrence that the
  ω model relies on holds only to ``breakdown_tol`` there).
* **Breakdown guard.** When β_i falls below ``breakdown_tol · ‖T‖`` the Krylov space is (to
  working precision) invariant. Lanczos then continues from a fresh random vector orthogonal to
  the basis with β_i = 0, so T becomes block diagonal, its eigenvalues stay exact eigenvalues of A,
  and k + ℓ pairs can still be returned on operators with few distinct eigenvalues. The authors'
  code divides by zero there.

The number of iterations defaults to m = max(4(k+ℓ), ⌈2 ln n⌉) (paper §3.1; the authors' code uses
4(k+ℓ) only), capped at n. The start vector is a seeded standard normal, so repeated calls with
the same seed start from the same vector, as the JAX code does with ``PRNGKey(0)``; pass a
``generator`` that the caller keeps to draw a fresh vector each call instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

MatVec = Callable[[Tensor], Tensor]
REORTH_MODES = ("twice", "dgks", "partial")
_EPS64 = torch.finfo(torch.float64).eps


class LanczosError(RuntimeError):
    """Lanczos could not produce trustworthy eigenpairs (non-finite values, bad operator)."""


class NonSymmetricOperatorError(LanczosError):
    """The operator failed the symmetry check ``|xᵀAy − yᵀAx| ≤ rtol · ‖x‖‖Ay‖``."""


@dataclass
class LanczosResult:
    """Extreme Ritz pairs of one Lanczos run.

    Attributes:
        eigenvalues: ``(k+ℓ,)`` float64, ordered as in the FOSI code: the ℓ smallest ascending,
            then the k largest ascending, so ``eigenvalues[-1]`` is λ̂₁ and ``eigenvalues[l]``
            is λ̂_k.
        eigenvectors: ``(k+ℓ, n)`` float64 Ritz vectors (rows), in the same order.
        ritz_values: All m Ritz values (ascending); ``ritz_values[0]`` estimates λ_n even when
            ℓ = 0.
        residual_bounds: The classical estimates β_m |s_{m,j}| of ‖A v̂_j − λ̂_j v̂_j‖ for the
            returned pairs (β_m from the three-term recurrence of the last iteration).
        iterations: m, the number of Lanczos iterations (operator products).
        restarts: Breakdowns after which the basis was extended by a random vector.
        reorth_passes: Gram-Schmidt passes against the basis (each reads the i + 1 rows built
            so far twice).
        k: Number of largest eigenpairs requested.
        l: Number of smallest eigenpairs requested (the paper's ℓ).
        omega_max: With ``reorth="partial"``, the largest estimated ``|q_iᵀq_k|`` met (before a
            pass); NaN otherwise.
    """

    eigenvalues: Tensor
    eigenvectors: Tensor
    ritz_values: Tensor
    residual_bounds: Tensor
    iterations: int
    restarts: int
    reorth_passes: int
    k: int
    l: int  # noqa: E741  (the paper's ℓ)
    omega_max: float = float("nan")  # reorth="partial": largest estimated |q_iᵀq_k| met (before a pass)

    @property
    def lambda_max(self) -> float:
        """The largest Ritz value (λ̂₁)."""
        return float(self.eigenvalues[-1]) if self.k > 0 else float(self.ritz_values[-1])

    @property
    def lambda_k(self) -> float:
        """The k-th largest Ritz value (λ̂_k)."""
        return float(self.eigenvalues[self.l]) if self.k > 0 else float("nan")

    @property
    def lambda_min(self) -> float:
        """The smallest Ritz value (estimate of λ_n)."""
        return float(self.ritz_values[0])


def default_num_iters(n: int, k: int, l: int) -> int:  # noqa: E741
    """Default number of Lanczos iterations, ``m = max(4(k+ℓ), ⌈2 ln n⌉)`` capped at n.

    Args:
        n: Dimension of the operator (the Krylov space cannot be larger).
        k: Number of largest eigenpairs wanted.
        l: Number of smallest eigenpairs wanted.

    Returns:
        m.
    """
    return min(n, max(4 * (k + l), math.ceil(2.0 * math.log(max(n, 2)))))


def check_symmetry(
    matvec: MatVec,
    n: int,
    *,
    operator_dtype: torch.dtype,
    device: torch.device | str | None = None,
    rtol: float = 1e-3,
    generator: torch.Generator | None = None,
) -> float:
    """Cheap symmetry test of an operator with two random vectors (2 extra products).

    A Hessian-vector product can fail it when the loss is random (dropout left on) or the
    product is wrong; Lanczos on such an operator returns meaningless Ritz pairs without any
    other sign of trouble.

    Args:
        matvec: ``v ↦ A v``.
        n: Dimension of the operator.
        operator_dtype: Dtype the vectors are cast to before ``matvec``.
        device: Device of the test vectors.
        rtol: Largest relative asymmetry accepted.
        generator: Random generator for the two vectors (the global one if ``None``).

    Returns:
        The relative asymmetry ``|xᵀAy − yᵀAx| / (‖x‖‖Ay‖ + ‖y‖‖Ax‖)``.

    Raises:
        NonSymmetricOperatorError: If the asymmetry is above ``rtol`` or not finite.
    """
    x = torch.randn(n, dtype=torch.float64, device=device, generator=generator)
    y = torch.randn(n, dtype=torch.float64, device=device, generator=generator)
    ax = matvec(x.to(operator_dtype)).to(torch.float64)
    ay = matvec(y.to(operator_dtype)).to(torch.float64)
    scale = float(x.norm() * ay.norm() + y.norm() * ax.norm())
    asym = abs(float(x @ ay - y @ ax)) / max(scale, 1e-300)
    if not math.isfinite(asym) or asym > rtol:
        raise NonSymmetricOperatorError(
            f"operator is not symmetric: |xᵀAy − yᵀAx| / (‖x‖‖Ay‖ + ‖y‖‖Ax‖) = {asym:.3e} > rtol = {rtol:g}. "
            "Lanczos needs a symmetric operator (is the loss random, e.g. dropout on, or the product wrong?)"
        )
    return asym


def lanczos(
    matvec: MatVec,
    n: int,
    k: int,
    l: int = 0,  # noqa: E741
    *,
    num_iters: int | None = None,
    operator_dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    seed: int = 0,
    generator: torch.Generator | None = None,
    start: Tensor | None = None,
    reorth: str = "twice",
    breakdown_tol: float = 1e-10,
    symmetry_check: bool = False,
    symmetry_rtol: float = 1e-3,
) -> LanczosResult:
    """The k largest and ℓ smallest eigenpairs of the symmetric operator ``matvec`` on ℝⁿ.

    The start vector is ``start`` if given, else a standard normal from ``generator`` if given
    (advances it: a fresh vector per call), else from a new generator seeded with ``seed`` (the
    same vector at every call).

    Args:
        matvec: Receives a vector of ``operator_dtype`` on ``device`` and returns ``A v`` (any
            float dtype).
        n: Dimension of the operator.
        k: Number of largest eigenpairs.
        l: Number of smallest eigenpairs (the paper's ℓ).
        num_iters: Lanczos iterations m, in ``[k + ℓ, n]``; default :func:`default_num_iters`.
        operator_dtype: Dtype of the vectors passed to ``matvec`` (the model's dtype); all
            Lanczos arithmetic is float64.
        device: Device of the basis and the vectors.
        seed: Seed of the start vector when neither ``start`` nor ``generator`` is given.
        generator: Generator for the start vector (and for restarts after breakdown).
        start: Explicit start vector of n entries.
        reorth: ``"twice"``, ``"dgks"`` or ``"partial"`` re-orthogonalisation (module
            docstring).
        breakdown_tol: ``β ≤ breakdown_tol · ‖T‖`` counts as breakdown (invariant subspace); the
            basis is then extended by a random orthogonal vector.
        symmetry_check: Run :func:`check_symmetry` first (2 extra products).
        symmetry_rtol: ``rtol`` of the symmetry check.

    Returns:
        A :class:`LanczosResult`.

    Raises:
        ValueError: On inconsistent sizes (``k + ℓ ≥ n``, ``num_iters`` out of range, a start
            vector of the wrong length or zero) or an unknown ``reorth``.
        NonSymmetricOperatorError: If the symmetry check fails.
        LanczosError: If the operator returns non-finite values.
    """
    m = _num_iterations(n, k, l, num_iters, reorth)
    if generator is None and start is None:
        generator = torch.Generator(device="cpu").manual_seed(seed)

    def random_vector() -> Tensor:
        # drawn on the CPU so the vector is the same on every device for a given seed
        return torch.randn(n, dtype=torch.float64, generator=generator).to(device)

    if symmetry_check:
        check_symmetry(matvec, n, operator_dtype=operator_dtype, device=device, rtol=symmetry_rtol)
    K = _Krylov.begin(start, random_vector, n, m, device)
    omega = _OmegaModel.create(m, n, operator_dtype, partial=reorth == "partial")
    for i in range(m):
        w, alpha = _apply_operator(matvec, K, i, operator_dtype)
        if i + 1 == m:
            # β_m for the residual estimates: the recurrence value, no re-orthogonalisation needed
            K.beta_last = float(_subtract_three_term(K, w, i, alpha).norm())
            break
        if reorth == "twice":
            beta = _orthogonalise_twice(K, w, i)
        elif reorth == "partial":
            beta = _orthogonalise_partial(K, omega, w, i, alpha)
        else:
            beta = _orthogonalise_dgks(K, w, i, alpha)
        _next_basis_vector(K, omega, w, beta, i, breakdown_tol, random_vector)
    return _ritz_pairs(K, omega, k, l, device)


# -- Lanczos' phases -------------------------------------------------------------------------------
# Iteration i of the three-term recurrence β_i q_{i+1} = A q_i − α_i q_i − β_{i−1} q_{i−1}:
#   _apply_operator         w = A q_i (in the operator's dtype) and α_i = q_iᵀw
#   _orthogonalise_*        w ← w − α_i q_i − β_{i−1} q_{i−1} (explicitly, or within twice's two
#                           full passes) and the mode's re-orthogonalisation (module docstring);
#                           each returns β_i = ‖w‖
#   _next_basis_vector      q_{i+1} = w/β_i, or a random restart after breakdown
# and once at the end _ritz_pairs: eigenpairs of T (or of T + C) and the Ritz vectors. Basis, α, β
# and counters live in _Krylov; partial re-orthogonalisation's ω estimates (Simon 1984) in
# _OmegaModel.


def _num_iterations(n: int, k: int, l: int, num_iters: int | None, reorth: str) -> int:  # noqa: E741
    """Check the sizes and the mode before any product is spent; returns m."""
    if k < 0 or l < 0 or k + l == 0:
        raise ValueError(f"need k ≥ 0, ℓ ≥ 0 and k + ℓ ≥ 1, got k={k}, ℓ={l}")
    if k + l >= n:
        raise ValueError(
            f"k + ℓ = {k + l} must be smaller than the dimension n = {n}; "
            "for such small problems use torch.linalg.eigh on the dense matrix"
        )
    if reorth not in REORTH_MODES:
        raise ValueError(f"reorth must be one of {REORTH_MODES}, got {reorth!r}")
    m = default_num_iters(n, k, l) if num_iters is None else int(num_iters)
    if not k + l <= m <= n:
        raise ValueError(f"num_iters must lie in [k + ℓ, n] = [{k + l}, {n}], got {m}")
    return m


@dataclass
class _Krylov:
    """The float64 Lanczos basis Q (rows), T's diagonal α and off-diagonal β, and the counters."""

    Q: Tensor  # (m, n) on the device
    alphas: Tensor  # (m,) on the CPU
    betas: Tensor  # (m − 1,) on the CPU
    t_norm: float = 0.0  # running max of |α|, β: the scale breakdown is measured against
    restarts: int = 0
    passes: int = 0  # Gram-Schmidt passes against the basis (cost: 2 reads of Q[: i + 1] each)
    beta_last: float = 0.0  # β_m of the last iteration, for the residual estimates

    @classmethod
    def begin(
        cls,
        start: Tensor | None,
        random_vector: Callable[[], Tensor],
        n: int,
        m: int,
        device: torch.device | str | None,
    ) -> _Krylov:
        """An empty basis whose first row is the normalised start vector (``start`` or random)."""
        f64 = torch.float64
        q = (
            start.detach().to(device=device, dtype=f64).reshape(-1) if start is not None else random_vector()
        ).clone()
        if q.numel() != n:
            raise ValueError(f"start vector has {q.numel()} entries, operator dimension is {n}")
        q_norm = float(q.norm())
        if not math.isfinite(q_norm) or q_norm == 0.0:
            raise ValueError("start vector must be finite and non-zero")
        Q = torch.empty(m, n, dtype=f64, device=device)
        Q[0] = q / q_norm
        return cls(Q, torch.zeros(m, dtype=f64), torch.zeros(max(m - 1, 0), dtype=f64))


@dataclass
class _OmegaModel:
    """Simon's estimates ω_{i,k} ≈ q_iᵀq_k for partial re-orthogonalisation (module docstring).

    Only rows i − 1, i and i + 1 of the ω matrix are kept (``prev``, ``cur``, ``new``, rotated
    after each iteration): tracking the loss of orthogonality then costs O(i) scalar operations
    and never reads the basis. Unused (but allocated) in the other modes.
    """

    partial: bool
    eps1: float  # rounding level of the local recurrence
    tol: float  # √ε: above it semi-orthogonality is about to be lost
    prev: Tensor
    cur: Tensor
    new: Tensor
    C: Tensor | None  # Gram-Schmidt coefficients of the passes: A Q = Q (T + C) + β_m q_{m+1} e_mᵀ
    force_next: bool = False  # the next vector gets a pass too (its recurrence carries a large ω)
    always_full: bool = False  # after a breakdown restart every vector gets a pass
    skipped: int = 0  # iterations that made no pass (the basis is then only semi-orthogonal)
    omega_max: float = 0.0  # largest estimated |q_iᵀq_k| met (before a pass)

    @classmethod
    def create(cls, m: int, n: int, operator_dtype: torch.dtype, partial: bool) -> _OmegaModel:
        """ω rows for m iterations; ω_{1,1} = 1."""
        # rounding level of the local recurrence: an inner product of length n in float64, or the
        # operator's own precision when it is lower (a float32 Hessian product perturbs every new
        # vector by ~ε₃₂‖A‖ in all directions, so ω then exceeds √ε after one step and every vector
        # is projected)
        eps1 = max(_EPS64 * math.sqrt(n), torch.finfo(operator_dtype).eps)
        prev, cur, new = (torch.zeros(m + 1, dtype=torch.float64) for _ in range(3))
        cur[0] = 1.0
        C = torch.zeros(m, m, dtype=torch.float64) if partial else None
        return cls(partial, eps1, math.sqrt(_EPS64), prev, cur, new, C)

    def advance(self, K: _Krylov, i: int, alpha: float, beta: float) -> float:
        """Row i + 1 of ω from rows i and i − 1; returns its largest entry max_k |ω_{i+1,k}|."""
        noise = self.eps1 * K.t_norm
        if i > 0 and beta > 0.0:
            # ω_{i+1,k} = q_{i+1}ᵀq_k, k < i, from the three-term recurrence applied on both sides:
            # β_i ω_{i+1,k} = β_k ω_{i,k+1} + (α_k − α_i) ω_{i,k} + β_{k−1} ω_{i,k−1} − β_{i−1} ω_{i−1,k},
            # plus a rounding term of size ε₁‖T‖ added with the sign that makes |ω| larger
            b = K.betas[:i]
            raw = b * self.cur[1 : i + 1] + (K.alphas[:i] - alpha) * self.cur[:i] - b[i - 1] * self.prev[:i]
            if i > 1:
                raw[1:] += b[: i - 1] * self.cur[: i - 1]
            self.new[:i] = (raw + torch.where(raw >= 0, noise, -noise)) / beta
        self.new[i] = noise / beta if beta > 0.0 else 1.0  # ω_{i+1,i}: the local (rounding-level) term
        self.new[i + 1] = 1.0
        return float(self.new[: i + 1].abs().max())

    def rotate(self) -> None:
        """Move on one row: the new row becomes the current one."""
        self.prev, self.cur, self.new = self.cur, self.new, self.prev


def _apply_operator(matvec: MatVec, K: _Krylov, i: int, operator_dtype: torch.dtype) -> tuple[Tensor, float]:
    """``w = A q_i`` (the product in the operator's dtype, the result in float64) and α_i = q_iᵀw."""
    qi = K.Q[i]
    w = matvec(qi.to(operator_dtype)).to(torch.float64).reshape(-1)
    if w.numel() != K.Q.shape[1]:
        raise ValueError(f"matvec returned {w.numel()} entries for a vector of {K.Q.shape[1]}")
    alpha = float(w @ qi)
    if not math.isfinite(alpha):
        raise LanczosError(
            f"non-finite value α = {alpha} at Lanczos iteration {i}: the operator returned NaN/Inf "
            "(diverged parameters, or a loss that overflows on the ESE batch)"
        )
    K.alphas[i] = alpha
    K.t_norm = max(K.t_norm, abs(alpha))
    return w, alpha


def _subtract_three_term(K: _Krylov, w: Tensor, i: int, alpha: float) -> Tensor:
    """``w ← w − α_i q_i − β_{i−1} q_{i−1}`` in place (O(n): the recurrence's own components)."""
    w.add_(K.Q[i], alpha=-alpha)
    if i > 0:
        w.add_(K.Q[i - 1], alpha=-float(K.betas[i - 1]))
    return w


def _gram_schmidt(basis: Tensor, w: Tensor) -> None:
    """One classical Gram-Schmidt pass ``w ← w − Qᵀ(Q w)``: one gemv each way over the rows built."""
    w.addmv_(basis.T, basis @ w, alpha=-1.0)


def _orthogonalise_twice(K: _Krylov, w: Tensor, i: int) -> float:
    """The authors' scheme: two full classical Gram-Schmidt passes (they subsume α and β)."""
    basis = K.Q[: i + 1]
    for _ in range(2):
        _gram_schmidt(basis, w)
    K.passes += 2
    return float(w.norm())


def _orthogonalise_dgks(K: _Krylov, w: Tensor, i: int, alpha: float) -> float:
    """Three-term components, one pass, and a second only on cancellation (DGKS criterion)."""
    _subtract_three_term(K, w, i, alpha)
    basis = K.Q[: i + 1]
    before = float(w.norm())
    _gram_schmidt(basis, w)
    beta = float(w.norm())
    K.passes += 1
    if beta < before / math.sqrt(2.0):  # cancellation: one more pass (DGKS criterion)
        _gram_schmidt(basis, w)
        beta = float(w.norm())
        K.passes += 1
    return beta


def _orthogonalise_partial(K: _Krylov, omega: _OmegaModel, w: Tensor, i: int, alpha: float) -> float:
    """Three-term components, then a pass only when the ω estimates say semi-orthogonality is lost."""
    _subtract_three_term(K, w, i, alpha)
    beta = float(w.norm())
    if not math.isfinite(beta):
        raise LanczosError(f"non-finite value β = {beta} at Lanczos iteration {i}")
    K.t_norm = max(K.t_norm, beta)
    worst = omega.advance(K, i, alpha, beta)
    omega.omega_max = max(omega.omega_max, worst)
    if omega.force_next or worst > omega.tol:
        # semi-orthogonality is about to be lost: one classical Gram-Schmidt pass now and one
        # for the next vector (whose recurrence still carries this vector's large ω)
        basis = K.Q[: i + 1]
        before = beta
        for _ in range(2):
            h = basis @ w
            w.addmv_(basis.T, h, alpha=-1.0)
            omega.C[: i + 1, i] += h.cpu()  # A q_i = Q (T + C) e_i + β_i q_{i+1}: kept for the Ritz step
            beta = float(w.norm())
            K.passes += 1
            if beta >= before / math.sqrt(2.0):  # no heavy cancellation: one pass is enough
                break
        omega.new[: i + 1] = omega.eps1
        omega.force_next = omega.always_full or not omega.force_next
    else:
        omega.skipped += 1
    omega.rotate()
    return beta


def _next_basis_vector(
    K: _Krylov,
    omega: _OmegaModel,
    w: Tensor,
    beta: float,
    i: int,
    breakdown_tol: float,
    random_vector: Callable[[], Tensor],
) -> None:
    """``q_{i+1} = w/β_i``; on breakdown a random vector orthogonal to the basis, with β_i = 0.

    The restart keeps T block diagonal, so its eigenvalues stay exact eigenvalues of A and k + ℓ
    pairs can still be returned on operators with few distinct eigenvalues (module docstring).
    """
    if not math.isfinite(beta):
        raise LanczosError(f"non-finite value β = {beta} at Lanczos iteration {i}")
    K.t_norm = max(K.t_norm, beta)
    if beta <= breakdown_tol * max(K.t_norm, 1e-300):
        # invariant subspace: continue from a random vector orthogonal to the basis (β = 0)
        K.restarts += 1
        basis = K.Q[: i + 1]
        w = random_vector()
        for _ in range(2):
            _gram_schmidt(basis, w)
        w_norm = float(w.norm())
        if w_norm == 0.0:  # pragma: no cover - needs i + 1 == n, excluded by m ≤ n
            raise LanczosError("cannot extend the Krylov basis after breakdown")
        K.Q[i + 1] = w / w_norm
        K.betas[i] = 0.0
        if omega.partial:
            # the ω model assumes the three-term recurrence holds to rounding error; across a
            # restart it holds only to breakdown_tol‖T‖, so from here on every vector is projected
            omega.always_full = omega.force_next = True
            omega.cur[: i + 1] = omega.eps1
    else:
        torch.mul(w, 1.0 / beta, out=K.Q[i + 1])
        K.betas[i] = beta


def _ritz_pairs(
    K: _Krylov,
    omega: _OmegaModel,
    k: int,
    l: int,  # noqa: E741
    device: torch.device | str | None,
) -> LanczosResult:
    """Eigenpairs of T (of T + C after partial passes), the selected Ritz vectors and their bounds."""
    m = K.Q.shape[0]
    T = torch.diag(K.alphas)
    if m > 1:
        T += torch.diag(K.betas, 1) + torch.diag(K.betas, -1)
    evals, S = torch.linalg.eigh(T)
    if omega.skipped > 0 and K.passes > 0:  # a semi-orthogonal basis with passes: see _ritz_with_corrections
        evals, S = _ritz_with_corrections(T, omega.C, evals, S)
    if not torch.isfinite(evals).all():
        raise LanczosError(
            f"eigh of the tridiagonal matrix returned non-finite eigenvalues: {evals.tolist()}"
        )
    idx = torch.cat([torch.arange(l), torch.arange(m - k, m)])
    S_sel = S[:, idx].to(device)
    vectors = S_sel.T @ K.Q  # Ritz vectors, one blocked pass over the basis
    if omega.skipped > 0:
        # Ritz vectors from a semi-orthogonal basis need not be orthonormal to working precision
        # (unconverged ones); FOSI projects on them, so orthonormalise symmetrically,
        # V ← (VVᵀ)^{-1/2} V: the nearest orthonormal rows ((k+ℓ)² n flops, two reads of V). When
        # every vector was projected (float32 operators) the basis is orthonormal and this is skipped
        g_val, g_vec = torch.linalg.eigh(vectors @ vectors.T)
        vectors = (g_vec * g_val.clamp_min(1e-300).rsqrt()) @ (g_vec.T @ vectors)
    residuals = (K.beta_last * S[m - 1, idx]).abs()
    return LanczosResult(
        eigenvalues=evals[idx].to(device),
        eigenvectors=vectors,
        ritz_values=evals.to(device),
        residual_bounds=residuals,
        iterations=m,
        restarts=K.restarts,
        reorth_passes=K.passes,
        k=k,
        l=l,
        omega_max=omega.omega_max if omega.partial else float("nan"),
    )


def _ritz_with_corrections(T: Tensor, C: Tensor, evals: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """Ritz pairs of partial re-orthogonalisation, accurate to working precision.

    A pass made when ω reached √ε removes components of size up to √ε β from the new vector that
    the tridiagonal T does not record, so the recurrence is A Q = Q (T + C) + β_m q_{m+1} e_mᵀ with
    C (upper triangular, entries O(√ε ‖T‖)) the Gram-Schmidt coefficients. Eigenvectors of T then
    give Ritz vectors with residuals O(√ε ‖A‖); eigenvectors s of T + C give A(Qs) − θQs =
    β_m s_m q_{m+1} + O(ε‖A‖), as with full re-orthogonalisation. T + C is not symmetric but is
    an O(√ε) perturbation of a symmetric matrix, so its eigenvalues are real unless two of them
    coincide to that level; in that case (complex pairs) T's own pairs are kept.
    """
    ev_c, S_c = torch.linalg.eig(T + C)
    if bool((ev_c.imag != 0).any()) or not bool(torch.isfinite(ev_c.real).all()):
        return evals, S
    order = torch.argsort(ev_c.real)
    S_r = S_c.real[:, order]
    return ev_c.real[order].contiguous(), S_r / S_r.norm(dim=0, keepdim=True)


def dense_matvec(matrix: Tensor) -> MatVec:
    """``v ↦ A v`` for a dense matrix (tests, the quadratic experiments).

    Args:
        matrix: A dense square matrix.

    Returns:
        The matrix-vector product, casting ``v`` to the matrix's dtype.
    """
    return lambda v: matrix @ v.to(matrix.dtype)
