"""Lanczos (curvopt.curvature.lanczos) and the flat Hessian-vector products (curvature.hvp)
against dense float64 references: torch.linalg.eigh and torch.func.hessian."""

from __future__ import annotations

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


@pytest.mark.parametrize("reorth", ["twice", "dgks"])
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
    """The authors' sanity check (spec §3): Lanczos eigenvalues vs the dense Hessian, atol 1e-4."""
    model, x, y = _tiny_mlp()
    H, params = _dense_hessian(model, _ce, x, y)
    n = H.shape[0]
    ev = torch.linalg.eigvalsh(H)
    res = lanczos(make_flat_hvp(model, _ce, params, (x, y)), n, 5, 2, num_iters=100)
    torch.testing.assert_close(res.eigenvalues, torch.cat([ev[:2], ev[-5:]]), atol=1e-4, rtol=0)


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
