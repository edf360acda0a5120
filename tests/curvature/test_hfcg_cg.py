"""Generic PCG and Martens' CG variant against dense float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from curvopt.curvature.cg import (
    cg,
    martens_cg,
    martens_progress_stop,
    martens_store_indices,
)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny problems: intra-op threads only add contention on the shared 2-core box (10-100x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _spd(n: int, cond: float = 100.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    eig = torch.logspace(0, math.log10(cond), n, dtype=torch.float64)
    return (q * eig) @ q.T


@pytest.mark.parametrize("use_precond", [False, True])
@pytest.mark.parametrize("use_x0", [False, True])
def test_cg_matches_direct_solve(use_precond, use_x0):
    n = 40
    a = _spd(n, cond=1e3)
    # badly scaled rows/columns so a diagonal preconditioner matters
    s = torch.logspace(-1, 1, n, dtype=torch.float64)
    a = s[:, None] * a * s[None, :]
    b = torch.randn(n, dtype=torch.float64)
    x_star = torch.linalg.solve(a, b)
    x0 = torch.randn(n, dtype=torch.float64) if use_x0 else None
    precond = torch.diagonal(a).clone() if use_precond else None
    res = cg(lambda v: a @ v, b, x0=x0, precond=precond, tol=1e-12, maxiter=10 * n)
    assert res.stop_reason == "converged"
    torch.testing.assert_close(res.x, x_star, rtol=1e-8, atol=1e-8)
    true_res = torch.linalg.norm(b - a @ res.x).item()
    assert true_res <= 1e-9 * torch.linalg.norm(b).item()
    assert len(res.residual_norms) == res.iterations + 1
    assert res.rel_residual <= 1e-12


def test_diagonal_and_callable_preconditioner_agree_and_help():
    n = 60
    a = _spd(n, cond=10.0, seed=1)
    s = torch.logspace(-2, 2, n, dtype=torch.float64)
    a = s[:, None] * a * s[None, :]
    b = torch.randn(n, dtype=torch.float64)
    d = torch.diagonal(a).clone()
    r1 = cg(lambda v: a @ v, b, precond=d, tol=1e-10, maxiter=500)
    r2 = cg(lambda v: a @ v, b, precond=lambda r: r / d, tol=1e-10, maxiter=500)
    r0 = cg(lambda v: a @ v, b, tol=1e-10, maxiter=500)
    assert r1.iterations == r2.iterations
    torch.testing.assert_close(r1.x, r2.x)
    assert r1.iterations < r0.iterations  # Jacobi scaling removes the s-scaling exactly


def test_cg_maxiter_miniter_callback_and_zero_rhs():
    a = _spd(20, cond=1e4)
    b = torch.randn(20, dtype=torch.float64)
    seen = []
    res = cg(lambda v: a @ v, b, tol=1e-14, maxiter=3, callback=lambda i, x, r: seen.append(i))
    assert res.stop_reason == "maxiter" and res.iterations == 3 and seen == [0, 1, 2, 3]
    # three CG steps from 0 equal the Krylov-space minimiser of the A-norm error
    k = torch.stack([b, a @ b, a @ a @ b], 1)
    coef = torch.linalg.solve(k.T @ a @ k, k.T @ b)
    torch.testing.assert_close(res.x, k @ coef, rtol=1e-6, atol=1e-8)
    res = cg(lambda v: a @ v, b, tol=1e3, miniter=2, maxiter=50)  # loose tol: only miniter holds it
    assert res.iterations == 2 and res.stop_reason == "converged"
    res = cg(lambda v: a @ v, torch.zeros(20, dtype=torch.float64))
    assert res.iterations == 0 and res.stop_reason == "converged" and torch.all(res.x == 0)


def test_cg_negative_curvature_keeps_last_iterate():
    # indefinite: the first direction b = e0 + e1 has bᵀAb = 1 − 2 < 0
    a = torch.diag(torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64))
    b = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    res = cg(lambda v: a @ v, b, tol=1e-12, maxiter=10)
    assert res.stop_reason == "negative_curvature" and res.iterations == 0
    assert torch.all(res.x == 0)
    # after one good step, then negative curvature: x is the first iterate
    a = torch.diag(torch.tensor([4.0, 1.0, -50.0], dtype=torch.float64))
    b = torch.tensor([1.0, 0.0, 0.1], dtype=torch.float64)
    res = cg(lambda v: a @ v, b, tol=1e-12, maxiter=10)
    alpha = (b @ b) / (b @ a @ b)
    assert res.stop_reason == "negative_curvature" and res.iterations == 1
    torch.testing.assert_close(res.x, alpha * b)


def test_cg_breakdown_on_nonfinite_operator():
    b = torch.ones(4, dtype=torch.float64)
    res = cg(lambda v: v * float("nan"), b, maxiter=5)
    assert res.stop_reason == "breakdown" and res.iterations == 0


def test_martens_store_indices_are_ceil_5_times_1p3_power():
    idx = martens_store_indices(250)
    expected = [math.ceil(5 * 1.3**j) for j in range(30) if math.ceil(5 * 1.3**j) <= 250]
    assert idx == expected
    assert idx[:8] == [5, 7, 9, 11, 15, 19, 25, 32]


def test_martens_progress_rule_on_handmade_sequence():
    # φ_i = −(1 − 0.9^i): relative progress over k iterations is 0.9^{i−k}(1−0.9^k)/(1−0.9^i)·...
    phi = [-(1 - 0.9**i) for i in range(200)]

    def fires(i: int) -> bool:
        k = max(10, math.ceil(0.1 * i))
        return i > k and phi[i - k] < 0 and (phi[i] - phi[i - k]) / phi[i] < k * 5e-4

    first = next(i for i in range(200) if fires(i))
    assert not any(martens_progress_stop(phi, i) for i in range(first))
    assert martens_progress_stop(phi, first)
    # by hand: the rule needs i > 10 and the decrease over 10 steps below 0.5 % of φ_i
    k = 10
    ratio = (phi[first] - phi[first - k]) / phi[first]
    assert ratio < k * 5e-4 <= (phi[first - 1] - phi[first - 1 - k]) / phi[first - 1]
    # φ_{i−k} must be negative: a sequence still at 0 never stops
    assert not martens_progress_stop([0.0] * 30 + [-1e-9], 30)
    # i ≤ k never stops, even with zero progress
    assert not martens_progress_stop([-1.0] * 11, 10)
    assert martens_progress_stop([-1.0] * 12, 11)


def test_martens_cg_phi_stopping_and_stored_iterates():
    n = 300
    a = _spd(n, cond=1e6, seed=3)
    b = torch.randn(n, dtype=torch.float64)
    res = martens_cg(lambda v: a @ v, b, maxiter=250)
    # φ is tracked exactly
    for i, x in res.stored:
        phi_direct = (0.5 * x @ a @ x - b @ x).item()
        assert res.phi[i] == pytest.approx(phi_direct, rel=1e-8, abs=1e-10)
    assert len(res.phi) == res.iterations + 1
    # it stopped where the rule first fires (not before), or at maxiter
    fired = [i for i in range(1, res.iterations + 1) if martens_progress_stop(res.phi, i)]
    if res.stop_reason == "converged":
        assert fired == [res.iterations]
    else:
        assert res.stop_reason == "maxiter" and res.iterations == 250 and not fired
    grid = [i for i in martens_store_indices(250) if i <= res.iterations]
    assert res.stored_indices[: len(grid)] == grid
    assert res.stored_indices[-1] == res.iterations
    torch.testing.assert_close(res.stored[-1][1], res.x)
    # φ decreases monotonically along CG
    assert all(p2 <= p1 + 1e-12 for p1, p2 in zip(res.phi, res.phi[1:]))


def test_martens_cg_solves_small_system_and_matches_generic_cg():
    n = 12
    a = _spd(n, cond=50.0, seed=4)
    b = torch.randn(n, dtype=torch.float64)
    d = torch.diagonal(a) ** 0.75
    res = martens_cg(lambda v: a @ v, b, precond=d, maxiter=n)
    ref = cg(lambda v: a @ v, b, precond=d, tol=0.0, maxiter=n)
    torch.testing.assert_close(res.x, ref.x)
    torch.testing.assert_close(res.x, torch.linalg.solve(a, b), rtol=1e-6, atol=1e-8)


def test_martens_cg_negative_curvature_stores_last_good_iterate():
    a = torch.diag(torch.tensor([4.0, 1.0, -50.0], dtype=torch.float64))
    b = torch.tensor([1.0, 0.0, 0.1], dtype=torch.float64)
    res = martens_cg(lambda v: a @ v, b, maxiter=10)
    assert res.stop_reason == "negative_curvature" and res.iterations == 1
    assert res.stored_indices == [1]
