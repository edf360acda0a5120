"""SHF-LSMR (curvopt.optim.shf): batch-size rules by hand, a dense-reference step, resume, flags."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from curvopt.api import DataBundle
from curvopt.objective import Objective, flatten, unflatten
from curvopt.optim.shf import (
    SHF,
    build_shf,
    chapelle_erhan_precond,
    next_batch_size_rule,
    variance_batch_size,
)

D = 12


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(D, 6),
        nn.Sigmoid(),
        nn.Linear(6, 3),
        nn.Sigmoid(),
        nn.Linear(3, 6),
        nn.Sigmoid(),
        nn.Linear(6, D),
        nn.Sigmoid(),
    ).double()


def _data(num_train: int = 200, num_val: int = 60) -> DataBundle:
    g = torch.Generator().manual_seed(0)
    basis = torch.rand(3, D, generator=g, dtype=torch.float64)
    codes = torch.rand(num_train + num_val, 3, generator=g, dtype=torch.float64)
    x = (codes @ basis / 1.5).clamp(0, 1)
    return DataBundle(train=(x[:num_train], x[:num_train]), val=(x[num_train:], x[num_train:]))


def _batches(data: DataBundle, sizes, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x, _ = data.train
    for n in sizes:
        idx = torch.randperm(x.shape[0], generator=g)[:n]
        yield x[idx], x[idx]


# -- Algorithm 2 and the batch-size rule by hand -------------------------------------------------


def test_variance_batch_size_hand_worked():
    grads = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 9.0]], dtype=torch.float64)
    gsum, gsq = grads.sum(0), (grads**2).sum(0)
    # g = (3, 5); sample variances (4, 13) ⇒ V = 17; ‖g‖ = √34
    nhat, v, gnorm = variance_batch_size(gsum, gsq, n=3, num_train=100, theta=0.5, power=1)
    assert v == pytest.approx(float(grads.var(0, unbiased=True).sum())) == pytest.approx(17.0)
    assert gnorm == pytest.approx(math.sqrt(34))
    assert nhat == math.ceil(100 * 17 / (17 + 0.25 * 99 * math.sqrt(34))) == 11
    nhat2, _, _ = variance_batch_size(gsum, gsq, n=3, num_train=100, theta=0.5, power=2)
    assert nhat2 == math.ceil(1700 / (17 + 0.25 * 99 * 34)) == 2


def test_variance_batch_size_per_summand_hand_worked():
    # the same three gradients read as f_S's summands h_i = ∇f_i/3: V_h = 17/9, ‖mean h‖ = √34/3
    grads = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 9.0]], dtype=torch.float64)
    gsum, gsq = grads.sum(0), (grads**2).sum(0)
    nhat, v, gnorm = variance_batch_size(gsum, gsq, 3, 100, 0.5, power=1, gradients="summand")
    h = grads / 3
    v_h, g_h = float(h.var(0, unbiased=True).sum()), float(h.mean(0).norm())
    assert (
        nhat
        == math.ceil(100 * v_h / (v_h + 0.25 * 99 * g_h))
        == math.ceil(1700 / (17 + 0.25 * 99 * 3 * math.sqrt(34)))
    )
    assert nhat == 4  # against 11 for the per-example gradients
    assert (v, gnorm) == (pytest.approx(17.0), pytest.approx(math.sqrt(34)))  # logged in per-example units
    # the squared norm is scale-free: both readings agree
    assert variance_batch_size(gsum, gsq, 3, 100, 0.5, 2, "summand")[0] == 2
    # Var(∇f_S) = V/n next to ‖g‖: equals "summand" for the unsquared norm ...
    assert variance_batch_size(gsum, gsq, 3, 100, 0.5, 1, "batch_mean")[0] == 4
    # ... and for the squared one n̂ = ceil(100·(17/3) / (17/3 + 0.25·99·34)) = 1
    assert (
        variance_batch_size(gsum, gsq, 3, 100, 0.5, 2, "batch_mean")[0]
        == math.ceil(100 * (17 / 3) / (17 / 3 + 0.25 * 99 * 34))
        == 1
    )
    with pytest.raises(ValueError, match="gradients"):
        variance_batch_size(gsum, gsq, 3, 100, 0.5, gradients="batch")


def test_batch_size_rule_cases():
    # n̂ average above n: jump (capped at n_max); maxiter scales by n_next/n (ceil)
    assert next_batch_size_rule(300, 150, [400, 420, 380, 410, 391], 1.0, 0.9, 6000) == (401, 201, "variance")
    assert next_batch_size_rule(300, 150, [9000] * 5, 1.0, 0.9, 6000) == (6000, 3000, "variance")
    # stall: relative validation decrease 0.004 < 0.005 ⇒ ×1.005 (ceil) = 302; maxiter ceil(150·302/300) = 151
    assert next_batch_size_rule(300, 150, [100] * 5, 1.004, 1.0, 6000) == (302, 151, "stall")
    assert next_batch_size_rule(200, 150, [100] * 5, 1.004, 1.0, 6000)[0] == 201  # exact: 1.005·200 = 201
    # progress and small n̂: keep
    assert next_batch_size_rule(300, 150, [100] * 5, 1.1, 1.0, 6000) == (300, 150, "keep")
    # stall at the cap stays at the cap (never above, never below n)
    assert next_batch_size_rule(6000, 3000, [100] * 5, 1.0, 1.0, 6000) == (6000, 3000, "stall")


def test_chapelle_erhan_precond_variants():
    diag = torch.tensor([0.0, 4.0, 9.0], dtype=torch.float64)
    torch.testing.assert_close(
        chapelle_erhan_precond(diag), torch.tensor([1.0, 1 / 3, 1 / 4], dtype=torch.float64)
    )
    torch.testing.assert_close(
        chapelle_erhan_precond(diag, sqrt=False), torch.tensor([1.0, 1 / 5, 1 / 10], dtype=torch.float64)
    )


# -- one step against a dense float64 reference ----------------------------------------------------


def test_first_step_equals_dense_damped_gauss_newton():
    """No preconditioner, no merit, LSMR run to convergence: d = −(JᵀJ + λ²I)⁻¹ JᵀR, and ρ, the
    λ update and the step follow from dense quantities."""
    data = _data()
    model = _model()
    obj = Objective(model, "squared_error")
    lam = 0.3
    alg = SHF(
        obj, data, damping=lam, preconditioner="none", merit=False, maxiter=500, atol=1e-14, batch_size=40
    )
    x, y = next(_batches(data, [40]))
    params = {k: v.clone() for k, v in obj.params().items()}
    w0 = flatten(params)
    n = x.shape[0]

    def residual(w):
        return ((obj.forward(unflatten(w, params), x) - y) / math.sqrt(n)).reshape(-1)

    jac = torch.func.jacrev(residual)(w0)
    r = residual(w0).detach()
    d = -torch.linalg.solve(jac.T @ jac + lam**2 * torch.eye(w0.numel(), dtype=torch.float64), jac.T @ r)
    f0 = 0.5 * float(r @ r)
    f1 = 0.5 * float(residual(w0 + d) @ residual(w0 + d))
    pred = 0.5 * float((jac @ d) @ (jac @ d)) + float((jac.T @ r) @ d)
    rho = (f1 - f0) / pred

    out = alg.step((x, y))
    assert out["loss"] == pytest.approx(f0, rel=1e-12)
    assert out["rho"] == pytest.approx(rho, rel=1e-8)
    assert out["inner_stop"] == "atol"
    expected_lam = lam / 0.98 if rho < 0.25 else (lam * 0.98 if rho > 0.75 else lam)
    assert alg.lam == pytest.approx(expected_lam, rel=1e-14)
    s = out["step_length"]
    assert s > 0
    torch.testing.assert_close(flatten(obj.params()), w0 + s * d, rtol=1e-9, atol=1e-10)
    # warm start for the next solve: γ₁·d, then γ grows by 1.002
    torch.testing.assert_close(alg.warm_d, 0.7 * d, rtol=1e-8, atol=1e-10)
    assert alg.gamma == pytest.approx(0.7 * 1.002)
    assert out["gamma"] == 0.7


# -- the full algorithm ------------------------------------------------------------------------------


def _run(alg: SHF, data: DataBundle, steps: int, seed: int = 1):
    outs = []
    g = torch.Generator().manual_seed(seed)
    x_all, _ = data.train
    for _ in range(steps):
        idx = torch.randperm(x_all.shape[0], generator=g)[: alg.next_batch_size()]
        outs.append(alg.step((x_all[idx], x_all[idx])))
    return outs


def test_steps_decrease_training_loss_and_batch_grows():
    data = _data()
    obj = Objective(_model(), "squared_error")
    alg = build_shf(obj, data, damping=1.0, batch_size=30, max_batch_size=150, theta=0.05, maxiter=20, seed=0)
    x, y = data.train
    before = float(obj.loss(obj.params(), x, y))
    outs = _run(alg, data, 8)
    after = float(obj.loss(obj.params(), x, y))
    assert after < 0.8 * before
    sizes = [o["batch_size"] for o in outs] + [alg.next_batch_size()]
    assert sizes[:6] == [30] * 6  # adaptation starts after iteration 5
    assert all(b >= a for a, b in zip(sizes, sizes[1:])) and sizes[-1] > 30 and max(sizes) <= 150
    for o in outs:  # maxiter scales with n
        assert o["maxiter_next"] == math.ceil(o["next_batch_size"] * o["maxiter"] / o["batch_size_requested"])
        assert isinstance(o["inner_stop"], str) and o["n_hat"] >= 0 and o["n_hat_sq"] >= 0
        assert math.isfinite(o["f_val"]) and o["precond_time"] >= 0


def test_resume_from_state_dict_gives_identical_next_step():
    data = _data()
    obj = Objective(_model(), "squared_error")
    alg = build_shf(obj, data, damping=1.0, batch_size=30, max_batch_size=150, theta=0.05, maxiter=40, seed=3)
    _run(alg, data, 6)
    model_state = copy.deepcopy(obj.model.state_dict())
    alg_state = copy.deepcopy(alg.state_dict())
    batch = next(_batches(data, [alg.next_batch_size()], seed=9))
    out_a = alg.step(batch)
    params_a = flatten(obj.params()).clone()

    model_b = _model(seed=123)  # different weights, overwritten by the checkpoint
    model_b.load_state_dict(model_state)
    obj_b = Objective(model_b, "squared_error")
    alg_b = build_shf(
        obj_b, data, damping=99.0, batch_size=7, max_batch_size=150, theta=0.05, maxiter=40, seed=77
    )
    alg_b.load_state_dict(alg_state)
    assert alg_b.next_batch_size() == batch[0].shape[0]
    out_b = alg_b.step(batch)
    timing = {k for k in out_a if k.endswith("_time")}
    assert {k: v for k, v in out_a.items() if k not in timing} == {
        k: v for k, v in out_b.items() if k not in timing
    }
    assert torch.equal(params_a, flatten(obj_b.params()))
    assert alg_b.state_dict()["generator"].equal(alg.state_dict()["generator"])


def test_hand_written_and_torch_func_paths_take_the_same_step():
    data = _data()
    outs, params = [], []
    for hand in (True, False):
        obj = Objective(_model(), "squared_error")
        alg = build_shf(obj, data, damping=1.0, batch_size=30, maxiter=60, use_hand_written_gn=hand, seed=0)
        assert alg.hand_written is hand
        outs.append(_run(alg, data, 2))
        params.append(flatten(obj.params()))
    for a, b in zip(*outs):
        assert a["inner_iters"] == b["inner_iters"] and a["inner_stop"] == b["inner_stop"]
        assert a["rho"] == pytest.approx(b["rho"], rel=1e-8)
        assert a["n_hat"] == b["n_hat"]
    torch.testing.assert_close(params[0], params[1], rtol=1e-9, atol=1e-11)


def test_flags_change_what_they_should():
    data = _data()

    def run(steps=2, **kw):
        obj = Objective(_model(), "squared_error")
        alg = build_shf(obj, data, damping=1.0, batch_size=30, maxiter=60, seed=0, **kw)
        return _run(alg, data, steps), flatten(obj.params()), alg

    base, p_base, _ = run()
    # without a preconditioner the scaled and literal step spaces coincide
    _, p1, _ = run(preconditioner="none", step_space="scaled")
    _, p2, _ = run(preconditioner="none", step_space="literal")
    torch.testing.assert_close(p1, p2, rtol=0, atol=0)
    # with it they differ (d = c∘y vs d = y)
    _, p_lit, _ = run(step_space="literal")
    assert not torch.allclose(p_base, p_lit)
    # warm start variants agree on the first step (no warm start yet) and differ later (c changes)
    o_param, _, _ = run(steps=1)
    o_y, _, _ = run(steps=1, warm_start="y")
    assert o_param[0]["rho"] == o_y[0]["rho"]
    # where the damping pulls toward the warm start (damping_center=warm_start) the start is part of
    # the problem, so the two variants take different second steps ...
    _, p_ws, _ = run(damping_center="warm_start")
    _, p_y, _ = run(warm_start="y", damping_center="warm_start")
    assert not torch.allclose(p_ws, p_y)
    # ... with the default (zero) it is only where LSMR starts: converged solves take the same step
    _, p_y0, _ = run(warm_start="y")
    assert torch.allclose(p_base, p_y0)
    # precon_sqrt=False gives a different preconditioner and step
    _, p_nosqrt, _ = run(precon_sqrt=False)
    assert not torch.allclose(p_base, p_nosqrt)
    # variance_norm_power selects which n̂ feeds the history
    _, _, alg1 = run(steps=1)
    _, _, alg2 = run(steps=1, variance_norm_power=2)
    assert alg1.nhat_hist[-1] == base[0]["n_hat"] and alg2.nhat_hist[-1] == base[0]["n_hat_sq"]
    with pytest.raises(ValueError):
        run(step_space="x=c*y")


def test_return_best_flag_reaches_lsmr():
    data = _data()
    outs = {}
    for rb in (False, True):
        obj = Objective(_model(), "squared_error")
        # tiny damping: LSMR runs long, so the recover/maxiter rules can end away from the best merit
        alg = build_shf(
            obj,
            data,
            damping=1e-3,
            batch_size=30,
            maxiter=300,
            atol=0.0,
            ftol=0.0,
            return_best=rb,
            seed=0,
            miniter=10,
            recover=10,
        )
        outs[rb] = _run(alg, data, 1)[0]
    assert outs[False]["inner_iters"] == outs[True]["inner_iters"]
    assert outs[True]["inner_stop"] == "merit_recover"
    assert outs[True]["merit_best_itn"] < outs[True]["inner_iters"]
    # the best-merit iterate is a different (here much better) step than the last one
    assert outs[True]["loss_trial"] < outs[False]["loss_trial"]


def test_nonfinite_trial_rejects_step_and_raises_damping(monkeypatch):
    data = _data()
    obj = Objective(_model(), "squared_error")
    alg = build_shf(obj, data, damping=1.0, batch_size=30, maxiter=30, seed=0)
    before = flatten(obj.params()).clone()
    real = SHF._loss
    calls = {"n": 0}

    def poisoned(self, params, x, y):
        calls["n"] += 1
        if x.shape[0] == 30:  # batch trials (not the validation set)
            return math.nan
        return real(self, params, x, y)

    monkeypatch.setattr(SHF, "_loss", poisoned)
    out = _run(alg, data, 1)[0]
    assert out["rejected"] and out["nonfinite"] and out["step_length"] == 0.0
    assert out["rho"] == -math.inf and alg.lam == pytest.approx(1.0 / 0.98)  # raised once, not twice
    assert torch.equal(before, flatten(obj.params()))


def test_requires_squared_error_and_validates_flags():
    data = _data()
    with pytest.raises(ValueError):
        build_shf(Objective(_model(), "sigmoid_bce"), data)
    with pytest.raises(ValueError):
        build_shf(Objective(_model(), "squared_error"), data, variance_norm_power=3)


@pytest.mark.parametrize("center", ["warm_start", "zero"])
def test_second_step_damping_center_against_dense(center):
    """Step 2 has a warm start y0 = γ·d₁. damping_center="warm_start" (Eq. 19 / Algorithm 6):
    d = y0 + (JᵀJ + λ²I)⁻¹Jᵀ(−R − J y0); "zero" (Algorithm 1's normal equations):
    d = −(JᵀJ + λ²I)⁻¹JᵀR, whatever y0 is."""
    data = _data()
    obj = Objective(_model(), "squared_error")
    lam = 0.3
    alg = SHF(
        obj,
        data,
        damping=lam,
        drop=1.0,  # keep λ fixed so the reference uses the same λ at step 2
        preconditioner="none",
        merit=False,
        maxiter=500,
        atol=1e-14,
        batch_size=40,
        damping_center=center,
    )
    batches = _batches(data, [40, 40])
    alg.step(next(batches))
    x, y = next(batches)
    params = {k: v.clone() for k, v in obj.params().items()}
    w0 = flatten(params)
    y0 = alg.warm_d.clone()
    n = x.shape[0]

    def residual(w):
        return ((obj.forward(unflatten(w, params), x) - y) / math.sqrt(n)).reshape(-1)

    jac = torch.func.jacrev(residual)(w0)
    r = residual(w0).detach()
    k = jac.T @ jac + lam**2 * torch.eye(w0.numel(), dtype=torch.float64)
    d_zero = -torch.linalg.solve(k, jac.T @ r)
    d_warm = y0 + torch.linalg.solve(k, jac.T @ (-r - jac @ y0))
    assert float((d_zero - d_warm).norm()) > 1e-3 * float(d_zero.norm())  # the readings differ here
    alg.step((x, y))  # the new warm start is γ₂·d₂ with γ₂ = 0.7·1.002
    expected = d_warm if center == "warm_start" else d_zero
    torch.testing.assert_close(alg.warm_d, 0.7 * 1.002 * expected, rtol=1e-7, atol=1e-10)
