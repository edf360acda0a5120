"""FGN and SGN steps against dense float64 solves (Lemma D.1, D.38, closed form = generic)."""

from __future__ import annotations

import logging

import pytest
import torch

from curvopt.curvature.cg import cg
from curvopt.curvature.fgn_ops import fgn_weights, row_space_cg
from curvopt.objective import Objective, flatten
from curvopt.optim.fgn import FGN, build_fgn, find_affine_head
from curvopt.optim.sgn import SGN, build_sgn
from tests.curvature.test_fgn_reference import damped_solve, dense, head, mlp


def _batch(b: int, d_in: int, c: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, d_in, generator=g, dtype=torch.float64), torch.randint(0, c, (b,), generator=g)


def _flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


MODELS = {"mlp": lambda: mlp(3, 4, 5, seed=2), "head": lambda: head(3, 5, seed=3)}


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("implementation", ["generic", "auto"])
def test_fgn_step_equals_dense_damped_solve(kind, implementation):
    """Row-space CG to convergence + back-projection = −(H_FGN + λI)⁻¹ g (Lemma D.1)."""
    model = MODELS[kind]()
    x, y = _batch(6, 3, 5)
    ref = dense(model, x, y)
    lam, lr = 0.3, 0.7
    expected = damped_solve(ref.h_fgn, ref.grad, lam)
    before = _flat_params(model)
    opt = FGN(
        Objective(model, "cross_entropy"),
        lr=lr,
        damping=lam,
        cg_tol=1e-14,
        cg_maxiter=50,
        implementation=implementation,
    )
    stats = opt.step((x, y))
    assert opt.implementation == ("affine" if (kind == "head" and implementation == "auto") else "generic")
    torch.testing.assert_close((_flat_params(model) - before) / lr, expected, rtol=1e-8, atol=1e-10)
    assert stats["cg_residual"] < 1e-12 and stats["cg_breakdown"] == 0
    assert abs(stats["loss"] - torch.nn.functional.softplus(ref.s).mean().item()) < 1e-12
    assert abs(stats["step_norm"] - expected.norm().item()) < 1e-8
    assert abs(stats["xi_mean"] - (1 - (ref.rho**2).sum(1)).mean().item()) < 1e-12


def test_truncated_fgn_residual_identity():
    """(D.38): after a truncated solve, (H_FGN + λI) d + g = −(1/b) J̃ᵀ e with e the row residual."""
    model = mlp(3, 4, 5, seed=4)
    x, y = _batch(7, 3, 5, seed=9)
    ref = dense(model, x, y)
    lam, b = 0.5, x.shape[0]
    sqrt_q, r_tilde = fgn_weights(ref.s)
    jt = sqrt_q[:, None] * ref.js
    k = jt @ jt.T
    u, info = row_space_cg(lambda v: k @ v + b * lam * v, r_tilde, tol=0.0, maxiter=2)
    assert int(info["iters"]) == 2
    d = -jt.T @ u
    e = k @ u + b * lam * u - r_tilde
    lhs = ref.h_fgn @ d + lam * d + ref.grad
    torch.testing.assert_close(lhs, -(jt.T @ e) / b, rtol=1e-10, atol=1e-12)
    assert lhs.norm() > 1e-6  # truncated: a genuine residual
    # and FGN with cg_maxiter=2 takes exactly this d
    before = _flat_params(model)
    FGN(Objective(model, "cross_entropy"), lr=1.0, damping=lam, cg_tol=0.0, cg_maxiter=2).step((x, y))
    torch.testing.assert_close(_flat_params(model) - before, d, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
def test_closed_form_and_generic_fgn_take_the_same_truncated_step(bias):
    torch.manual_seed(0)
    x, y = _batch(16, 8, 11, seed=5)
    steps = {}
    for impl in ("affine", "generic"):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 11, bias=bias).double()
        opt = FGN(Objective(model, "cross_entropy"), lr=0.1, damping=1.0, cg_maxiter=5, implementation=impl)
        before = _flat_params(model)
        stats = [opt.step((x, y)) for _ in range(3)]
        steps[impl] = (_flat_params(model) - before, stats)
    torch.testing.assert_close(steps["affine"][0], steps["generic"][0], rtol=1e-9, atol=1e-12)
    for sa, sg in zip(steps["affine"][1], steps["generic"][1]):
        assert sa["cg_iters"] == sg["cg_iters"]
        for key in ("loss", "cg_residual", "xi_mean", "step_norm", "dropped_trace_mean"):
            assert abs(sa[key] - sg[key]) <= 1e-9 * max(1.0, abs(sg[key])), key


def test_affine_head_detection():
    assert find_affine_head(torch.nn.Linear(3, 4)) is not None
    assert find_affine_head(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3, 4))) is not None
    assert find_affine_head(mlp(3, 4, 5)) is None
    frozen = torch.nn.Linear(3, 4)
    frozen.weight.requires_grad_(False)
    assert find_affine_head(frozen) is None
    with pytest.raises(ValueError, match="linear head"):
        FGN(Objective(mlp(3, 4, 5), "cross_entropy"), implementation="affine")


def test_row_space_cg_matches_scipy_iterates_and_fixed_length_variant():
    import numpy as np
    import scipy.sparse.linalg as sla

    g = torch.Generator().manual_seed(3)
    m = torch.randn(12, 12, generator=g, dtype=torch.float64)
    a = m @ m.T + 0.5 * torch.eye(12, dtype=torch.float64)
    rhs = torch.randn(12, generator=g, dtype=torch.float64)
    for maxiter in (1, 3, 6):
        u, info = row_space_cg(lambda v: a @ v, rhs, tol=0.0, maxiter=maxiter)
        ref, _ = sla.cg(a.numpy(), rhs.numpy(), x0=np.zeros(12), rtol=0.0, atol=0.0, maxiter=maxiter)
        np.testing.assert_allclose(u.numpy(), ref, rtol=1e-8, atol=1e-10)
        assert int(info["iters"]) == maxiter
    u, info = row_space_cg(lambda v: a @ v, rhs, tol=1e-10, maxiter=100)
    torch.testing.assert_close(u, torch.linalg.solve(a, rhs))
    # fixed-length (compile-friendly) loop: same answer, converged iterations are no-ops
    u_fixed, info_fixed = row_space_cg(lambda v: a @ v, rhs, tol=1e-10, maxiter=100, early_exit=False)
    torch.testing.assert_close(u_fixed, u)
    assert int(info_fixed["iters"]) == int(info["iters"]) < 100


def test_row_space_cg_breakdown_ends_the_solve():
    indefinite = torch.diag(torch.tensor([1.0, -1.0], dtype=torch.float64))
    rhs = torch.tensor([1.0, 1.0], dtype=torch.float64)  # pᵀAp = 0 at the first iteration
    u, info = row_space_cg(lambda v: indefinite @ v, rhs, tol=1e-5, maxiter=5)
    assert bool(info["breakdown"]) and int(info["iters"]) == 0
    assert torch.equal(u, torch.zeros(2, dtype=torch.float64))
    for early in (True, False):
        _, info = row_space_cg(
            lambda v: indefinite @ v, torch.tensor([1.0, 0.5], dtype=torch.float64), 1e-12, 5, early
        )
        assert bool(info["breakdown"])


def test_fgn_logs_a_breakdown(caplog, monkeypatch):
    import curvopt.optim.fgn as fgn_module

    def broken_cg(matvec, rhs, tol, maxiter, early_exit):
        return torch.zeros_like(rhs), {
            "iters": torch.tensor(0),
            "rel_residual": torch.tensor(1.0, dtype=rhs.dtype),
            "breakdown": torch.tensor(True),
        }

    monkeypatch.setattr(fgn_module, "row_space_cg", broken_cg)
    model = mlp(3, 4, 5)
    x, y = _batch(4, 3, 5)
    with caplog.at_level(logging.WARNING):
        stats = FGN(Objective(model, "cross_entropy"), implementation="generic").step((x, y))
    assert stats["cg_breakdown"] == 1 and "breakdown" in caplog.text


# -- SGN ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_sgn_ggn_product_equals_dense_ggn(kind):
    model = MODELS[kind]()
    x, y = _batch(5, 3, 5)
    ref = dense(model, x, y)
    obj = Objective(model, "cross_entropy")
    sgn = SGN(obj, damping=0.25)
    params = obj.params()
    _, grad, operator = sgn.ggn_operator(params, x, y)
    g = torch.Generator().manual_seed(11)
    for _ in range(3):  # closures are reused across products
        v = torch.randn(ref.h_ggn.shape[0], generator=g, dtype=torch.float64)
        got = operator(v)
        torch.testing.assert_close(got, ref.h_ggn @ v + 0.25 * v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(flatten(grad), ref.grad, rtol=1e-10, atol=1e-12)


def test_sgn_step_equals_dense_solve_and_warm_start():
    model = mlp(3, 4, 5, seed=6)
    x, y = _batch(6, 3, 5)
    ref = dense(model, x, y)
    lam = 0.4
    expected = damped_solve(ref.h_ggn, ref.grad, lam)
    sgn = SGN(
        Objective(model, "cross_entropy"), lr=0.5, damping=lam, cg_tol=1e-14, cg_maxiter=60, warm_start=True
    )
    before = _flat_params(model)
    stats = sgn.step((x, y))
    torch.testing.assert_close((_flat_params(model) - before) / 0.5, expected, rtol=1e-8, atol=1e-10)
    assert stats["cg_residual"] < 1e-12
    torch.testing.assert_close(sgn.previous, expected, rtol=1e-8, atol=1e-10)
    # the next solve starts from the stored direction: warm-started at the solution, CG has
    # nothing left to do (the SGN step passes x0=previous to curvature.cg)
    a = ref.h_ggn + lam * torch.eye(ref.h_ggn.shape[0], dtype=torch.float64)
    result = cg(lambda v: a @ v, -ref.grad, x0=sgn.previous, tol=1e-8, maxiter=5)
    assert result.iterations == 0 and result.stop_reason == "converged"
    # a second SGN step on the same batch starts from `previous`: its initial residual is that
    # of the old solution at the new parameters, smaller than a cold start's ‖g‖
    cold = SGN(
        Objective(mlp(3, 4, 5, seed=6), "cross_entropy"), lr=0.5, damping=lam, cg_maxiter=1, warm_start=False
    )
    warm = SGN(
        Objective(mlp(3, 4, 5, seed=6), "cross_entropy"), lr=0.5, damping=lam, cg_maxiter=1, warm_start=True
    )
    warm.previous = expected.clone()
    assert warm.step((x, y))["cg_residual"] < cold.step((x, y))["cg_residual"]
    state = sgn.state_dict()
    fresh = SGN(Objective(mlp(3, 4, 5), "cross_entropy"))
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh.previous, sgn.previous)


def test_cg_native_dots_match_float64_dots_and_dense_solve():
    """SGN's CG takes its inner products in the vectors' dtype (JAX/SciPy semantics); on a float32
    system the iterates agree with float64 accumulation, and both approach the dense solve."""
    g = torch.Generator().manual_seed(4)
    m = torch.randn(40, 40, generator=g, dtype=torch.float64)
    a = m @ m.T / 40 + torch.eye(40, dtype=torch.float64)
    rhs = torch.randn(40, generator=g, dtype=torch.float64)
    a32, rhs32 = a.float(), rhs.float()
    native = cg(lambda v: a32 @ v, rhs32, tol=0.0, maxiter=5, dot_dtype=None)
    wide = cg(lambda v: a32 @ v, rhs32, tol=0.0, maxiter=5)
    assert native.iterations == wide.iterations == 5
    torch.testing.assert_close(native.x, wide.x, rtol=1e-5, atol=1e-6)
    exact = cg(lambda v: a @ v, rhs, tol=1e-13, maxiter=200, dot_dtype=None)
    torch.testing.assert_close(exact.x, torch.linalg.solve(a, rhs), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="dot_dtype"):
        cg(lambda v: a @ v, rhs, dot_dtype=torch.float32)
    assert SGN(Objective(head(3, 5), "cross_entropy")).cg_dot_dtype is None
    assert SGN(Objective(head(3, 5), "cross_entropy"), cg_float64_dots=True).cg_dot_dtype == torch.float64


def test_sgn_and_fgn_agree_for_two_classes():
    """C = 2: H_FGN = H_GGN, so converged cold-started SGN and FGN steps coincide."""
    x, y = _batch(8, 3, 2, seed=12)
    deltas = []
    for cls, kwargs in ((FGN, {"implementation": "generic"}), (SGN, {"warm_start": False})):
        model = mlp(3, 4, 2, seed=13)
        before = _flat_params(model)
        cls(
            Objective(model, "cross_entropy"), lr=1.0, damping=0.2, cg_tol=1e-14, cg_maxiter=80, **kwargs
        ).step((x, y))
        deltas.append(_flat_params(model) - before)
    torch.testing.assert_close(deltas[0], deltas[1], rtol=1e-8, atol=1e-10)


# -- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("factory", [build_fgn, build_sgn, lambda o: build_fgn(o, implementation="generic")])
def test_bad_input_raises_before_any_update(factory):
    model = mlp(3, 4, 5)
    opt = factory(Objective(model, "cross_entropy"))
    x, y = _batch(4, 3, 5)
    before = _flat_params(model)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\)"):
        opt.step((x, torch.tensor([0, 1, 5, 2])))
    with pytest.raises(ValueError, match=r"labels must lie"):
        opt.step((x, torch.tensor([0, -1, 2, 2])))
    bad_x = x.clone()
    bad_x[1, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite logits"):
        opt.step((bad_x, y))
    assert torch.equal(_flat_params(model), before)


@pytest.mark.parametrize("factory", [build_fgn, build_sgn])
def test_single_class_model_is_rejected(factory):
    model = torch.nn.Linear(3, 1).double()
    x, _ = _batch(4, 3, 1)
    before = _flat_params(model)
    with pytest.raises(ValueError, match="at least C = 2"):
        factory(Objective(model, "cross_entropy")).step((x, torch.zeros(4, dtype=torch.long)))
    assert torch.equal(_flat_params(model), before)


def test_wrong_loss_kind_is_rejected():
    with pytest.raises(ValueError, match="cross-entropy"):
        FGN(Objective(mlp(3, 4, 5), "squared_error"))
    with pytest.raises(ValueError, match="cross-entropy"):
        SGN(Objective(mlp(3, 4, 5), "squared_error"))


@pytest.mark.slow
def test_compiled_closed_form_step_matches_eager():
    """``compile=True`` (torch.compile of the closed-form solve, fixed-length masked CG loop, the
    way the paper timed JIT-compiled steps) takes the same steps as the eager code. ~1 min of
    Inductor compilation on a CPU, hence slow."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 16, generator=g), torch.randint(0, 7, (32,), generator=g)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Linear(16, 7))
    eager = FGN(Objective(models[0], "cross_entropy"), implementation="affine", cg_early_exit=False)
    compiled = FGN(
        Objective(models[1], "cross_entropy"), implementation="affine", compile=True, cg_early_exit=False
    )
    for _ in range(3):
        se, sc = eager.step((x, y)), compiled.step((x, y))
        assert se["cg_iters"] == sc["cg_iters"] and se["loss"] == pytest.approx(sc["loss"], rel=1e-5)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
