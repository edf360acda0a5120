"""Martens HF-CG (curvopt.optim.hf_cg) against dense float64 references and hand-made cases."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev

import curvopt.optim.hf_cg as hf
from curvopt.api import DataBundle
from curvopt.curvature.cg import MartensCGResult
from curvopt.data.synthetic import low_rank_images
from curvopt.models.mlp import autoencoder
from curvopt.objective import Objective, flatten, per_example_loss


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny problems: intra-op threads only add contention on the shared 2-core box (10-100x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny_ae(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = autoencoder([12, 6, 3], activation="sigmoid", code_activation=None, output_activation=None)
    return model.double()


def _tiny_data(n: int = 64, dim: int = 12, seed: int = 0) -> DataBundle:
    data = low_rank_images(num_train=n, num_val=8, num_test=8, dim=dim, rank=3, seed=seed)
    x, _ = data.train
    x = x.double()
    return DataBundle(train=(x, x), val=None, test=None, meta=data.meta)


def _explicit_moments(objective: Objective, params, x, y):
    loss_sum, gsum, gsq = 0.0, 0.0, 0.0
    for i in range(x.shape[0]):

        def li(p, xi=x[i : i + 1], yi=y[i : i + 1]):
            return per_example_loss(objective.forward(p, xi), yi, objective.loss_kind).sum()

        gi = flatten(grad(li)(params))
        loss_sum += float(li(params))
        gsum = gsum + gi
        gsq = gsq + gi * gi
    return loss_sum, gsum, gsq


@pytest.mark.parametrize("loss", ["sigmoid_bce", "squared_error"])
def test_gradient_moments_match_per_example_loop(loss):
    model = _tiny_ae()
    obj = Objective(model, loss)
    params = obj.params()
    x = _tiny_data(n=20).train[0]
    ref = _explicit_moments(obj, params, x, x)
    for chunk in (7, 100):
        got = hf.gradient_moments(obj, params, x, x, chunk=chunk)
        assert got[0] == pytest.approx(ref[0], rel=1e-12)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got[2], ref[2], rtol=1e-10, atol=1e-12)
    # the generic vmap path (non-Sequential models), with tiny sub-chunks
    ls, gs, gq = hf._moments_vmap(obj, params, x, x, True, max_elements=3 * obj.num_params())
    torch.testing.assert_close(flatten([gs[k] for k in params]), ref[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(flatten([gq[k] for k in params]), ref[2], rtol=1e-10, atol=1e-12)
    assert ls == pytest.approx(ref[0], rel=1e-12)


def test_weight_mask_and_damping_rule():
    params = _tiny_ae()
    mask = hf.weight_mask(dict(params.named_parameters()))
    expected = torch.cat([torch.full((p.numel(),), float(p.dim() == 2)) for p in params.parameters()])
    torch.testing.assert_close(mask, expected.double())
    assert hf.update_damping(45.0, 0.1) == pytest.approx(67.5)
    assert hf.update_damping(45.0, math.nan) == pytest.approx(67.5)
    assert hf.update_damping(45.0, -math.inf) == pytest.approx(67.5)
    assert hf.update_damping(45.0, 0.5) == 45.0
    assert hf.update_damping(45.0, 0.9) == pytest.approx(30.0)
    assert hf.update_damping(45.0, 0.25) == 45.0 and hf.update_damping(45.0, 0.75) == 45.0


def test_one_step_recovers_least_squares_minimiser():
    """Linear model + squared error: GN = Hessian, so an exact damped-Newton step with λ → 0
    lands on the minimiser of mean ½‖Wx + b − y‖² + ½·wc·‖W‖² (dense float64 normal equations)."""
    torch.manual_seed(1)
    n, d_in, d_out, wc = 50, 5, 3, 1e-2
    x = torch.randn(n, d_in, dtype=torch.float64) * torch.tensor([0.1, 1, 3, 1, 10], dtype=torch.float64)
    y = torch.randn(n, d_out, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(d_in, d_out)).double()
    obj = Objective(model, "squared_error")
    algo = hf.build_hf_cg(
        obj,
        DataBundle(train=(x, y)),
        initlambda=1e-12,
        weight_cost=wc,
        numchunks=1,
        cg_maxiter=60,
        cg_progress_tol=0.0,
        eval_chunk=17,
    )
    out = algo.step((x[:4], y[:4]))
    xt = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)
    reg = torch.diag(torch.tensor([wc] * d_in + [0.0], dtype=torch.float64))
    wt = torch.linalg.solve(xt.T @ xt / n + reg, xt.T @ y / n).T  # (d_out, d_in + 1)
    torch.testing.assert_close(model[0].weight.detach(), wt[:, :d_in], rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(model[0].bias.detach(), wt[:, d_in], rtol=1e-8, atol=1e-9)
    assert out["step_length"] == 1.0 and out["accepted"] == 1
    # exact quadratic: ρ = 1 ⇒ λ·2/3
    assert out["rho"] == pytest.approx(1.0, abs=1e-6)
    assert out["damping_next"] == pytest.approx(1e-12 * 2 / 3)


@pytest.mark.parametrize("products", ["mlp", "linearize", "jvp"])
def test_cg_solution_solves_dense_damped_gauss_newton_system(products):
    model = _tiny_ae()
    obj = Objective(model, "sigmoid_bce")
    data = _tiny_data(n=40)
    x = data.train[0]
    params = {k: v.clone() for k, v in obj.params().items()}
    wc, lam, numchunks = 1e-3, 0.5, 2
    algo = hf.HFCG(
        obj,
        data,
        initlambda=lam,
        weight_cost=wc,
        numchunks=numchunks,
        cg_maxiter=400,
        cg_progress_tol=0.0,
        seed=3,
        curvature_products=products,
    )
    idx = algo._chunk_indices(0)
    algo.step((x[:2], x[:2]))
    p = algo.prev_solution
    # dense references: full-set gradient of F, chunk GN of the mean BCE
    mask = hf.weight_mask(params)
    keys = list(params)
    w0 = flatten(params)

    def f_full(w):
        pd = dict(zip(keys, torch.split(w, [params[k].numel() for k in keys])))
        pd = {k: v.view_as(params[k]) for k, v in pd.items()}
        out = functional_call(model, pd, (x,))
        return per_example_loss(out, x, "sigmoid_bce").mean() + 0.5 * wc * ((w * mask) ** 2).sum()

    g = torch.func.grad(f_full)(w0)
    xc = x[idx]

    def net(w):
        pd = dict(zip(keys, torch.split(w, [params[k].numel() for k in keys])))
        pd = {k: v.view_as(params[k]) for k, v in pd.items()}
        return functional_call(model, pd, (xc,))

    jac = jacrev(net)(w0).reshape(-1, w0.numel())  # (n_c·12, P)
    prob = torch.sigmoid(net(w0)).reshape(-1)
    gn = jac.T @ ((prob * (1 - prob))[:, None] * jac) / xc.shape[0]
    a = gn + torch.diag(wc * mask) + lam * torch.eye(w0.numel(), dtype=torch.float64)
    p_ref = torch.linalg.solve(a, -g)
    torch.testing.assert_close(p, p_ref, rtol=1e-7, atol=1e-9)


def test_few_steps_decrease_full_objective_and_cycle_chunks():
    torch.manual_seed(0)
    model = autoencoder(
        [12, 8, 3],
        activation="sigmoid",
        code_activation=None,
        output_activation=None,
        init="sparse",
        sparse_init_count=4,
        sparse_init_std=1.0,
    ).double()
    obj = Objective(model, "sigmoid_bce")
    data = _tiny_data(n=96)
    algo = hf.build_hf_cg(obj, data, numchunks=3, initlambda=1.0, cg_maxiter=50)
    assert algo.next_batch_size() == 32
    chunks = [algo._chunk_indices(c) for c in range(3)]
    assert sorted(torch.cat(chunks).tolist()) == list(range(96))
    rows = [algo.step((data.train[0][:5], data.train[1][:5])) for _ in range(6)]
    assert [r["chunk_index"] for r in rows] == [0, 1, 2, 0, 1, 2]
    for r in rows:
        assert r["objective_after"] <= r["objective"] + 1e-12
        assert r["inner_iters"] >= 1 and r["chunk_size"] == 32
    assert rows[-1]["objective_after"] < 0.9 * rows[0]["objective"]
    # the loss logged is the full-set data loss before the step
    assert rows[1]["objective"] == pytest.approx(rows[0]["objective_after"], rel=1e-12)


def test_state_dict_round_trip_gives_identical_next_step():
    data = _tiny_data(n=48)
    cfg = dict(numchunks=2, initlambda=2.0, cg_maxiter=30, seed=5)
    obj = Objective(_tiny_ae(), "sigmoid_bce")
    algo = hf.HFCG(obj, data, **cfg)
    batch = (data.train[0][:2], data.train[1][:2])
    for _ in range(3):
        algo.step(batch)
    saved_params = {k: v.clone() for k, v in obj.params().items()}
    state = algo.state_dict()
    ref = algo.step(batch)
    ref_params = flatten(obj.params()).clone()

    obj2 = Objective(_tiny_ae(seed=9), "sigmoid_bce")
    obj2.set_params(saved_params)
    algo2 = hf.HFCG(obj2, data, **{**cfg, "seed": 123})  # the permutation must come from the state
    algo2.load_state_dict(state)
    out = algo2.step(batch)
    assert torch.equal(flatten(obj2.params()), ref_params)
    drop = ("time",)
    assert {k: v for k, v in out.items() if not k.endswith(drop)} == {
        k: v for k, v in ref.items() if not k.endswith(drop)
    }


def _fake_cg(stored_dirs):
    def fake(matvec, b, x0=None, precond=None, **kw):
        stored = [(i, d.clone()) for i, d in stored_dirs]
        return MartensCGResult(
            x=stored[-1][1], iterations=stored[-1][0], phi=[0.0], stored=stored, stop_reason="maxiter"
        )

    return fake


def test_cg_backtracking_walks_back_while_objective_decreases(monkeypatch):
    data = _tiny_data(n=32)
    obj = Objective(_tiny_ae(), "sigmoid_bce")
    algo = hf.HFCG(obj, data, numchunks=1, cg_maxiter=30, weight_cost=0.0)
    w0 = flatten(obj.params()).clone()
    g = hf.gradient_moments(obj, obj.params(), *data.train, want_sq=False)[1] / 32
    # stored iterates along −g with lengths chosen so that the middle one is best
    steps = [1e-3, 1.0, 50.0, 400.0]
    f = [
        algo._objective_value(algo._trial(obj.params(), -s * g), hf.weight_mask(obj.params()), *data.train)
        for s in steps
    ]
    best = min(range(4), key=lambda i: f[i])
    assert 0 < best < 3, f
    monkeypatch.setattr(
        hf,
        "martens_cg",
        _fake_cg([(5, -steps[0] * g), (7, -steps[1] * g), (9, -steps[2] * g), (12, -steps[3] * g)]),
    )
    out = algo.step((data.train[0][:2], data.train[1][:2]))
    # walk from the last: stops at the first increase when going back
    expected = 3
    while expected > 0 and f[expected - 1] <= f[expected]:
        expected -= 1
    assert out["cg_backtrack_index"] == [5, 7, 9, 12][expected]
    assert out["cg_backtrack_steps"] == 3 - expected
    if out["step_length"] == 1.0:
        torch.testing.assert_close(flatten(obj.params()), w0 - steps[expected] * g)


def test_ascent_direction_is_rejected_and_damping_boosted(monkeypatch):
    data = _tiny_data(n=32)
    obj = Objective(_tiny_ae(), "sigmoid_bce")
    algo = hf.HFCG(obj, data, numchunks=2, initlambda=10.0, ls_max_reductions=5)
    w0 = flatten(obj.params()).clone()
    g = hf.gradient_moments(obj, obj.params(), *data.train, want_sq=False)[1] / 32
    monkeypatch.setattr(hf, "martens_cg", _fake_cg([(5, 0.5 * g)]))
    out = algo.step((data.train[0][:2], data.train[1][:2]))
    assert out["accepted"] == 0 and out["step_length"] == 0.0 and out["ls_reductions"] == 4
    assert out["rho"] == -math.inf and out["damping_next"] == pytest.approx(15.0)
    assert torch.equal(flatten(obj.params()), w0)
    assert algo.chunk_index == 1
