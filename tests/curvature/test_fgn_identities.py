"""FGN's exact identities (paper §2-3, Prop. 3.2) against dense float64 references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from curvopt.curvature.fgn_ops import (
    affine_gram,
    competitor_distribution,
    dispersion,
    fgn_weights,
    margin_logit_gradient,
    true_vs_rest_margin,
)
from tests.curvature.test_fgn_reference import dense, head, mlp


def _batch(b: int, d_in: int, c: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, d_in, generator=g, dtype=torch.float64), torch.randint(0, c, (b,), generator=g)


MODELS = {
    "mlp": lambda c: mlp(3, 4, c, seed=2),
    "head": lambda c: head(3, c, seed=3),
}


def test_cross_entropy_is_softplus_of_margin_including_extreme_logits():
    z = torch.tensor([[0.1, -2.0, 3.0], [300.0, -300.0, 0.0], [-500.0, 400.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([2, 1, 0])
    s = true_vs_rest_margin(z, y)
    ce = F.cross_entropy(z, y, reduction="none")
    torch.testing.assert_close(F.softplus(s), ce, rtol=1e-12, atol=1e-12)
    # hand-worked: s = log(e^{0.1} + e^{-2}) - 3
    assert abs(float(s[0]) - (torch.logaddexp(torch.tensor(0.1), torch.tensor(-2.0)) - 3.0).item()) < 1e-6
    z32 = z.float()
    torch.testing.assert_close(
        F.softplus(true_vs_rest_margin(z32, y)), F.cross_entropy(z32, y, reduction="none")
    )


def test_margin_gradient_and_competitor_distribution_match_autograd():
    z = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 5, 2, 2, 3])
    (g,) = torch.autograd.grad(true_vs_rest_margin(z, y).sum(), z)
    a = margin_logit_gradient(z.detach(), y)
    torch.testing.assert_close(a, g)
    rho = competitor_distribution(z.detach(), y)
    assert torch.all(rho[torch.arange(5), y] == 0)
    torch.testing.assert_close(rho.sum(1), torch.ones(5, dtype=torch.float64))
    # (2.8): p_† ∇_z s = p − y
    p = torch.softmax(z.detach(), 1)
    p_dag = 1 - p[torch.arange(5), y]
    torch.testing.assert_close(p_dag[:, None] * a, p - F.one_hot(y, 6).double())


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("c", [2, 5])
def test_gradient_identity(kind, c):
    model = MODELS[kind](c)
    x, y = _batch(4, 3, c)
    ref = dense(model, x, y)
    p_dag = torch.sigmoid(ref.s)
    g_margin = (p_dag[:, None] * ref.js).sum(0) / x.shape[0]  # (1/b) Jᵀ r
    loss = F.cross_entropy(model(x), y)
    g_auto = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, list(model.parameters()))])
    torch.testing.assert_close(g_margin, g_auto, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ref.grad, g_auto, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_ggn_splits_into_fgn_plus_residual_and_gap_formula(kind):
    model = MODELS[kind](5)
    x, y = _batch(4, 3, 5)
    ref = dense(model, x, y)
    torch.testing.assert_close(ref.h_ggn, ref.h_fgn + ref.r_comp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ref.r_comp, ref.gap, rtol=1e-10, atol=1e-12)
    # 0 ⪯ H_FGN ⪯ H_GGN
    assert torch.linalg.eigvalsh(ref.h_fgn).min() > -1e-12
    assert torch.linalg.eigvalsh(ref.h_ggn - ref.h_fgn).min() > -1e-12
    # and the residual is not trivially zero here (C = 5, spread-out ρ)
    assert torch.linalg.matrix_norm(ref.r_comp) > 1e-3


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_fgn_equals_ggn_for_two_classes(kind):
    model = MODELS[kind](2)
    x, y = _batch(6, 3, 2)
    ref = dense(model, x, y)
    torch.testing.assert_close(ref.h_fgn, ref.h_ggn, rtol=1e-10, atol=1e-12)


def test_output_space_decomposition_and_trace():
    """(3.3): diag(p) − ppᵀ = p_*p_† aaᵀ + p_† [0 ⊕ (diag ρ − ρρᵀ)], traces (C.11)."""
    g = torch.Generator().manual_seed(4)
    for c in (2, 3, 7):
        z = torch.randn(1, c, generator=g, dtype=torch.float64) * 2
        y = torch.tensor([c - 1])
        p = torch.softmax(z, 1)[0]
        a = margin_logit_gradient(z, y)[0]
        rho = competitor_distribution(z, y)[0]
        p_star, p_dag = p[y].item(), 1 - p[y].item()
        full = torch.diag(p) - torch.outer(p, p)
        kept = p_star * p_dag * torch.outer(a, a)
        dropped = p_dag * (torch.diag(rho) - torch.outer(rho, rho))
        torch.testing.assert_close(full, kept + dropped, rtol=1e-12, atol=1e-14)
        xi = dispersion(rho).item()
        assert abs(torch.trace(dropped).item() - p_dag * xi) < 1e-12
        assert abs(torch.trace(kept).item() - p_star * p_dag * (2 - xi)) < 1e-12
        assert 0 <= xi <= 1 - 1 / (c - 1) + 1e-12 if c > 2 else abs(xi) < 1e-12


def test_dispersion_bounds():
    c = 9
    one_hot = torch.zeros(c - 1, dtype=torch.float64)
    one_hot[3] = 1
    uniform = torch.full((c - 1,), 1 / (c - 1), dtype=torch.float64)
    assert dispersion(one_hot).item() == 0
    assert abs(dispersion(uniform).item() - (1 - 1 / (c - 1))) < 1e-15
    rand = torch.softmax(torch.randn(100, c - 1, dtype=torch.float64), 1)
    xi = dispersion(rand)
    assert torch.all(xi >= 0) and torch.all(xi <= 1 - 1 / (c - 1) + 1e-15)


def test_weights_are_stable_and_exact():
    s = torch.tensor([-300.0, -30.0, -1.0, 0.0, 2.5, 40.0, 300.0])
    sqrt_q, r_tilde = fgn_weights(s)
    assert torch.isfinite(sqrt_q).all() and torch.isfinite(r_tilde).all()
    # √q · r̃ = p_† = sigmoid(s) exactly (also beyond the clamp at ±80 for large positive s)
    torch.testing.assert_close(
        sqrt_q * r_tilde, torch.sigmoid(s).clamp_min(torch.sigmoid(torch.tensor(-80.0)))
    )
    s64 = torch.tensor([-3.0, 0.0, 1.5, 20.0], dtype=torch.float64)
    sq, rt = fgn_weights(s64)
    p_star, p_dag = torch.sigmoid(-s64), torch.sigmoid(s64)
    torch.testing.assert_close(sq, torch.sqrt(p_star * p_dag), rtol=1e-12, atol=0)
    torch.testing.assert_close(rt, torch.sqrt(p_dag / p_star), rtol=1e-12, atol=0)


def test_affine_gram_equals_dense_jacobian_gram():
    model = head(4, 6, seed=5)
    x, y = _batch(5, 4, 6)
    ref = dense(model, x, y)
    with torch.no_grad():
        a = margin_logit_gradient(model(x), y)
    # model parameters are ordered (weight, bias): JJᵀ in that order
    torch.testing.assert_close(affine_gram(x, a), ref.js @ ref.js.T, rtol=1e-10, atol=1e-12)
    sq = torch.sqrt(ref.q)
    torch.testing.assert_close(affine_gram(x, a, sq), (sq[:, None] * ref.js) @ (sq[:, None] * ref.js).T)
    # the symmetric blocked evaluation gives the same matrix (uneven blocks included)
    for blocks in (2, 3):
        torch.testing.assert_close(
            affine_gram(x, a, sq, blocks=blocks), affine_gram(x, a, sq), rtol=1e-12, atol=1e-14
        )
    # without a bias the "+1" disappears
    nob = torch.nn.Linear(4, 6, bias=False).double()
    ref_nb = dense(nob, x, y)
    with torch.no_grad():
        a_nb = margin_logit_gradient(nob(x), y)
    torch.testing.assert_close(affine_gram(x, a_nb, bias=False), ref_nb.js @ ref_nb.js.T)


def test_fused_margin_terms_match_the_separate_definitions():
    from curvopt.curvature.fgn_ops import dispersion_from_gradient, margin_terms

    z = torch.randn(6, 7, dtype=torch.float64) * 3
    z[0, 2] = 400.0  # extreme logits stay finite
    y = torch.tensor([2, 0, 6, 3, 3, 1])
    z_copy = z.clone()
    s, a = margin_terms(z_copy, y)
    assert torch.equal(z_copy, z)  # not in place by default
    torch.testing.assert_close(s, true_vs_rest_margin(z, y))
    s2, a2 = margin_terms(z_copy, y, inplace=True)
    assert a2.data_ptr() == z_copy.data_ptr() and torch.equal(a2, a) and torch.equal(s2, s)
    torch.testing.assert_close(a, margin_logit_gradient(z, y))
    torch.testing.assert_close(dispersion_from_gradient(a), dispersion(competitor_distribution(z, y)))
