"""Lanczos with full re-orthogonalisation for the extreme eigenpairs of a symmetric operator.

FOSI's Extreme Spectrum Estimation (ESE, FOSI paper Algorithm 1) needs the k largest and ℓ
smallest eigenpairs of a Hessian that is only available as a matrix-vector product. This module
does that for any callable ``matvec(v) -> A v``; it knows nothing about networks.

Numerics follow the FOSI authors' Lanczos (spec fosi.md §2.2), with three deliberate changes:

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
  orthogonality to working precision (tests/test_fosi_lanczos.py compares both with eigh).
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
REORTH_MODES = ("twice", "dgks")


class LanczosError(RuntimeError):
    """Lanczos could not produce trustworthy eigenpairs (non-finite values, bad operator)."""


class NonSymmetricOperatorError(LanczosError):
    """The operator failed the symmetry check ``|xᵀAy − yᵀAx| ≤ rtol · ‖x‖‖Ay‖``."""


@dataclass
class LanczosResult:
    """Extreme Ritz pairs of one Lanczos run.

    ``eigenvalues`` (k+ℓ,) and ``eigenvectors`` (k+ℓ, n) are float64 and ordered as in the FOSI
    code: the ℓ smallest ascending, then the k largest ascending, so ``eigenvalues[-1]`` is λ̂₁ and
    ``eigenvalues[l]`` is λ̂_k. ``ritz_values`` holds all m Ritz values (ascending), from which
    ``ritz_values[0]`` estimates λ_n even when ℓ = 0. ``residual_bounds`` are the classical
    estimates β_m |s_{m,j}| of ‖A v̂_j − λ̂_j v̂_j‖ for the returned pairs (β_m from the three-term
    recurrence of the last iteration). ``reorth_passes`` counts Gram-Schmidt passes against the
    basis (each reads the i + 1 rows built so far twice).
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

    @property
    def lambda_max(self) -> float:
        return float(self.eigenvalues[-1]) if self.k > 0 else float(self.ritz_values[-1])

    @property
    def lambda_k(self) -> float:
        """The k-th largest Ritz value (λ̂_k)."""
        return float(self.eigenvalues[self.l]) if self.k > 0 else float("nan")

    @property
    def lambda_min(self) -> float:
        return float(self.ritz_values[0])


def default_num_iters(n: int, k: int, l: int) -> int:  # noqa: E741
    """m = max(4(k+ℓ), ⌈2 ln n⌉), capped at n (the Krylov space cannot be larger)."""
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
    """Cheap symmetry test with two random vectors (2 extra products): returns the relative
    asymmetry ``|xᵀAy − yᵀAx| / (‖x‖‖Ay‖ + ‖y‖‖Ax‖)`` and raises
    :class:`NonSymmetricOperatorError` above ``rtol``. A Hessian-vector product can fail it when
    the loss is random (dropout left on) or the product is wrong; Lanczos on such an operator
    returns meaningless Ritz pairs without any other sign of trouble."""
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
    """k largest and ℓ smallest eigenpairs of the symmetric operator ``matvec`` on ℝⁿ.

    ``matvec`` receives a vector of ``operator_dtype`` on ``device`` and returns ``A v`` (any
    float dtype). The start vector is ``start`` if given, else a standard normal from
    ``generator`` if given (advances it: a fresh vector per call), else from a new generator
    seeded with ``seed`` (the same vector at every call).
    """
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
    f64 = torch.float64
    if generator is None and start is None:
        generator = torch.Generator(device="cpu").manual_seed(seed)

    def random_vector() -> Tensor:
        # drawn on the CPU so the vector is the same on every device for a given seed
        return torch.randn(n, dtype=f64, generator=generator).to(device)

    if symmetry_check:
        check_symmetry(matvec, n, operator_dtype=operator_dtype, device=device, rtol=symmetry_rtol)

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
    alphas = torch.zeros(m, dtype=f64)
    betas = torch.zeros(max(m - 1, 0), dtype=f64)
    t_norm = 0.0  # running max of |α|, β: the scale breakdown is measured against
    restarts = 0
    passes = 0  # Gram-Schmidt passes against the basis (cost: 2 reads of Q[: i + 1] each)
    beta_last = 0.0
    for i in range(m):
        qi = Q[i]
        w = matvec(qi.to(operator_dtype)).to(f64).reshape(-1)
        if w.numel() != n:
            raise ValueError(f"matvec returned {w.numel()} entries for a vector of {n}")
        alpha = float(w @ qi)
        if not math.isfinite(alpha):
            raise LanczosError(
                f"non-finite value α = {alpha} at Lanczos iteration {i}: the operator returned NaN/Inf "
                "(diverged parameters, or a loss that overflows on the ESE batch)"
            )
        alphas[i] = alpha
        t_norm = max(t_norm, abs(alpha))
        basis = Q[: i + 1]
        if i + 1 == m:
            # β_m for the residual estimates: the recurrence value, no re-orthogonalisation needed
            w.add_(qi, alpha=-alpha)
            if i > 0:
                w.add_(Q[i - 1], alpha=-float(betas[i - 1]))
            beta_last = float(w.norm())
            break
        if reorth == "twice":
            for _ in range(2):
                w.addmv_(basis.T, basis @ w, alpha=-1.0)
            passes += 2
            beta = float(w.norm())
        else:
            w.add_(qi, alpha=-alpha)
            if i > 0:
                w.add_(Q[i - 1], alpha=-float(betas[i - 1]))
            before = float(w.norm())
            w.addmv_(basis.T, basis @ w, alpha=-1.0)
            beta = float(w.norm())
            passes += 1
            if beta < before / math.sqrt(2.0):  # cancellation: one more pass (DGKS criterion)
                w.addmv_(basis.T, basis @ w, alpha=-1.0)
                beta = float(w.norm())
                passes += 1
        if not math.isfinite(beta):
            raise LanczosError(f"non-finite value β = {beta} at Lanczos iteration {i}")
        t_norm = max(t_norm, beta)
        if beta <= breakdown_tol * max(t_norm, 1e-300):
            # invariant subspace: continue from a random vector orthogonal to the basis (β = 0)
            restarts += 1
            w = random_vector()
            for _ in range(2):
                w.addmv_(basis.T, basis @ w, alpha=-1.0)
            w_norm = float(w.norm())
            if w_norm == 0.0:  # pragma: no cover - needs i + 1 == n, excluded by m ≤ n
                raise LanczosError("cannot extend the Krylov basis after breakdown")
            Q[i + 1] = w / w_norm
            betas[i] = 0.0
        else:
            torch.mul(w, 1.0 / beta, out=Q[i + 1])
            betas[i] = beta
    T = torch.diag(alphas)
    if m > 1:
        T += torch.diag(betas, 1) + torch.diag(betas, -1)
    evals, S = torch.linalg.eigh(T)
    if not torch.isfinite(evals).all():
        raise LanczosError(
            f"eigh of the tridiagonal matrix returned non-finite eigenvalues: {evals.tolist()}"
        )
    idx = torch.cat([torch.arange(l), torch.arange(m - k, m)])
    S_sel = S[:, idx].to(device)
    vectors = S_sel.T @ Q  # Ritz vectors, one blocked pass over the basis
    residuals = (beta_last * S[m - 1, idx]).abs()
    return LanczosResult(
        eigenvalues=evals[idx].to(device),
        eigenvectors=vectors,
        ritz_values=evals.to(device),
        residual_bounds=residuals,
        iterations=m,
        restarts=restarts,
        reorth_passes=passes,
        k=k,
        l=l,
    )


def dense_matvec(matrix: Tensor) -> MatVec:
    """``v ↦ A v`` for a dense matrix (tests, the quadratic experiments)."""
    return lambda v: matrix @ v.to(matrix.dtype)
