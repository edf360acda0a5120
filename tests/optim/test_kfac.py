"""K-FAC against dense float64 references: exact Fisher blocks for one example, KFC patch algebra
(conv and transposed conv) against autograd, Kronecker preconditioning against a dense solve, the
quadratic-model coefficients against a dense GGN, and the damping rule on an exactly quadratic loss."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from curvopt.curvature.kfac_factors import (
    activation_rows,
    convT_as_conv_input,
    convT_equivalent_weight,
    input_factor,
    output_rows,
)
from curvopt.models.char_lstm import CharLSTM
from curvopt.objective import Objective, mean_loss
from curvopt.optim.kfac import KFAC


@pytest.fixture(autouse=True)
def _float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def _factors(k: KFAC, block_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = k.blocks[block_index]
    return b.A / b.weight, b.G / b.weight


def test_linear_blocks_equal_dense_empirical_fisher_for_one_example():
    torch.manual_seed(1)
    model = _mlp()
    x, y = torch.randn(1, 4), torch.tensor([1])
    k = KFAC(
        Objective(model, "cross_entropy"),
        lr=0.1,
        momentum=0.0,
        estimation="empirical",
        adaptive_damping=False,
    )
    k.step((x, y))
    # dense per-example gradient at the *pre-step* parameters: recompute from a copy
    torch.manual_seed(1)
    model0 = _mlp()  # same initial parameters as `model`
    loss = mean_loss(model0(x), y, "cross_entropy")
    grads = torch.autograd.grad(loss, list(model0.parameters()))
    for bi, (w, b) in enumerate([(0, 1), (2, 3)]):
        gmat = torch.cat([grads[w], grads[b][:, None]], dim=1)  # (out, in+1)
        vec = gmat.t().reshape(-1)  # column-major vec
        dense = torch.outer(vec, vec)
        A, G = _factors(k, bi)
        torch.testing.assert_close(torch.kron(A, G), dense, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["conv", "convT"])
def test_patch_algebra_reproduces_autograd_weight_gradient(kind):
    torch.manual_seed(0)
    if kind == "conv":
        layer = nn.Conv2d(3, 4, 3, stride=2, padding=1).double()
    else:
        layer = nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1).double()
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten())
    x = torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    k = KFAC(
        Objective(model, "squared_error"),
        lr=0.1,
        momentum=0.0,
        estimation="empirical",
        adaptive_damping=False,
    )
    block = k.blocks[0]
    k._capturing = True
    out = model(x)
    k._capturing = False
    loss = mean_loss(out, y, "squared_error")
    res = torch.autograd.grad(loss, [layer.weight, layer.bias, block.outputs])
    rows_a = activation_rows(block.kind, block.module, block.inputs, block.has_bias)
    rows_g = output_rows(block.kind, res[2])
    from_factors = rows_g.t() @ rows_a  # Σ_t ds_t ā_tᵀ
    torch.testing.assert_close(from_factors, k._grad_matrix(block, [res[0], res[1]]), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "kind,kernel,stride,padding,output_padding,dilation",
    [
        ("conv", 3, 1, 1, 0, 1),
        ("conv", 3, 2, 1, 0, 1),
        ("conv", 3, 2, 0, 0, 2),
        ("conv", 5, 3, 2, 0, 1),
        ("convT", 3, 2, 1, 1, 1),  # the AE's decoder layers
        ("convT", 3, 1, 1, 0, 1),
        ("convT", 4, 2, 1, 0, 1),
        ("convT", 3, 3, 0, 2, 1),
        ("convT", 3, 4, 1, 0, 1),  # stride > kernel: classes without taps
    ],
)
@pytest.mark.parametrize("bias", [True, False])
def test_input_factor_equals_the_gram_of_the_im2col_rows(
    kind, kernel, stride, padding, output_padding, dilation, bias
):
    """The fast path (channels-last patches, per-residue taps of transposed convolutions, bias from
    column sums) gives exactly ``rowsᵀrows / M`` of the reference im2col rows."""
    torch.manual_seed(0)
    if kind == "conv":
        layer = nn.Conv2d(3, 4, kernel, stride=stride, padding=padding, dilation=dilation, bias=bias)
    else:
        layer = nn.ConvTranspose2d(
            3, 4, kernel, stride=stride, padding=padding, output_padding=output_padding, bias=bias
        )
    model = nn.Sequential(layer, nn.Flatten())
    k = KFAC(Objective(model, "squared_error"), lr=0.1, momentum=0.0, adaptive_damping=False)
    block = k.blocks[0]
    k._capturing = True
    model(torch.randn(2, 3, 6, 7))
    k._capturing = False
    args = (block.kind, block.module, block.inputs, block.has_bias)
    rows = activation_rows(*args)
    torch.testing.assert_close(input_factor(*args), rows.t() @ rows / rows.shape[0], rtol=1e-12, atol=1e-14)


def test_conv_transpose_equivalent_convolution():
    torch.manual_seed(0)
    layer = nn.ConvTranspose2d(3, 5, 3, stride=2, padding=1, output_padding=1).double()
    x = torch.randn(2, 3, 4, 4)
    ref = layer(x)
    eq = torch.nn.functional.conv2d(
        convT_as_conv_input(x, layer), convT_equivalent_weight(layer.weight), layer.bias
    )
    torch.testing.assert_close(eq, ref)


@pytest.mark.parametrize("layer_kind", ["linear", "convT"])
def test_preconditioning_matches_dense_factored_damping(layer_kind):
    torch.manual_seed(2)
    if layer_kind == "linear":
        model = nn.Sequential(nn.Linear(4, 3)).double()
        x, y = torch.randn(16, 4), torch.randn(16, 3)
    else:
        model = nn.Sequential(
            nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1, output_padding=1), nn.Flatten()
        )
        x = torch.randn(8, 2, 3, 3)
        y = torch.randn(8, 2 * 6 * 6)
    model = model.double()
    k = KFAC(Objective(model, "squared_error"), lr=0.1, momentum=0.0, damping=0.3, adaptive_damping=False)
    k.step((x, y))
    A, G = _factors(k, 0)
    grads = [torch.randn_like(p) for p in k.params]
    pre = k.precondition(grads)
    lam = 0.3
    pi = math.sqrt((A.trace() / A.shape[0]) / (G.trace() / G.shape[0]))
    dense = torch.kron(
        A + pi * math.sqrt(lam) * torch.eye(A.shape[0]), G + math.sqrt(lam) / pi * torch.eye(G.shape[0])
    )
    block = k.blocks[0]
    gvec = k._grad_matrix(block, grads).t().reshape(-1)
    expect = torch.linalg.solve(dense, gvec)
    got = k._grad_matrix(block, pre).t().reshape(-1)
    torch.testing.assert_close(got, expect, rtol=1e-8, atol=1e-10)


def _dense_ggn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = {n: p.detach() for n, p in model.named_parameters()}
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    J = torch.cat([j.reshape(x.shape[0] * 2, -1) for j in jac.values()], dim=1)  # squared error: H_out = I
    return J.t() @ J / x.shape[0]


def test_adaptive_coefficients_minimise_the_dense_quadratic_model():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(10, 3), torch.randn(10, 2)
    k = KFAC(
        Objective(model, "squared_error"),
        lr="adaptive",
        momentum="adaptive",
        damping=0.5,
        adaptive_damping=False,
    )
    k.step((x, y))  # creates a velocity
    params0 = [p.detach().clone() for p in k.params]
    velocity = torch.cat([v.reshape(-1) for v in k.velocity])
    C = _dense_ggn(model, x)
    loss = mean_loss(model(x), y, "squared_error")
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, list(model.parameters()))])
    scalars = k.step((x, y))
    delta = torch.cat([(p.detach() - p0).reshape(-1) for p, p0 in zip(k.params, params0)])
    # δ = a·Δ + b·v must minimise gᵀδ + ½δᵀ(C + λI)δ over (a, b): check the 2×2 normal equations
    lam = 0.5
    Cd = C + lam * torch.eye(C.shape[0])
    a = scalars["lr_coeff"]
    b = scalars["momentum_coeff"]
    nat = (delta - b * velocity) / a
    V = torch.stack([nat, velocity], dim=1)
    coeff = torch.linalg.solve(V.t() @ Cd @ V, -V.t() @ g)
    torch.testing.assert_close(torch.tensor([a, b]), coeff, rtol=1e-6, atol=1e-10)


def test_damping_decreases_when_the_model_is_exact():
    # linear model + squared error: f(θ+δ) − f(θ) = gᵀδ + ½δᵀCδ exactly, so ρ = 1 > ¾
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 2)).double()
    x, y = torch.randn(20, 3), torch.randn(20, 2)
    k = KFAC(
        Objective(model, "squared_error"),
        lr=0.3,
        momentum=0.0,
        damping=1.0,
        damping_adaptation_interval=1,
        damping_adaptation_decay=0.9,
    )
    s = k.step((x, y))
    assert s["rho"] == pytest.approx(1.0, rel=1e-9)
    assert k.damping == pytest.approx(0.9)


def test_damping_increases_when_the_step_overshoots():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(3, 2)).double()
    x, y = torch.randn(20, 3), torch.randn(20, 2)
    k = KFAC(
        Objective(model, "squared_error"),
        lr=50.0,
        momentum=0.0,
        damping=1.0,
        damping_adaptation_interval=1,
        damping_adaptation_decay=0.9,
    )
    s = k.step((x, y))
    assert s["rho"] < 0.25
    assert k.damping == pytest.approx(1.0 / 0.9)


def test_lstm_parameters_are_refused_unless_diagonal():
    model = CharLSTM(vocab_size=8, hidden_size=4, mlp_hidden=4).double()
    with pytest.raises(NotImplementedError, match="LSTM"):
        KFAC(Objective(model, "cross_entropy"))
    k = KFAC(Objective(model, "cross_entropy"), uncovered="diagonal", lr=0.1, momentum=0.0)
    x = torch.randint(0, 8, (3, 5))
    before = model.lstm1.weight.detach().clone()
    k.step((x, x))
    assert not torch.equal(before, model.lstm1.weight)


def test_batchnorm_running_stats_only_see_the_training_forward():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    ref = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    k = KFAC(Objective(model, "cross_entropy"), uncovered="diagonal", damping_adaptation_interval=1)
    k.step((x, y))
    ref(x)  # one training-mode forward at the same (pre-step) parameters
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean)


def test_kfac_reduces_a_logistic_regression_loss():
    torch.manual_seed(7)
    x = torch.randn(200, 5)
    y = (x @ torch.randn(5, 3)).argmax(1)
    model = nn.Sequential(nn.Linear(5, 3)).double()
    k = KFAC(Objective(model, "cross_entropy"))
    first = k.step((x, y))["loss"]
    for _ in range(20):
        last = k.step((x, y))["loss"]
    assert last < 0.5 * first


@pytest.mark.parametrize("pause_at", [5, 7])
def test_resume_from_state_dict_continues_the_run_and_drops_stale_inverses(pause_at):
    """A checkpoint keeps the symmetric factors' upper triangles, and no inverses where the next step
    re-inverts (step 5, period 5); resuming from it, or from one that keeps the inverses (step 7),
    continues as the uninterrupted run."""

    def build():
        torch.manual_seed(8)
        model = nn.Sequential(
            nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.Tanh(), nn.ConvTranspose2d(3, 2, 3, 2, 1, 1)
        ).double()
        return model, KFAC(Objective(model, "squared_error"), inverse_update_period=5)

    torch.manual_seed(9)
    batches = [torch.randn(4, 2, 6, 6) for _ in range(10)]
    model, k = build()
    for x in batches:
        k.step((x, x))
    model2, k2 = build()
    for x in batches[:pause_at]:
        k2.step((x, x))
    state = copy.deepcopy(k2.state_dict())
    weights = copy.deepcopy(model2.state_dict())
    assert all(b["A_inv"] is None for b in state["blocks"]) == (pause_at % 5 == 0)
    for b, saved in zip(
        k2.blocks, state["blocks"], strict=True
    ):  # upper triangles of exactly symmetric factors
        assert torch.equal(b.A, b.A.t()) and torch.equal(b.G, b.G.t())
        assert saved["A"].shape == (b.A.shape[0] * (b.A.shape[0] + 1) // 2,)
    model3, k3 = build()
    model3.load_state_dict(weights)
    k3.load_state_dict(state)
    for b2, b3 in zip(k2.blocks, k3.blocks, strict=True):  # the packed factors round-trip exactly
        assert torch.equal(b2.A, b3.A) and torch.equal(b2.G, b3.G)
    for x in batches[pause_at:]:
        k3.step((x, x))
    # Two identical runs in one process can already differ in the last bit (GEMM/convolution
    # kernels depend on buffer alignment), so the trajectories are compared to rounding: an
    # inverse recomputed from later factors would be off by far more.
    for p, q in zip(model.parameters(), model3.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
