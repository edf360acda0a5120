"""LSMR (curvopt.curvature.lsmr) against scipy.sparse.linalg.lsmr, and the merit-stopping rules."""

from __future__ import annotations

import functools
import math
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import pytest
import scipy.sparse.linalg as spla
import torch

from curvopt.curvature.lsmr import STOP_REASONS, LSMRResult, lsmr


def _problem(m: int, n: int, seed: int, spread: float = 4.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A well-conditioned dense problem (singular values in [1, spread]), so LSMR converges well
    before the Krylov space is exhausted and round-off cannot amplify into visible differences."""
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((m, min(m, n))))
    v, _ = np.linalg.qr(rng.standard_normal((n, min(m, n))))
    a = u @ np.diag(np.linspace(1.0, spread, min(m, n))) @ v.T
    return a, rng.standard_normal(m), rng.standard_normal(n)


@pytest.mark.parametrize("damp", [0.0, 0.7])
@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("shape", [(80, 40), (40, 60)])
def test_iterates_and_outputs_match_scipy(damp, warm, shape):
    a, b, x0 = _problem(*shape, seed=1)
    x0 = x0 if warm else None
    kw = dict(damp=damp, atol=1e-10, btol=1e-10)
    iterates: list[torch.Tensor] = []
    ours = lsmr(
        torch.tensor(a),
        torch.tensor(b),
        x0=None if x0 is None else torch.tensor(x0),
        callback=lambda k, x: iterates.append(x.clone()),
        **kw,
    )
    ref = spla.lsmr(a, b, x0=x0, **kw)
    assert ours.istop == ref[1] and ours.itn == ref[2]
    np.testing.assert_allclose(ours.x.numpy(), ref[0], rtol=1e-12, atol=1e-12)
    for got, want in zip(list(ours)[3:], ref[3:]):  # normr, normar, norma, conda, normx
        assert got == pytest.approx(want, rel=1e-9, abs=1e-13)
    # every iterate equals SciPy stopped at that iteration
    for k in (1, 2, 5, 10, ours.itn - 1):
        ref_k = spla.lsmr(a, b, x0=x0, maxiter=k, **kw)
        np.testing.assert_allclose(iterates[k - 1].numpy(), ref_k[0], rtol=1e-12, atol=1e-12)


def test_default_tolerances_and_scipy_inputs():
    a, b, _ = _problem(150, 100, seed=2, spread=8.0)
    ref = spla.lsmr(a, b, damp=0.1)
    for A in (a, spla.aslinearoperator(a)):
        ours = lsmr(A, b, damp=0.1)
        assert isinstance(ours.x, np.ndarray)
        assert (ours.istop, ours.itn) == (ref[1], ref[2])
        np.testing.assert_allclose(ours.x, ref[0], rtol=1e-10, atol=1e-12)
    # matrix-free (matvec, rmatvec, shape) on torch tensors
    at = torch.tensor(a)
    ours = lsmr((lambda v: at @ v, lambda u: at.T @ u, at.shape), torch.tensor(b), damp=0.1)
    np.testing.assert_allclose(ours.x.numpy(), ref[0], rtol=1e-10, atol=1e-12)


def test_result_unpacks_like_scipy():
    a, b, _ = _problem(20, 10, seed=3)
    res = lsmr(torch.tensor(a), torch.tensor(b))
    assert isinstance(res, LSMRResult) and len(res) == 8
    x, istop, itn, normr, normar, norma, conda, normx = res
    assert x is res.x and istop == res.istop and itn == res.itn
    assert res[4] == normar and res.stop_reason == STOP_REASONS[istop]
    assert normx == pytest.approx(float(torch.linalg.vector_norm(x)))


def test_right_preconditioning_equals_scipy_on_scaled_operator():
    a, b, y0 = _problem(150, 100, seed=4)
    c = np.random.default_rng(5).uniform(0.5, 1.5, 100)
    ref = spla.lsmr(a * c[None, :], b, damp=0.5, x0=y0, atol=1e-10, btol=1e-10)
    ours = lsmr(
        torch.tensor(a),
        torch.tensor(b),
        damp=0.5,
        x0=torch.tensor(y0),
        precond=torch.tensor(c),
        atol=1e-10,
        btol=1e-10,
    )
    assert (ours.istop, ours.itn) == (ref[1], ref[2])
    np.testing.assert_allclose(
        ours.x.numpy(), ref[0], rtol=1e-8, atol=1e-9
    )  # different rounding order: A(c∘v) vs (A·diag c)v
    np.testing.assert_allclose(
        ours.solution.numpy(), c * ref[0], rtol=1e-8, atol=1e-9
    )  # different rounding order: A(c∘v) vs (A·diag c)v


def test_damped_warm_start_solves_the_shifted_problem():
    """With x0 the damping pulls toward x0: (AᵀA + λ²I) x = Aᵀb + λ² x0 (paper Eq. 19)."""
    a, b, x0 = _problem(40, 25, seed=6)
    lam = 0.8
    res = lsmr(torch.tensor(a), torch.tensor(b), damp=lam, x0=torch.tensor(x0), atol=1e-14, btol=1e-14)
    exact = np.linalg.solve(a.T @ a + lam**2 * np.eye(25), a.T @ b + lam**2 * x0)
    np.testing.assert_allclose(res.x.numpy(), exact, rtol=1e-9, atol=1e-10)


@functools.lru_cache(maxsize=1)
def _noisy_problem(seed: int = 7):
    """Ill-conditioned enough that LSMR runs hundreds of iterations without atol firing."""
    rng = np.random.default_rng(seed)
    m, n = 400, 300
    u, _ = np.linalg.qr(rng.standard_normal((m, n)))
    v, _ = np.linalg.qr(rng.standard_normal((n, n)))
    a = u @ np.diag(np.logspace(0, -6, n)) @ v.T
    return torch.tensor(a), torch.tensor(rng.standard_normal(m))


def test_merit_schedule_and_miniter():
    a, b = _noisy_problem()
    calls: list[int] = []
    count = [0]

    def merit(x):
        calls.append(count[0])
        return 1.0 + 1.0 / (1 + len(calls))  # strictly decreasing, never stagnating enough

    res = lsmr(
        a, b, atol=0.0, maxiter=200, merit=merit, ftol=0.0, callback=lambda k, x: count.__setitem__(0, k)
    )
    its = [k for k, _ in res.merit_history]
    assert its == [0, 5, 7, 9, 12, 15, 19, 24, 30, 38, 48, 60, 75, 94, 118, 148, 185, 200]
    assert res.stop_reason == "maxiter" and res.itn == 200
    assert calls == its  # merit evaluated exactly at those iterations (0 = x0)


def test_merit_ftol_stop_first_possible_at_60():
    a, b = _noisy_problem()
    res = lsmr(a, b, atol=0.0, maxiter=500, merit=lambda x: 1.0, ftol=1e-5)  # flat merit: no progress
    # f_k == f_min only while the merit keeps equalling the minimum; flat φ stagnates at once
    assert res.stop_reason == "merit_ftol" and res.istop == 8 and res.itn == 60


def test_merit_ftol_uses_relative_progress_per_iteration():
    a, b = _noisy_problem()
    vals = {}

    def merit_factory(rate):
        def merit(x):
            k = len(vals.setdefault(rate, []))
            vals[rate].append(k)
            return 1.0 * (1 - rate) ** k  # relative decrease per check ≈ rate

        return merit

    # between checks 48 and 60: (k - k_prev)·ftol = 12e-3; a 2% decrease per check continues, 0.5% stops
    fast = lsmr(a, b, atol=0.0, maxiter=100, merit=merit_factory(0.02), ftol=1e-3)
    slow = lsmr(a, b, atol=0.0, maxiter=100, merit=merit_factory(0.005), ftol=1e-3)
    assert slow.stop_reason == "merit_ftol" and slow.itn == 60
    assert fast.stop_reason != "merit_ftol" or fast.itn > 60


def test_merit_recover_rule_and_return_best():
    a, b = _noisy_problem()
    seen: dict[int, torch.Tensor] = {}

    def merit(x):
        k = len(seen)
        seen[k] = x.clone()
        return 1.0 if k != 3 else 0.5  # minimum at the 3rd check (k = 9), then never recovered

    last = lsmr(a, b, atol=0.0, maxiter=1000, merit=merit)
    # recover = 100: first check with k > 9 + 100 and k > 50 is 118
    assert last.stop_reason == "merit_recover" and last.itn == 118 and last.best_itn == 9
    assert not last.returned_best
    seen.clear()
    best = lsmr(a, b, atol=0.0, maxiter=1000, merit=merit, return_best=True)
    assert best.returned_best and best.itn == 118
    torch.testing.assert_close(best.x, seen[3], rtol=0, atol=0)
    assert not torch.equal(best.x, last.x)


def test_merit_mode_keeps_only_atol_test():
    a, b, _ = _problem(60, 30, seed=8)
    at, bt = torch.tensor(a), torch.tensor(b)
    # btol huge would stop SciPy-mode at once; merit mode ignores btol and conlim
    plain = lsmr(at, bt, btol=0.5, atol=1e-12, conlim=1.0)
    merit = lsmr(at, bt, btol=0.5, atol=1e-12, conlim=1.0, merit=lambda x: 1.0, miniter=10**6)
    assert plain.itn < merit.itn and merit.stop_reason == "atol"
    assert merit.normar <= 1e-12 * merit.norma * merit.normr


def test_breakdown_ends_cleanly():
    """A = I: β₂ = 0 after one step; the single iterate is the exact (damped) solution."""
    n = 6
    b = torch.arange(1.0, n + 1, dtype=torch.float64)
    for merit in (None, lambda x: 1.0):
        res = lsmr(torch.eye(n, dtype=torch.float64), b, damp=0.5, merit=merit, maxiter=50)
        assert res.itn == 1
        torch.testing.assert_close(res.x, b / 1.25)
        assert all(math.isfinite(v) for v in list(res)[3:])
    zero = lsmr(torch.eye(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
    assert zero.istop == 0 and zero.itn == 0 and torch.count_nonzero(zero.x) == 0


def test_float32_vectors_float64_scalars():
    a, b, _ = _problem(60, 30, seed=9)
    r32 = lsmr(
        torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32), atol=1e-5, btol=1e-5
    )
    ref = spla.lsmr(a, b, atol=1e-5, btol=1e-5)
    assert r32.x.dtype == torch.float32 and isinstance(r32.normr, float)
    np.testing.assert_allclose(r32.x.numpy(), ref[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_precond", [False, True])
def test_damp_center_zero_solves_the_unshifted_problem(with_precond):
    """damp_center="zero": x0 is only a starting point; the solution is that of
    (CAᵀAC + λ²I) x = CAᵀb (Algorithm 1's normal equations), not the x0-shifted one."""
    a, b, x0 = _problem(40, 25, seed=7)
    lam = 0.8
    c = np.linspace(0.5, 1.0, 25) if with_precond else np.ones(25)
    res = lsmr(
        torch.tensor(a),
        torch.tensor(b),
        damp=lam,
        x0=torch.tensor(x0),
        precond=torch.tensor(c) if with_precond else None,
        atol=1e-14,
        btol=1e-14,
        damp_center="zero",
    )
    ac = a * c[None, :]
    exact = np.linalg.solve(ac.T @ ac + lam**2 * np.eye(25), ac.T @ b)
    np.testing.assert_allclose(res.x.numpy(), exact, rtol=1e-9, atol=1e-11)
    shifted = np.linalg.solve(ac.T @ ac + lam**2 * np.eye(25), ac.T @ b + lam**2 * x0)
    assert np.abs(shifted - exact).max() > 1e-2  # the two readings differ on this problem
    # without x0 both readings solve the same problem
    r0 = lsmr(torch.tensor(a), torch.tensor(b), damp=lam, atol=1e-14, btol=1e-14, damp_center="zero")
    r1 = lsmr(torch.tensor(a), torch.tensor(b), damp=lam, atol=1e-14, btol=1e-14)
    np.testing.assert_allclose(r0.x.numpy(), r1.x.numpy(), rtol=0, atol=0)


def test_damp_center_rejects_unknown_value():
    with pytest.raises(ValueError, match="damp_center"):
        lsmr(torch.eye(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), damp_center="y0")
