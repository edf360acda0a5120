"""Lanczos (curvopt.curvature.lanczos) and the flat Hessian-vector products (curvature.hvp)
against dense float64 references: torch.linalg.eigh and torch.func.hessian."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian

from curvopt.curvature.hvp import flat_hvp, hvp_module, make_flat_hvp
from curvopt.curvature.lanczos import (
    LanczosError,
    NonSymmetricOperatorError,
    default_num_iters,
    dense_matvec,
    lanczos,
)
from curvopt.objective import flatten, mean_loss, unflatten

F64 = torch.float64


def _spd_with_outliers(n: int, k: int, l: int, seed: int) -> torch.Tensor:  # noqa: E741
    """Random SPD matrix whose k largest and ℓ smallest eigenvalues are separated from a bulk in
    [1, 2] (as Hessians' outliers are), so m = 4(k+ℓ) Lanczos iterations resolve them."""
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64))
    bulk = 1.0 + torch.rand(n - k - l, generator=gen, dtype=F64)
    top = 10.0 * 1.5 ** torch.arange(k, dtype=F64)
    bottom = 1e-3 * (1.0 + torch.arange(l, dtype=F64))
    lam = torch.cat([bottom, bulk, top])
    return (Q * lam) @ Q.T


@pytest.mark.parametrize("reorth", ["twice", "dgks", "partial"])
@pytest.mark.parametrize("n,k,l,seed", [(80, 5, 0, 0), (120, 10, 2, 1), (60, 3, 3, 2)])
def test_lanczos_matches_eigh_on_spd(reorth, n, k, l, seed):  # noqa: E741
    A = _spd_with_outliers(n, k, l, seed)
    ev, U = torch.linalg.eigh(A)
    res = lanczos(dense_matvec(A), n, k, l, reorth=reorth)
    assert res.iterations == default_num_iters(n, k, l)
    expected = torch.cat([ev[:l], ev[n - k :]])
    torch.testing.assert_close(res.eigenvalues, expected, atol=1e-4, rtol=0)
    V = res.eigenvectors
    torch.testing.assert_close(V @ V.T, torch.eye(k + l, dtype=F64), atol=1e-10, rtol=0)
    # each Ritz vector is (up to sign) the eigenvector: |cos| ≈ 1, residual small
    ref = torch.cat([U[:, :l], U[:, n - k :]], dim=1).T
    cos = (V * ref).sum(1).abs()
    assert torch.all(cos > 1 - 1e-6), cos
    resid = (V @ A - res.eigenvalues[:, None] * V).norm(dim=1)
    assert resid.max() < 1e-3


def _assert_as_accurate_as(res, ref, A, k, l):  # noqa: E741
    """``res`` is as accurate as ``ref`` against eigh: eigenvalues, the Ritz vectors (|cos| to the
    true eigenvectors, the vector error up to sign, the residual ‖Av − θv‖) and the orthonormality
    ‖VVᵀ − I‖ of the returned vectors (each within 10× of ``ref`` or at rounding level)."""
    n = A.shape[0]
    ev, U = torch.linalg.eigh(A)
    expected = torch.cat([ev[:l], ev[n - k :]])
    true_vecs = torch.cat([U[:, :l], U[:, n - k :]], dim=1).T
    scale = float(ev.abs().max())
    errs = {}
    for name, r in (("res", res), ("ref", ref)):
        V = r.eigenvectors
        cos = (V * true_vecs).sum(1)
        errs[name] = {
            "eigenvalue": float((r.eigenvalues - expected).abs().max()) / scale,
            "1-|cos|": float((1 - cos.abs()).max()),
            "vector": float((V - torch.sign(cos)[:, None] * true_vecs).abs().max()),
            "residual": float((V @ A - r.eigenvalues[:, None] * V).norm(dim=1).max()) / scale,
            "orthonormality": float((V @ V.T - torch.eye(k + l, dtype=F64)).abs().max()),
        }
    for key, floor in (
        ("eigenvalue", 1e-13),
        ("1-|cos|", 1e-13),
        ("vector", 1e-12),
        ("residual", 1e-12),  # relative to ‖A‖: semi-orthogonality leaves a larger β_m at m = n
        ("orthonormality", 1e-13),
    ):
        assert errs["res"][key] <= max(10 * errs["ref"][key], floor), (key, errs)
    torch.testing.assert_close(res.eigenvalues, ref.eigenvalues, atol=1e-12 * scale, rtol=0)


def _spd(lam: torch.Tensor, seed: int) -> torch.Tensor:
    Q, _ = torch.linalg.qr(torch.randn(lam.numel(), lam.numel(), generator=_gen(seed), dtype=F64))
    return (Q * lam) @ Q.T


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "spectrum",
    [
        "outliers",  # 10 separated top values over a bulk in [1, 2], two tiny ones
        "clustered",  # a bulk clustered within 1e-3 of 1 and 20 values clustered in [50, 51]
        "spread",  # smoothly spread (λ ∝ t³): m = 40 resolves only the extremes
    ],
)
def test_partial_reorth_as_accurate_as_twice_on_spd(spectrum):
    """(a) Random SPD matrices with clustered and spread spectra: partial vs the authors' twice."""
    n, k, l, g = 160, 5, 2, _gen(11)  # noqa: E741
    if spectrum == "outliers":
        lam = torch.cat(
            [
                1e-3 * torch.tensor([1.0, 2.0]),
                1 + torch.rand(n - 12, generator=g),
                10 * 1.5 ** torch.arange(10.0),
            ]
        )
    elif spectrum == "clustered":
        lam = torch.cat([1 + 1e-3 * torch.rand(n - 20, generator=g), 50 + torch.rand(20, generator=g)])
    else:
        lam = 100 * torch.linspace(0, 1, n) ** 3
    A = _spd(lam.to(F64), 12)
    part = lanczos(dense_matvec(A), n, k, l, reorth="partial")
    twice = lanczos(dense_matvec(A), n, k, l, reorth="twice")
    _assert_as_accurate_as(part, twice, A, k, l)
    assert part.reorth_passes < twice.reorth_passes / 2


def _plain_lanczos_basis(A: torch.Tensor, m: int, seed: int = 0) -> torch.Tensor:
    """Lanczos with the three-term recurrence only (no re-orthogonalisation), same start vector."""
    n = A.shape[0]
    Q = torch.zeros(m, n, dtype=F64)
    q = torch.randn(n, dtype=F64, generator=_gen(seed))
    Q[0] = q / q.norm()
    beta = 0.0
    for i in range(m - 1):
        w = A @ Q[i] - (Q[i] @ A @ Q[i]) * Q[i] - (beta * Q[i - 1] if i > 0 else 0.0)
        beta = float(w.norm())
        Q[i + 1] = w / beta
    return Q


def test_partial_reorth_with_many_converging_eigenvalues():
    """(b) 30 geometrically spaced top eigenvalues: at m = 40 many Ritz values converge, and plain
    Lanczos (no re-orthogonalisation) loses orthogonality completely. Partial must notice (ω above
    √ε), make passes, and stay as accurate as twice."""
    n, k, l, m = 200, 10, 2, 40  # noqa: E741
    lam = torch.cat([torch.rand(n - 30, generator=_gen(21), dtype=F64), 2.0 ** torch.arange(30, dtype=F64)])
    A = _spd(lam, 22)
    Q = _plain_lanczos_basis(A, m)
    assert float((Q @ Q.T - torch.eye(m, dtype=F64)).abs().max()) > 0.1  # "none" fails here
    part = lanczos(dense_matvec(A), n, k, l, num_iters=m, reorth="partial")
    twice = lanczos(dense_matvec(A), n, k, l, num_iters=m, reorth="twice")
    assert part.omega_max > math.sqrt(torch.finfo(F64).eps)
    assert 0 < part.reorth_passes < twice.reorth_passes
    _assert_as_accurate_as(part, twice, A, k, l)


@pytest.mark.parametrize("seed", range(4))
def test_partial_reorth_full_krylov_space_vectors_to_working_precision(seed):
    """m = n on a 12 × 12 log-spaced spectrum: every Ritz pair converges to working precision. The
    passes made when ω reaches √ε remove O(√ε) components that T does not record; without folding
    those Gram-Schmidt coefficients into the Ritz step the vectors are only ~1e-9 accurate."""
    n = 12
    A = _spd(torch.logspace(1, -2, n, dtype=F64), 30)
    part = lanczos(dense_matvec(A), n, 3, 1, reorth="partial", seed=seed)
    twice = lanczos(dense_matvec(A), n, 3, 1, reorth="twice", seed=seed)
    assert part.reorth_passes > 0 and part.omega_max > math.sqrt(torch.finfo(F64).eps)
    _assert_as_accurate_as(part, twice, A, 3, 1)


def test_lanczos_full_krylov_space_is_exact_on_a_generic_matrix():
    gen = torch.Generator().manual_seed(5)
    n = 40
    B = torch.randn(n, n, generator=gen, dtype=F64)
    A = B @ B.T / n
    ev = torch.linalg.eigvalsh(A)
    res = lanczos(dense_matvec(A), n, 6, 4, num_iters=n)
    torch.testing.assert_close(res.eigenvalues, torch.cat([ev[:4], ev[-6:]]), atol=1e-10, rtol=0)
    assert res.ritz_values[0] == pytest.approx(float(ev[0]), abs=1e-10)
    assert res.lambda_max == pytest.approx(float(ev[-1]), abs=1e-10)
    assert res.lambda_k == pytest.approx(float(ev[-6]), abs=1e-10)


def test_breakdown_restarts_and_still_returns_k_pairs():
    # 3 distinct eigenvalues: the Krylov space of any start vector has dimension 3
    lam = torch.tensor([1.0] * 30 + [2.0] * 30 + [5.0] * 40, dtype=F64)
    Q, _ = torch.linalg.qr(torch.randn(100, 100, generator=torch.Generator().manual_seed(0), dtype=F64))
    A = (Q * lam) @ Q.T
    res = lanczos(dense_matvec(A), 100, 4, 2)
    assert res.restarts > 0
    torch.testing.assert_close(res.eigenvalues, torch.tensor([1.0, 1.0, 5.0, 5.0, 5.0, 5.0], dtype=F64))
    V = res.eigenvectors
    torch.testing.assert_close(V @ V.T, torch.eye(6, dtype=F64), atol=1e-10, rtol=0)
    torch.testing.assert_close(V @ A, res.eigenvalues[:, None] * V, atol=1e-8, rtol=0)


def test_same_seed_same_result_fresh_generator_differs():
    A = _spd_with_outliers(50, 3, 0, 3)
    a = lanczos(dense_matvec(A), 50, 3, num_iters=6, seed=7)
    b = lanczos(dense_matvec(A), 50, 3, num_iters=6, seed=7)
    assert torch.equal(a.eigenvalues, b.eigenvalues) and torch.equal(a.eigenvectors, b.eigenvectors)
    gen = torch.Generator().manual_seed(7)
    c = lanczos(dense_matvec(A), 50, 3, num_iters=6, generator=gen)
    d = lanczos(dense_matvec(A), 50, 3, num_iters=6, generator=gen)
    assert torch.equal(c.eigenvalues, a.eigenvalues)  # first draw of the same seed
    assert not torch.equal(c.eigenvalues, d.eigenvalues)  # the generator advanced


def test_default_iterations():
    assert default_num_iters(10**6, 10, 0) == 40
    assert default_num_iters(10**6, 1, 0) == math.ceil(2 * math.log(10**6))  # 28 > 4
    assert default_num_iters(30, 10, 0) == 30  # capped at n


def test_bad_inputs_give_clear_errors():
    A = torch.eye(10, dtype=F64)
    with pytest.raises(ValueError, match="smaller than the dimension"):
        lanczos(dense_matvec(A), 10, 8, 2)
    with pytest.raises(ValueError, match="k ≥ 0"):
        lanczos(dense_matvec(A), 10, 0, 0)
    with pytest.raises(ValueError, match="reorth"):
        lanczos(dense_matvec(A), 10, 2, reorth="never")
    nonsym = torch.triu(torch.ones(10, 10, dtype=F64))
    with pytest.raises(NonSymmetricOperatorError, match="not symmetric"):
        lanczos(dense_matvec(nonsym), 10, 2, symmetry_check=True)
    lanczos(dense_matvec(A + A.T), 10, 2, symmetry_check=True)  # symmetric passes

    def nan_op(v):
        return v * float("nan")

    with pytest.raises(LanczosError, match="non-finite"):
        lanczos(nan_op, 10, 2)


# -- Hessian-vector products and Lanczos on a network's Hessian ---------------------------------------
def _tiny_mlp(dtype=F64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4)).to(dtype)
    x = torch.randn(16, 6, dtype=dtype)
    y = torch.randint(0, 4, (16,))
    return model, x, y


def _dense_hessian(model, loss_fn, x, y):
    params = {k: p.detach() for k, p in model.named_parameters()}
    flat = flatten(params)

    def f(theta):
        return loss_fn(functional_call(model, unflatten(theta, params), (x,)), y)

    return hessian(f)(flat), params


def _ce(out, y):
    return mean_loss(out, y, "cross_entropy")


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("mode", ["forward_over_reverse", "reverse_over_reverse"])
def test_flat_hvp_matches_dense_hessian(mode, reuse):
    model, x, y = _tiny_mlp()
    H, params = _dense_hessian(model, _ce, x, y)
    hvp = make_flat_hvp(model, _ce, params, (x, y), mode, reuse)
    V = torch.randn(H.shape[0], 3, dtype=F64)
    for j in range(3):
        torch.testing.assert_close(hvp(V[:, j]), H @ V[:, j], atol=1e-12, rtol=1e-10)


def test_lanczos_on_mlp_hessian_matches_eigh():
    """The authors' sanity check (their Lanczos test): Lanczos eigenvalues vs the dense Hessian, atol 1e-4."""
    model, x, y = _tiny_mlp()
    H, params = _dense_hessian(model, _ce, x, y)
    n = H.shape[0]
    ev = torch.linalg.eigvalsh(H)
    res = lanczos(make_flat_hvp(model, _ce, params, (x, y)), n, 5, 2, num_iters=100)
    torch.testing.assert_close(res.eigenvalues, torch.cat([ev[:2], ev[-5:]]), atol=1e-4, rtol=0)


@functools.cache
def _tiny_mlp_hessian_and_hvp():
    model, x, y = _tiny_mlp()
    H, params = _dense_hessian(model, _ce, x, y)
    return H, make_flat_hvp(model, _ce, params, (x, y))


@pytest.mark.parametrize("m", [40, 100])
def test_partial_reorth_on_mlp_hessian_as_accurate_as_twice(m):
    """(c) Partial re-orthogonalisation on the tiny MLP's Hessian (float64 operator): eigenvalues,
    Ritz vectors and their orthonormality as good as the authors' two full passes, for fewer passes."""
    H, hvp = _tiny_mlp_hessian_and_hvp()
    n = H.shape[0]
    part = lanczos(hvp, n, 5, 2, num_iters=m, reorth="partial")
    twice = lanczos(hvp, n, 5, 2, num_iters=m, reorth="twice")
    _assert_as_accurate_as(part, twice, H, 5, 2)
    assert part.reorth_passes < twice.reorth_passes


def test_partial_reorth_float32_operator_projects_every_vector():
    """With a float32 operator the product's rounding (ε₃₂‖A‖) enters the ω model, so partial keeps
    full orthogonality (a model with float64 noise only loses it completely: ghost eigenvalues)."""
    model32, x32, y = _tiny_mlp(torch.float32)
    params32 = {k: p.detach() for k, p in model32.named_parameters()}
    hvp32 = make_flat_hvp(model32, _ce, params32, (x32, y))
    n = sum(p.numel() for p in params32.values())
    part = lanczos(hvp32, n, 3, 1, num_iters=60, operator_dtype=torch.float32, reorth="partial")
    twice = lanczos(hvp32, n, 3, 1, num_iters=60, operator_dtype=torch.float32, reorth="twice")
    assert part.reorth_passes >= 59  # at least one pass per new vector
    dgks = lanczos(hvp32, n, 3, 1, num_iters=60, operator_dtype=torch.float32, reorth="dgks")
    assert torch.equal(part.eigenvalues, dgks.eigenvalues)  # then it is dgks's arithmetic exactly
    assert torch.equal(part.eigenvectors, dgks.eigenvectors)
    torch.testing.assert_close(part.eigenvalues, twice.eigenvalues, atol=1e-6, rtol=1e-6)
    V = part.eigenvectors
    torch.testing.assert_close(V @ V.T, torch.eye(4, dtype=F64), atol=1e-12, rtol=0)


def test_lanczos_float32_operator_float64_basis():
    """The operator runs in the model dtype (float32); the basis stays orthonormal in float64."""
    model32, x32, y = _tiny_mlp(torch.float32)
    model64 = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4)).double()
    model64.load_state_dict({k: v.double() for k, v in model32.state_dict().items()})
    H, _ = _dense_hessian(model64, _ce, x32.double(), y)
    ev = torch.linalg.eigvalsh(H)
    params32 = {k: p.detach() for k, p in model32.named_parameters()}
    hvp32 = make_flat_hvp(model32, _ce, params32, (x32, y))
    res = lanczos(hvp32, H.shape[0], 3, num_iters=80, operator_dtype=torch.float32)
    torch.testing.assert_close(res.eigenvalues, ev[-3:], atol=1e-4, rtol=0)
    V = res.eigenvectors
    assert V.dtype == F64
    torch.testing.assert_close(V @ V.T, torch.eye(3, dtype=F64), atol=1e-12, rtol=0)


def test_hvp_with_batchnorm_uses_batch_stats_and_leaves_running_stats():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()
    model.eval()  # even in eval mode, the ESE loss uses batch statistics (the JAX code's training mode)
    x, y = torch.randn(10, 5, dtype=F64), torch.randint(0, 3, (10,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hmodel = hvp_module(model)
    assert hmodel is not model
    params = {k: p.detach() for k, p in model.named_parameters()}
    hvp = make_flat_hvp(hmodel, _ce, params, (x, y))
    # reference: the same network written with explicit batch normalisation
    flat = flatten(params)

    def f(theta):
        p = unflatten(theta, params)
        h = x @ p["0.weight"].T + p["0.bias"]
        h = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + 1e-5) * p["1.weight"] + p["1.bias"]
        return _ce(torch.tanh(h) @ p["3.weight"].T + p["3.bias"], y)

    H = hessian(f)(flat)
    v = torch.randn(flat.numel(), dtype=F64)
    torch.testing.assert_close(hvp(v), H @ v, atol=1e-10, rtol=1e-8)
    for k, val in model.state_dict().items():
        assert torch.equal(val, before[k]), k


def test_hvp_with_dropout_is_a_fixed_symmetric_operator():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 3)).double().train()
    x, y = torch.randn(12, 5, dtype=F64), torch.randint(0, 3, (12,))
    params = {k: p.detach() for k, p in model.named_parameters()}
    hvp = make_flat_hvp(hvp_module(model), _ce, params, (x, y))
    n = sum(p.numel() for p in params.values())
    a, b = torch.randn(n, dtype=F64), torch.randn(n, dtype=F64)
    assert torch.equal(hvp(a), hvp(a))
    assert float(a @ hvp(b)) == pytest.approx(float(b @ hvp(a)), rel=1e-10)


def test_functional_hvp_on_a_quadratic():
    A = _spd_with_outliers(20, 2, 0, 4)
    theta = {"w": torch.randn(20, dtype=F64)}
    hvp = flat_hvp(lambda p: 0.5 * p["w"] @ A @ p["w"], theta)
    v = torch.randn(20, dtype=F64)
    torch.testing.assert_close(hvp(v), A @ v)
