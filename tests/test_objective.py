"""Objective's matrix-free products against dense float64 Jacobians, GGNs and Hessians."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

from curvopt.objective import Objective, flatten, per_example_loss, tree_dot, unflatten


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


N, D_IN, D_OUT = 5, 4, 3


def _problem(kind: str):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(D_IN, 6), nn.Tanh(), nn.Linear(6, D_OUT)).double()
    x = torch.randn(N, D_IN)
    if kind == "cross_entropy":
        y = torch.randint(0, D_OUT, (N,))
    elif kind == "sigmoid_bce":
        y = torch.rand(N, D_OUT)
    else:
        y = torch.randn(N, D_OUT)
    return Objective(model, kind), x, y


def _dense(obj: Objective, x, y):
    params = obj.params()
    flat = flatten(params)

    def outputs(theta):
        return functional_call(obj.model, unflatten(theta, params), (x,))

    def loss(theta):
        return obj.loss(unflatten(theta, params), x, y)

    J = jacrev(outputs)(flat).reshape(N * D_OUT, -1)  # (N*C, P)
    out = outputs(flat).detach()
    blocks = []
    for i in range(N):
        o = out[i]
        if obj.loss_kind == "squared_error":
            h = torch.eye(D_OUT)
        elif obj.loss_kind == "cross_entropy":
            p = torch.softmax(o, 0)
            h = torch.diag(p) - torch.outer(p, p)
        else:
            p = torch.sigmoid(o)
            h = torch.diag(p * (1 - p))
        blocks.append(h)
    H_out = torch.block_diag(*blocks) / N
    G = J.T @ H_out @ J
    H = hessian(loss)(flat)
    return params, J, G, H


@pytest.mark.parametrize("kind", ["squared_error", "cross_entropy", "sigmoid_bce"])
def test_products_match_dense(kind):
    obj, x, y = _problem(kind)
    params, J, G, H = _dense(obj, x, y)
    v = {k: torch.randn_like(p) for k, p in params.items()}
    u = torch.randn(N, D_OUT)
    vf = flatten(v)
    torch.testing.assert_close(obj.jvp(params, x, v).reshape(-1), J @ vf)
    torch.testing.assert_close(flatten(obj.vjp(params, x, u)), J.T @ u.reshape(-1))
    torch.testing.assert_close(flatten(obj.ggn_vp(params, x, y, v)), G @ vf)
    torch.testing.assert_close(flatten(obj.hvp(params, x, y, v)), H @ vf)
    _, jvp_fn, vjp_fn = obj.linearize(params, x)
    torch.testing.assert_close(jvp_fn(v).reshape(-1), J @ vf)
    torch.testing.assert_close(flatten(vjp_fn(u)), J.T @ u.reshape(-1))
    # adjoint identity <Jv, u> = <v, J^T u>
    torch.testing.assert_close(tree_dot(v, obj.vjp(params, x, u)), (obj.jvp(params, x, v) * u).sum())


@pytest.mark.parametrize("kind", ["squared_error", "cross_entropy", "sigmoid_bce"])
def test_ggn_gram_matches_dense_quadratic_form(kind):
    """``ggn_gram`` (JVPs only) gives ``Vᵀ G V`` of the dense GGN."""
    obj, x, y = _problem(kind)
    params, _, G, _ = _dense(obj, x, y)
    vs = [{k: torch.randn_like(p) for k, p in params.items()} for _ in range(3)]
    V = torch.stack([flatten(v) for v in vs], dim=1)
    torch.testing.assert_close(obj.ggn_gram(params, x, y, vs), V.T @ G @ V)
    assert obj.ggn_gram(params, x, y, []).shape == (0, 0)


def test_ggn_equals_hessian_for_linear_least_squares():
    """For a linear model with squared error the GGN is the exact Hessian."""
    model = nn.Linear(D_IN, D_OUT).double()
    obj = Objective(model, "squared_error")
    x, y = torch.randn(N, D_IN), torch.randn(N, D_OUT)
    params, _, G, H = _dense(obj, x, y)
    torch.testing.assert_close(G, H)


def test_gradient_and_per_example_losses():
    obj, x, y = _problem("squared_error")
    params = obj.params()
    value, g = obj.gradient(params, x, y)
    per = obj.per_example_losses(params, x, y)
    out = obj.forward(params, x)
    torch.testing.assert_close(per, 0.5 * ((out - y) ** 2).sum(1))
    torch.testing.assert_close(value, per.mean())
    params_req = {k: p.clone().requires_grad_(True) for k, p in params.items()}
    loss = obj.loss(params_req, x, y)
    auto = torch.autograd.grad(loss, list(params_req.values()))
    for a, b in zip(auto, g.values()):
        torch.testing.assert_close(a, b)


def test_unknown_loss_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown loss kind"):
        Objective(nn.Linear(2, 2), "hinge")
    with pytest.raises(ValueError, match="unknown loss kind"):
        per_example_loss(torch.zeros(2, 2), torch.zeros(2, 2), "hinge")
