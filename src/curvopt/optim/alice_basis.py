"""Alice's linear algebra: the subspace iteration, the Switch and the compensation reference.

The pieces of :class:`curvopt.optim.alice.Alice` that act on one basis (paper Algorithms 2, 3
and 10): top eigenvectors with canonical signs, subspace iteration with the Rayleigh–Ritz
back-mapping, the orthonormal complement, the seeded complement draw of a switch (and the Fig. 5b
ablations), and the explicit compensation of Alg. 3 (the reference the fused form is tested
against). Each works on one matrix; ``canonical_signs`` also on a ``(k, m, r)`` stack.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

SWITCH_MODES = ("complement", "none", "gaussian", "gaussian_mix", "full_basis")
SEED_STRIDE = 1_000_003


def canonical_signs(U: Tensor) -> Tensor:
    """Flip each column so that its largest-magnitude entry is positive.

    Eigenvectors are defined up to sign, and the complement basis from a QR depends on those
    signs; fixing them makes a switch reproducible across LAPACK builds and devices (and lets the
    NumPy reference in the tests follow the same path).

    Args:
        U: A matrix whose columns are eigenvectors, or a ``(k, m, r)`` stack of them.

    Returns:
        ``U`` with columns multiplied by ±1.
    """
    idx = U.abs().argmax(dim=-2, keepdim=True)
    sign = torch.gather(U, -2, idx)
    return U * torch.where(sign < 0, -1.0, 1.0).to(U.dtype)  # a zero column keeps its sign: +1


def top_eigvecs(A: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-``k`` eigenpairs of a symmetric matrix, eigenvalues descending, canonical signs.

    Args:
        A: A square matrix (symmetrised as ``(A + Aᵀ)/2``).
        k: Number of eigenpairs.

    Returns:
        ``(eigenvalues (k,), eigenvectors (m, k))``.
    """
    evals, evecs = torch.linalg.eigh(0.5 * (A + A.T))
    order = torch.argsort(evals, descending=True)[:k]
    return evals[order], canonical_signs(evecs[:, order])


def subspace_iteration(
    matvec: Callable[[Tensor], Tensor], U0: Tensor, steps: int = 1
) -> tuple[Tensor, Tensor]:
    """Subspace iteration, the paper's Alg. 10, with the Rayleigh–Ritz back-mapping.

    ``steps`` of ``U ← QR(A U)``, then ``U · eigvecs(Uᵀ A U)`` sorted by descending eigenvalue
    (the Rayleigh–Ritz lift corrects a typo of Alg. 10; docs/decisions.md, RACS-11).

    Args:
        matvec: ``X ↦ A X`` for a symmetric A, applied to m×r blocks.
        U0: Starting m×r basis.
        steps: Number of QR steps.

    Returns:
        ``(U, eigenvalues)``: the m×r Ritz basis (canonical signs) and its r Ritz values.
    """
    U = U0
    for _ in range(steps):
        U, _ = torch.linalg.qr(matvec(U))
    V = U.T @ matvec(U)
    evals, evecs = torch.linalg.eigh(0.5 * (V + V.T))
    order = torch.argsort(evals, descending=True)
    return canonical_signs(U @ evecs[:, order]), evals[order]


def complement_basis(U: Tensor) -> Tensor:
    """Orthonormal basis of the orthogonal complement of ``span(U)``.

    The last columns of the complete QR of ``U`` (the paper's ``QR(U)``).

    Args:
        U: An m×r matrix with orthonormal columns.

    Returns:
        The m×(m−r) complement basis.
    """
    m, r = U.shape
    Qfull, _ = torch.linalg.qr(U, mode="complete")
    return Qfull[:, r:]


def switch_generator(seed: int, n_switch: int) -> torch.Generator:
    """CPU generator for the ``n_switch``-th switch of the matrix with seed ``seed``.

    Args:
        seed: The matrix's seed (base seed and parameter index, kept in the state).
        n_switch: How many switches this matrix has made.

    Returns:
        A seeded ``torch.Generator`` on the CPU.
    """
    return torch.Generator(device="cpu").manual_seed((int(seed) * SEED_STRIDE + int(n_switch)) % (2**63 - 1))


@torch.compiler.disable  # Dynamo (torch 2.13) does not honour an explicit generator here: draws would differ
def sample_indices(gen: torch.Generator, population: int, k: int) -> Tensor:
    """``k`` indices drawn uniformly without replacement from ``range(population)`` (CPU).

    Args:
        gen: CPU random generator.
        population: Size of the range.
        k: Number of indices.

    Returns:
        A 1-D long tensor of ``k`` distinct indices.
    """
    return torch.randperm(population, generator=gen)[:k]


@torch.compiler.disable  # as sample_indices: the seeded draw must stay eager
def _unit_gaussian(m: int, k: int, gen: torch.Generator, like: Tensor) -> Tensor:
    X = torch.randn(m, k, generator=gen, dtype=torch.float64).to(device=like.device, dtype=like.dtype)
    return X / torch.linalg.vector_norm(X, dim=0, keepdim=True).clamp_min(1e-30)


def switch_basis(Up: Tensor, r: int, lead: int, gen: torch.Generator, mode: str = "complement") -> Tensor:
    """Switch (the paper's Alg. 2) and the Fig. 5b variants: the next projection basis.

    Args:
        Up: The new leading basis, m×r, columns sorted by eigenvalue.
        r: Rank.
        lead: Number l of leading vectors kept (capped at r).
        gen: CPU generator for the random draws.
        mode: ``"complement"`` (Alg. 2: top l, the rest drawn from the orthonormal complement),
            ``"none"`` (``Up`` itself), ``"gaussian"``, ``"gaussian_mix"`` or ``"full_basis"``.

    Returns:
        The m×r projection (``Up`` when ``r ≥ m``).

    Raises:
        ValueError: If ``mode`` is unknown.
    """
    m = Up.shape[0]
    if mode == "none" or r >= m:
        return Up
    if mode == "gaussian":
        return _unit_gaussian(m, r, gen, Up)
    lead = min(lead, r)
    if mode == "gaussian_mix":
        return torch.cat([Up[:, :lead], _unit_gaussian(m, r - lead, gen, Up)], dim=1)
    Uc = complement_basis(Up)  # m×(m−r)
    if mode == "full_basis":
        # r−l directions from the m−l non-leading ones: Up[:, l:] ∪ complement
        candidates = torch.cat([Up[:, lead:], Uc], dim=1)
        idx = sample_indices(gen, m - lead, r - lead).to(Up.device)
        return torch.cat([Up[:, :lead], candidates[:, idx]], dim=1)
    if mode != "complement":
        raise ValueError(f"unknown switch mode {mode!r}; choose one of {SWITCH_MODES}")
    k = min(r - lead, m - r)  # complement directions actually available
    keep = r - k
    idx = sample_indices(gen, m - r, k).to(Up.device)
    return torch.cat([Up[:, :keep], Uc[:, idx]], dim=1)


def compensation_explicit(G: Tensor, U: Tensor, p: Tensor, eps: float) -> Tensor:
    """Alg. 3's compensation ``√(m−r) (G − UUᵀG) Diag(p)^{-1/2}`` formed explicitly (reference path).

    Args:
        G: m×n gradient (oriented so that U spans its rows).
        U: m×r projection basis.
        p: n-vector, the EMA of per-column squared residual norms.
        eps: ε added to ``√p``.

    Returns:
        The m×n compensation.
    """
    m, r = U.shape
    R = G - U @ (U.T @ G)
    return math.sqrt(max(m - r, 0)) * R / (p.sqrt() + eps)[None, :]
