"""The FOSI paper's quadratic experiments (§4.3, A.4, B.2; docs/fosi.md): problems and a
batched float64 implementation of the update rules the authors used for Figures 3, 4, 7, 8, 9.

The authors' quadratic scripts do not call their optimizer library. They use short update rules
in which the Newton part carries an EMA momentum with α = 1 (FOSI-HB: mn ← βmn + (1−β)·nd), and
FOSI-GD/-HB take the base learning rate times λ̂₁/λ̂₁₀ (c = ∞). These rules are the library's
``variant="quadratic"`` (``curvopt.optim.fosi.VARIANTS``): EMA Newton momentum, α = 1, c = ∞;
tests/experiments/test_fosi_quadratics.py checks that the library FOSI and this engine give the same
trajectories. The engine exists because the sweeps need ~15,000 runs of 200 iterations: here a
whole sweep advances as one batch of matrix products, which takes seconds on two cores.

The ESE is the library's Lanczos (``curvopt.curvature.lanczos``) on the exact Hessian, once at θ₀
(the Hessian is constant), k = 10, ℓ = 0, m = 4k, float64, start vector seeded with 0.

Random bases: the Q1/Q2 uniforms are drawn from ``torch.Generator().manual_seed(0)``, not the
authors' JAX ``PRNGKey(0)``, so those bases are not the authors'. The Q3/Q4 rotations are: the
authors call scipy's ``special_ortho_group.rvs`` under ``numpy.random.seed(1234)`` (reset per
(b, ζ)); scipy < 1.16 drew it with a Householder loop over legacy ``RandomState`` normals, scipy ≥
1.16 (scipy PR #22304) with a QR of a normal matrix, a different matrix for the same seed.
``special_ortho_group_legacy`` is the old loop (bit-equal to scipy 1.10.1 for ζ ≤ 100), the default
``rotation="legacy"``; ``rotation="scipy"`` uses the installed scipy (the rotations of the records
before this change). Eigenvector signs from ``eigh`` (which fix θ₀ inside the rotated block) are
torch's and may still differ from the authors' JAX ``eigh``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from curvopt.curvature.lanczos import dense_matvec, lanczos

F64 = torch.float64
OPTIMIZERS = ("adam", "fosi_adam", "hb", "fosi_hb", "gd", "fosi_gd")
LABELS = {
    "adam": "Adam",
    "fosi_adam": "FOSI-Adam",
    "hb": "HB",
    "fosi_hb": "FOSI-HB",
    "gd": "GD",
    "fosi_gd": "FOSI-GD",
}
ADAM_LR = 0.05  # tuned by the authors on f_{1.14,50} over {0.001, …, 1.0}


@dataclass
class Quadratic:
    """f(θ) = ½ θᵀHθ with its exact spectrum (descending) and start point."""

    H: Tensor  # (n, n)
    eigenvalues: Tensor  # (n,) descending
    theta0: Tensor  # (n,)

    @property
    def n(self) -> int:
        return self.H.shape[0]

    def f(self, theta: Tensor) -> Tensor:
        return 0.5 * theta @ self.H @ theta


@dataclass
class ESEResult:
    eigenvalues: Tensor  # (r,) ascending: λ̂_k … λ̂₁
    eigenvectors: Tensor  # (r, n) rows

    @property
    def scale(self) -> float:
        """λ̂₁/λ̂_k, the unclipped (c = ∞) learning-rate scale."""
        return float(self.eigenvalues[-1] / self.eigenvalues[0])


@functools.lru_cache(maxsize=4)
def random_basis(n: int, seed: int = 0) -> Tensor:
    """Eigenvectors of AAᵀ with A_ij ~ U(0, 1) (columns, ascending eigenvalues of AAᵀ); cached,
    since Q1 reuses one basis for five spectra (an eigh of 1500×1500 each otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    A = torch.rand(n, n, generator=gen, dtype=F64)
    _, vecs = torch.linalg.eigh(A @ A.T)
    return vecs


def start_point(basis: Tensor) -> Tensor:
    """θ₀ = Q x₀′ with x₀′ = ½·𝟙 except x₀′[1] = 1 (the authors' ``get_x_initial``)."""
    x = torch.full((basis.shape[0],), 0.5, dtype=F64)
    x[1] = 1.0
    return basis @ x


def q1_problem(n: int, lambda1: float, seed: int = 0) -> Quadratic:
    """Fig. 3: λ₁ given, λ₂ = 1, λ_i = λ_{i−1}/1.5 (repeated division, as in the paper)."""
    lam = [float(lambda1), 1.0]
    for _ in range(2, n):
        lam.append(lam[-1] / 1.5)
    eig = torch.tensor(lam[:n], dtype=F64)
    Q = random_basis(n, seed)
    return Quadratic(H=(Q * eig) @ Q.T, eigenvalues=eig, theta0=start_point(Q))


def q2_problem(n: int = 100, seed: int = 0) -> Quadratic:
    """Fig. 4: λ₁..₁₀ = linspace(9, 10) and λ₁₁..₁₀₀ = linspace(0.01, 0.1), descending."""
    eig = torch.cat(
        [torch.linspace(9, 10, 10, dtype=F64).flip(0), torch.linspace(0.01, 0.1, n - 10, dtype=F64).flip(0)]
    )
    Q = random_basis(n, seed)
    return Quadratic(H=(Q * eig) @ Q.T, eigenvalues=eig, theta0=start_point(Q))


def q3_grid() -> tuple[np.ndarray, np.ndarray]:
    """The (b, ζ) grid of the authors' ``run_grid_kappa_zeta``."""
    bs = np.concatenate((np.arange(1.10, 1.14, 0.01), np.arange(1.14, 1.17, 0.002)))
    zetas = np.concatenate((np.arange(2, 20, 2), np.arange(20, 80, 10), np.arange(80, 102, 2)))
    return bs, zetas


ROTATIONS = ("legacy", "scipy")


def special_ortho_group_legacy(dim: int, random_state: np.random.RandomState) -> np.ndarray:
    """scipy's ``special_ortho_group.rvs(dim)`` as it was before scipy 1.16 (what the authors ran):
    dim − 1 Householder reflections from standard normals, then the sign fix that makes det = +1.
    Draws the same normals in the same order, so it is bit-equal to scipy ≤ 1.15 for a seed."""
    H = np.eye(dim)
    D = np.empty(dim)
    for n in range(dim - 1):
        x = random_state.normal(size=(dim - n,))
        norm2 = float(np.dot(x, x))
        x0 = float(x[0])
        D[n] = np.sign(x0) if x0 != 0 else 1.0
        x[0] += D[n] * np.sqrt(norm2)
        x /= np.sqrt((norm2 - x0**2 + x[0] ** 2) / 2.0)
        H[:, n:] -= np.outer(H[:, n:] @ x, x)
    D[-1] = (-1) ** (dim - 1) * D[:-1].prod()
    return D[:, None] * H


def q3_problem(b: float, zeta: int, n: int = 100, seed: int = 1234, rotation: str = "legacy") -> Quadratic:
    """f_{b,ζ}: eigenvalues 1e-3·bⁱ (i = 0..n−1), diagonal reordered as [ζ/2 smallest, ζ/2
    largest, rest], leading ζ×ζ block rotated by a random rotation (numpy seed reset per call).
    ``rotation="legacy"``: the authors' scipy (< 1.16) ``special_ortho_group``; ``"scipy"``: the
    installed scipy's. θ₀ uses the eigenvectors of H in ascending order, as the authors' ``eigh`` does."""
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation must be one of {ROTATIONS}, got {rotation!r}")
    diag = [1e-3 * (b**i) for i in range(n)]
    half = zeta // 2
    diag = diag[:half] + diag[n - half :] + diag[half : n - half]
    H = np.diag(np.asarray(diag))
    np.random.seed(seed)
    if zeta < 2:
        R = np.eye(zeta)
    elif rotation == "legacy":
        R = special_ortho_group_legacy(zeta, np.random.mtrand._rand)
    else:
        from scipy.stats import special_ortho_group

        R = special_ortho_group.rvs(zeta)
    H[:zeta, :zeta] = R @ np.diag(diag[:zeta]) @ R.T
    H = torch.from_numpy(H)
    H = 0.5 * (H + H.T)
    eig, vecs = torch.linalg.eigh(H)
    return Quadratic(H=H, eigenvalues=eig.flip(0), theta0=start_point(vecs))


def ese(problem: Quadratic, k: int = 10, seed: int = 0) -> ESEResult:
    """The library's Lanczos on the exact Hessian at θ₀ (m = 4k, float64)."""
    res = lanczos(dense_matvec(problem.H), problem.n, k, 0, num_iters=min(4 * k, problem.n), seed=seed)
    return ESEResult(eigenvalues=res.eigenvalues, eigenvectors=res.eigenvectors)


def base_lr(name: str, eigenvalues: Tensor) -> float:
    """The paper's base learning rates: GD 2/(λ₁+λ_n), HB 2/(√λ₁+√λ_n)², Adam 0.05."""
    lmax, lmin = float(eigenvalues.max()), float(eigenvalues.min())
    if name in ("gd", "fosi_gd"):
        return 2.0 / (lmax + lmin)
    if name in ("hb", "fosi_hb"):
        return 2.0 / (math.sqrt(lmax) + math.sqrt(lmin)) ** 2
    return ADAM_LR


def run_batch(
    H: Tensor,
    theta0: Tensor,
    rules: str | Sequence[str],
    iters: int,
    lr: Tensor | float,
    beta: Tensor | float = 0.9,
    beta2: float = 0.999,
    eigenvalues: Tensor | None = None,
    eigenvectors: Tensor | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """f(θ_t), t = 0..iters, for B functions × R runs in lockstep: shape (B, R, iters + 1).

    ``H`` is (n, n) (B = 1) or (B, n, n); ``theta0`` (n,) or (B, n), shared by the R runs of a
    function, or (B, R, n): one start point per run (the start-point panel). ``rules`` names the update
    rule of each of the R runs (a single name: all R runs use it). ``lr`` and ``beta`` are scalars,
    (R,) or (B, R); β is the HB momentum / Adam β₁ and, for FOSI, the Newton EMA factor, as in the
    authors' code. ``eigenvalues`` (r,) / (B, r) and ``eigenvectors`` (r, n) / (B, r, n) are the
    ESE pairs of each function (FOSI rules only). All R runs of a function share one product
    with H per iteration (a matrix-matrix product), which is what makes the sweeps cheap.
    Diverging runs give inf/nan, which the figures treat as +∞.
    """
    lr_t = torch.as_tensor(lr, dtype=F64)
    beta_t = torch.as_tensor(beta, dtype=F64)
    if isinstance(rules, str):
        R = max(lr_t.shape[-1] if lr_t.dim() else 1, beta_t.shape[-1] if beta_t.dim() else 1)
        rules = [rules] * R
    rules = list(rules)
    R = len(rules)
    for name in set(rules):
        if name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
    n = H.shape[-1]
    B = H.shape[0] if H.dim() == 3 else (theta0.shape[0] if theta0.dim() >= 2 else 1)
    H = H.to(F64)
    if theta0.dim() == 3:
        if theta0.shape[1] != R:
            raise ValueError(f"theta0 of shape (B, R, n) needs R = {R} start points, got {theta0.shape[1]}")
        theta0 = theta0.to(F64).expand(B, R, n)
    else:
        theta0 = theta0.to(F64).reshape(-1, 1, n).expand(B, R, n)
    lr_t = lr_t.reshape(-1, R if lr_t.numel() > 1 else 1).expand(B, R)
    beta_t = beta_t.reshape(-1, R if beta_t.numel() > 1 else 1).expand(B, R)

    def hess(x: Tensor) -> Tensor:  # (B, R, n) -> (B, R, n); H is symmetric, so xH = (Hx)ᵀ
        return torch.bmm(x, H) if H.dim() == 3 else x @ H

    V = u = None
    if any(name.startswith("fosi") for name in rules):
        if eigenvalues is None or eigenvectors is None:
            raise ValueError("FOSI needs the ESE eigenpairs")
        V = eigenvectors.to(F64)
        V = V.expand(B, *V.shape) if V.dim() == 2 else V  # (B, r, n)
        u = (1.0 / eigenvalues.to(F64)).reshape(-1, 1, V.shape[1]).expand(B, 1, V.shape[1])

    # one state per rule, runs of the rule stacked along dim 1
    groups = []
    for name in dict.fromkeys(rules):
        idx = torch.tensor([i for i, r in enumerate(rules) if r == name])
        st = {
            "name": name,
            "idx": idx,
            "lr": lr_t[:, idx].unsqueeze(-1),
            "beta": beta_t[:, idx].unsqueeze(-1),
            "theta": theta0[:, idx].clone(),
        }
        st["m"] = torch.zeros_like(st["theta"])
        st["v"] = torch.zeros_like(st["theta"])
        st["mn"] = torch.zeros_like(st["theta"])
        groups.append(st)
    order = torch.cat([st["idx"] for st in groups]).argsort()
    sizes = [len(st["idx"]) for st in groups]

    out = torch.empty(B, R, iters + 1, dtype=F64)
    with np.errstate(all="ignore"):
        for t in range(iters + 1):
            theta_all = torch.cat([st["theta"] for st in groups], dim=1)
            g_all = hess(theta_all)
            out[:, :, t] = (0.5 * (theta_all * g_all).sum(-1))[:, order]
            if t == iters:
                break
            for st, g in zip(groups, torch.split(g_all, sizes, dim=1)):
                _update(st, g, t, V, u, beta2, eps)
    return out


def _update(
    st: dict, g: Tensor, t: int, V: Tensor | None, u: Tensor | None, beta2: float, eps: float
) -> None:
    """One step of the authors' quadratic update rule ``st['name']`` on a group of runs."""
    name, lr, beta = st["name"], st["lr"], st["beta"]
    theta, m, v, mn = st["theta"], st["m"], st["v"], st["mn"]
    if name.startswith("fosi"):
        c = torch.bmm(g, V.transpose(1, 2))  # (B, R_g, r) = V̂ g
        g_res = g - torch.bmm(c, V)
        nd = torch.bmm(c * u, V)  # V̂ᵀ(V̂g / λ̂): the Newton direction (α = 1)
    if name == "gd":
        theta = theta - lr * g
    elif name == "fosi_gd":
        theta = theta - lr * g_res - nd
    elif name == "hb":
        m = beta * m + g
        theta = theta - lr * m
    elif name == "fosi_hb":
        mn = beta * mn + (1.0 - beta) * nd
        m = beta * m + g_res
        theta = theta - lr * m - mn
    else:
        grad = g_res if name == "fosi_adam" else g
        m = beta * m + (1.0 - beta) * grad
        v = beta2 * v + (1.0 - beta2) * grad * grad
        mhat = m / (1.0 - beta ** (t + 1))
        vhat = v / (1.0 - beta2 ** (t + 1))
        direction = mhat / (vhat.sqrt() + eps)
        if name == "fosi_adam":
            mn = beta * mn + (1.0 - beta) * nd
            direction = direction - torch.bmm(torch.bmm(direction, V.transpose(1, 2)), V)
            theta = theta - lr * direction - mn
        else:
            theta = theta - lr * direction
    st.update(theta=theta, m=m, v=v, mn=mn)
