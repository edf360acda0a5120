"""Gauss-Newton operators of R(w;X) = (net(w;X) − Y)/√n against dense float64 Jacobians."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from curvopt.curvature.mlp_gn import (
    FuncGaussNewton,
    MLPGaussNewton,
    mlp_layers,
    residual_gauss_newton,
    supports_hand_written,
)
from curvopt.objective import Objective, flatten, unflatten

N, D_IN = 7, 5


def _net(acts=("sigmoid", "tanh", "relu", "sigmoid"), bias_last=True) -> nn.Sequential:
    mods = {"sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "relu": nn.ReLU}
    sizes = [D_IN, 4, 3, 4, D_IN]
    layers: list[nn.Module] = []
    for i, act in enumerate(acts):
        layers.append(nn.Linear(sizes[i], sizes[i + 1], bias=bias_last or i < len(acts) - 1))
        if act != "identity":
            layers.append(mods[act]())
    return nn.Sequential(*layers).double()


def _setup(net: nn.Sequential):
    torch.manual_seed(0)
    obj = Objective(net, "squared_error")
    params = obj.params()
    x = torch.rand(N, D_IN, dtype=torch.float64)
    y = torch.rand(N, D_IN, dtype=torch.float64)
    w0 = flatten(params)

    def residual(w):
        return ((obj.forward(unflatten(w, params), x) - y) / math.sqrt(N)).reshape(-1)

    jac = torch.func.jacrev(residual)(w0)  # (N·D, P), scaled by 1/√n
    return obj, params, x, y, jac


NETS = {
    "sigmoid_ae": lambda: _net(("sigmoid", "sigmoid", "sigmoid", "sigmoid")),
    "mixed": lambda: _net(("sigmoid", "tanh", "relu", "sigmoid")),
    "linear_code_no_last_bias": lambda: _net(("sigmoid", "identity", "sigmoid", "identity"), bias_last=False),
}


@pytest.mark.parametrize("name", list(NETS))
@pytest.mark.parametrize("kind", ["hand", "func"])
def test_products_equal_dense_jacobian(name, kind):
    obj, params, x, y, jac = _setup(NETS[name]())
    gn = MLPGaussNewton(obj, params, x, y) if kind == "hand" else FuncGaussNewton(obj, params, x, y)
    p = jac.shape[1]
    assert gn.numel == p
    g = torch.Generator().manual_seed(1)
    v = torch.randn(p, dtype=torch.float64, generator=g)
    u = torch.randn(N, D_IN, dtype=torch.float64, generator=g)
    torch.testing.assert_close(gn.jvp(v).reshape(-1), jac @ v, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(gn.vjp(u), jac.T @ u.reshape(-1), rtol=1e-12, atol=1e-13)
    # GN operator Jᵀ(J v) equals the dense JᵀJ
    torch.testing.assert_close(gn.vjp(gn.jvp(v)), jac.T @ (jac @ v), rtol=1e-11, atol=1e-13)
    # adjoint identity ⟨Jd, U⟩ = ⟨d, JᵀU⟩
    assert float((gn.jvp(v) * u).sum()) == pytest.approx(float(v @ gn.vjp(u)), rel=1e-12)
    # residual, loss, gradient
    r = ((obj.forward(params, x) - y) / math.sqrt(N)).detach()
    torch.testing.assert_close(gn.residual, r)
    assert gn.loss() == pytest.approx(float(obj.loss(params, x, y)), rel=1e-13)
    _, grad = obj.gradient(params, x, y)
    torch.testing.assert_close(gn.gradient(), flatten(grad), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", list(NETS))
def test_per_example_moments_equal_explicit_per_example_gradients(name):
    obj, params, x, y, jac = _setup(NETS[name]())
    per_ex_jac = jac.reshape(N, D_IN, -1) * math.sqrt(N)  # unscaled J_i
    top = torch.randn(N, D_IN, dtype=torch.float64)
    explicit = torch.einsum("idp,id->ip", per_ex_jac, top)
    for gn in (MLPGaussNewton(obj, params, x, y), FuncGaussNewton(obj, params, x, y, chunk_size=3)):
        total, sq = gn.per_example_moments(top)
        torch.testing.assert_close(total, explicit.sum(0), rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(sq, (explicit**2).sum(0), rtol=1e-12, atol=1e-13)
    # with top = out − y the rows are per-example gradients of f_i = ½‖r_i‖², checked by autograd
    gsum, gsq = MLPGaussNewton(obj, params, x, y).batch_gradient_moments()
    rows = []
    for i in range(N):
        _, gi = obj.gradient(params, x[i : i + 1], y[i : i + 1])
        rows.append(flatten(gi))
    rows_t = torch.stack(rows)
    torch.testing.assert_close(gsum, rows_t.sum(0), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(gsq, (rows_t**2).sum(0), rtol=1e-12, atol=1e-13)


def test_hand_written_equals_torch_func_and_same_rademacher_draw():
    obj, params, x, y, _ = _setup(NETS["sigmoid_ae"]())
    hand, func = MLPGaussNewton(obj, params, x, y), FuncGaussNewton(obj, params, x, y)
    d_hand = hand.gn_diag_estimate(torch.Generator().manual_seed(3))
    d_func = func.gn_diag_estimate(torch.Generator().manual_seed(3))
    torch.testing.assert_close(d_hand, d_func, rtol=1e-12, atol=1e-14)


def test_chapelle_erhan_estimator_fixed_draw_and_expectation():
    obj, params, x, y, jac = _setup(NETS["sigmoid_ae"]())
    gn = MLPGaussNewton(obj, params, x, y)
    exact = (jac * jac).sum(0)  # diag(JᵀJ), J with the 1/√n factor
    # one fixed draw: (1/n) Σ_i (J_iᵀ u_i)² with the unscaled per-example Jacobians
    gen = torch.Generator().manual_seed(4)
    est = gn.gn_diag_estimate(gen)
    gen = torch.Generator().manual_seed(4)
    u = torch.randint(0, 2, (N, D_IN), generator=gen).double() * 2 - 1
    per_ex = torch.einsum("idp,id->ip", jac.reshape(N, D_IN, -1) * math.sqrt(N), u)
    torch.testing.assert_close(est, (per_ex**2).sum(0) / N, rtol=1e-12, atol=1e-14)
    # unbiased: the mean of many draws approaches the exact diagonal
    gen = torch.Generator().manual_seed(5)
    draws = 3000
    mean = sum(gn.gn_diag_estimate(gen) for _ in range(draws)) / draws
    big = exact > 1e-3 * exact.max()
    rel = ((mean - exact).abs() / exact)[big]
    assert rel.max() < 0.1 and rel.mean() < 0.03
    # a single draw is visibly noisy, so the check above is not vacuous
    single = gn.gn_diag_estimate(torch.Generator().manual_seed(6))
    assert ((single - exact).abs() / exact)[big].max() > 0.1


def test_layer_plan_and_fallback():
    obj = Objective(_net(), "squared_error")
    assert mlp_layers(obj.model, obj.params()) is not None and supports_hand_written(obj)
    odd = nn.Sequential(nn.Linear(3, 4), nn.Softplus(), nn.Linear(4, 3)).double()
    obj_odd = Objective(odd, "squared_error")
    assert not supports_hand_written(obj_odd)
    x = torch.rand(4, 3, dtype=torch.float64)
    gn = residual_gauss_newton(obj_odd, obj_odd.params(), x, x, hand_written=True)
    assert isinstance(gn, FuncGaussNewton)
    assert not supports_hand_written(Objective(_net(), "sigmoid_bce"))


@pytest.mark.parametrize("kind", ["hand", "func"])
def test_column_scaled_products_and_output_buffers(kind):
    """``col_scale=c`` gives A·diag(c) and diag(c)·Aᵀ; ``out=`` buffers give the same numbers."""
    obj, params, x, y, jac = _setup(NETS["linear_code_no_last_bias"]())
    gn = MLPGaussNewton(obj, params, x, y) if kind == "hand" else FuncGaussNewton(obj, params, x, y)
    g = torch.Generator().manual_seed(2)
    p = jac.shape[1]
    v = torch.randn(p, dtype=torch.float64, generator=g)
    u = torch.randn(N, D_IN, dtype=torch.float64, generator=g)
    c = torch.rand(p, dtype=torch.float64, generator=g) + 0.5
    jv_out, vj_out = torch.empty(N, D_IN, dtype=torch.float64), torch.empty(p, dtype=torch.float64)
    got = gn.jvp(v, out=jv_out, col_scale=c)
    assert got.data_ptr() == jv_out.data_ptr()
    torch.testing.assert_close(got.reshape(-1), jac @ (c * v), rtol=1e-12, atol=1e-13)
    got = gn.vjp(u, out=vj_out, col_scale=c)
    assert got.data_ptr() == vj_out.data_ptr()
    torch.testing.assert_close(got, c * (jac.T @ u.reshape(-1)), rtol=1e-12, atol=1e-13)
    # v and u are left untouched, and a second call into the same buffers is independent of the first
    torch.testing.assert_close(gn.jvp(v, out=jv_out).reshape(-1), jac @ v, rtol=1e-12, atol=1e-13)
