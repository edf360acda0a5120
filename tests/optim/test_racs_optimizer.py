"""RACS (Algorithm 1) against a NumPy float64 reference, its fixed point, limiter, state and inputs."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from curvopt.optim.grouping import build_optimizer
from curvopt.optim.racs import RACS, racs_fixed_point


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one thread is as fast, and MKL's threaded SVD/EVD slows down ~50x when other
    processes share the 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def racs_reference(W0, grads, lr, beta=0.9, alpha=0.05, gamma=1.01, n_iter=5, warm_start=False):
    """Algorithm 1, written from the RACS paper, float64 NumPy. Returns W after each step
    and the limiter factors η."""
    W = W0.copy()
    m, n = W.shape
    s_ema, q_ema, phi = np.zeros(n), np.zeros(m), 0.0
    out, etas = [], []
    for t, G in enumerate(grads, start=1):
        P = G * G
        q = q_ema.copy() if (warm_start and t > 1) else np.ones(m)
        for _ in range(n_iter):
            s = P.T @ q / (q @ q)
            q = P @ s / (s @ s)
        s_ema = beta * s_ema + (1 - beta) * s
        q_ema = beta * q_ema + (1 - beta) * q
        Gt = G / np.sqrt(q_ema)[:, None] / np.sqrt(s_ema)[None, :]
        norm = np.linalg.norm(Gt)
        eta = 1.0 if t == 1 else gamma / max(norm / phi, gamma)
        phi = eta * norm
        W = W - lr * eta * alpha * Gt
        out.append(W.copy())
        etas.append(eta)
    return out, etas


def growing_grads(shape, steps, seed=0, growth=4.0):
    """Three steady steps, then gradients that grow ``growth``× per step (the limiter binds)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) * growth ** max(0, t - 2) for t in range(steps)]


def run_torch(opt_cls, W0, grads, **kw):
    p = torch.nn.Parameter(torch.tensor(W0))
    opt = opt_cls([p], **kw)
    out = []
    for G in grads:
        p.grad = torch.tensor(G)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out, opt, p


@pytest.mark.parametrize("shape", [(6, 9), (9, 6), (7, 7)])
@pytest.mark.parametrize("warm_start", [False, True])
@pytest.mark.parametrize("foreach", [False, True])
def test_racs_matches_numpy_reference(shape, warm_start, foreach):
    W0 = np.random.default_rng(1).standard_normal(shape)
    grads = growing_grads(shape, 5, seed=2)
    ref, etas = racs_reference(W0, grads, lr=0.1, warm_start=warm_start)
    got, _, _ = run_torch(RACS, W0, grads, lr=0.1, warm_start=warm_start, foreach=foreach)
    assert any(e < 1.0 for e in etas), "test data should exercise the limiter"
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_first_step_is_ten_times_sign_for_rank_one_squares():
    """G⊙G rank one ⇒ the fixed point is exact after one iteration (q sᵀ = G⊙G), so with no
    bias correction step 1 is ``λα·G/√(0.1·0.1·G²) = 10·λα·sign(G)``."""
    rng = np.random.default_rng(3)
    a, b = rng.uniform(0.5, 2, 5), rng.uniform(0.5, 2, 8)
    G = np.sqrt(np.outer(a, b)) * rng.choice([-1.0, 1.0], size=(5, 8))
    W0 = np.zeros((5, 8))
    got, _, _ = run_torch(RACS, W0, [G], lr=0.5, alpha=0.2, n_iter=1)
    np.testing.assert_allclose(got[0], -0.5 * 0.2 * 10 * np.sign(G), rtol=1e-12)


def test_fixed_point_rank_one_exact():
    rng = np.random.default_rng(4)
    a, b = rng.uniform(0.1, 3, 6), rng.uniform(0.1, 3, 11)
    P = torch.tensor(np.outer(a, b))
    s, q = racs_fixed_point(P, n_iter=1)
    np.testing.assert_allclose(torch.outer(q, s).numpy(), np.outer(a, b), rtol=1e-12)


def test_fixed_point_is_principal_singular_pair():
    """Prop. 3: s, q → the right/left principal singular vectors of P = E[G⊙G] (up to scale)."""
    rng = np.random.default_rng(5)
    Gs = rng.standard_normal((20, 7, 12))
    P = (Gs * Gs).mean(0)
    s, q = racs_fixed_point(torch.tensor(P), n_iter=200)
    U, S, Vt = np.linalg.svd(P)
    u1, v1 = np.abs(U[:, 0]), np.abs(Vt[0])  # Perron vectors are positive
    np.testing.assert_allclose(q.numpy() / np.linalg.norm(q.numpy()), u1, atol=1e-10)
    np.testing.assert_allclose(s.numpy() / np.linalg.norm(s.numpy()), v1, atol=1e-10)
    # and the scale: q sᵀ is the best rank-one approximation σ₁ u₁ v₁ᵀ
    np.testing.assert_allclose(torch.outer(q, s).numpy(), S[0] * np.outer(u1, v1), rtol=1e-9)


def test_beta_zero_is_no_ema_and_no_limiter_when_disabled():
    shape = (4, 6)
    W0 = np.zeros(shape)
    grads = growing_grads(shape, 3, seed=6)
    ref, _ = racs_reference(W0, grads, lr=1.0, beta=0.0, gamma=1e9)  # γ huge: limiter never binds
    got, _, _ = run_torch(RACS, W0, grads, lr=1.0, beta=0.0, limiter=False)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-10)


def test_zero_gradient_is_finite():
    p = torch.nn.Parameter(torch.ones(3, 4))
    opt = RACS([p], lr=0.1)
    for _ in range(3):
        p.grad = torch.zeros(3, 4)
        opt.step()
    assert torch.isfinite(p).all() and torch.equal(p.detach(), torch.ones(3, 4))


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4), (1, 2, 3, 4)])
def test_non_matrix_parameters_are_rejected(shape):
    with pytest.raises(ValueError, match="2-D"):
        RACS([torch.nn.Parameter(torch.zeros(shape))])


def test_non_matrix_parameters_are_routed_to_adam():
    model = torch.nn.Sequential(
        torch.nn.Conv1d(2, 3, 3),
        torch.nn.Flatten(),
        torch.nn.Linear(9, 5),
        torch.nn.Tanh(),
        torch.nn.Linear(5, 2),
    )
    opt = build_optimizer(model, "racs", lr=0.01)
    method = [p for g in opt.param_groups if not g["adam"] for p in g["params"]]
    adam = [p for g in opt.param_groups if g["adam"] for p in g["params"]]
    assert [tuple(p.shape) for p in method] == [(5, 9)]  # the hidden Linear only; last layer → Adam
    assert any(p.dim() == 3 for p in adam) and all(p.dim() == 2 for p in method)
    x = torch.randn(4, 2, 5)
    model(x).pow(2).sum().backward()
    opt.step()


def test_adam_group_matches_torch_adam():
    w = torch.randn(7, dtype=torch.float64)
    p1, p2 = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    ours = RACS([{"params": [p1], "adam": True}], lr=0.01)
    ref = torch.optim.Adam([p2], lr=0.01, eps=1e-8)
    for i in range(4):
        g = torch.randn(7, dtype=torch.float64) * (i + 1)
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p1, p2, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_gives_identical_steps(dtype):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6, 9).to(dtype))
    opt = RACS([p], lr=0.05)
    grads = [torch.randn(6, 9).to(dtype) * (1 + i) for i in range(6)]
    for g in grads[:3]:
        p.grad = g.clone()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = RACS([q], lr=0.05)
    opt2.load_state_dict(saved)
    assert opt2.state[q]["phi"].dtype == torch.float32 and opt2.state[q]["s"].dtype == dtype
    for g in grads[3:]:
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
        assert torch.equal(p, q)


def test_bf16_step_close_to_fp32_step():
    torch.manual_seed(1)
    W, G = torch.randn(8, 12), torch.randn(8, 12)
    p32, p16 = torch.nn.Parameter(W.clone()), torch.nn.Parameter(W.clone().bfloat16())
    o32, o16 = RACS([p32], lr=0.1), RACS([p16], lr=0.1)
    p32.grad, p16.grad = G.clone(), G.clone().bfloat16()
    o32.step()
    o16.step()
    d32, d16 = p32.detach() - W, p16.detach().float() - W.bfloat16().float()
    assert (torch.linalg.norm(d16 - d32) / torch.linalg.norm(d32)) < 0.05


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": float("nan")},
        {"lr": float("inf")},
        {"lr": -0.02},
        {"eps": -1e-30},
        {"eps": 0.0},
        {"alpha": -0.05},
        {"alpha": float("inf")},
        {"gamma": float("nan")},
        {"beta": float("nan")},
        {"weight_decay": float("nan")},
        {"adam_eps": -1e-8},
    ],
)
def test_bad_hyperparameters_are_rejected(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        RACS([torch.nn.Parameter(torch.zeros(3, 4))], **kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_is_refused_before_any_change(bad):
    """A NaN gradient used to leave RACS with NaN weights; now the step raises NonFiniteError
    naming the parameter and neither the weights nor the state have changed."""
    from curvopt.errors import NonFiniteError

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 9)), torch.nn.Parameter(torch.randn(4, 3))]
    opt = RACS(params, lr=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict())
    for p in params:
        p.grad = torch.randn_like(p)
    params[1].grad[0, 0] = bad
    with pytest.raises(NonFiniteError, match=r"parameter #1 \(shape \(4, 3\)\)"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    after = opt.state_dict()["state"]
    for i, st in after.items():
        for key, value in st.items():
            if torch.is_tensor(value):
                assert torch.equal(value, state["state"][i][key]), (i, key)


# --- foreach (stacked same-shape matrices; the default on CUDA) against the per-matrix loop ---

MIXED_SHAPES = [(6, 9), (6, 9), (9, 6), (6, 9), (7, 7), (9, 6), (5,), (3, 4, 2)]


def _mixed_model(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(dtype)) for s in MIXED_SHAPES
    ]


def _grouped(params, **kw):
    mats = [p for p in params if p.dim() == 2]
    rest = [p for p in params if p.dim() != 2]
    return RACS([{"params": mats}, {"params": rest, "adam": True}], **kw)


def _run_pair(dtype, steps=6, **kw):
    """The same model and gradients through the loop and the foreach path."""
    a, b = _mixed_model(dtype), _mixed_model(dtype)
    oa, ob = _grouped(a, foreach=False, **kw), _grouped(b, foreach=True, **kw)
    g = torch.Generator().manual_seed(1)
    for t in range(steps):
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) * 4.0 ** max(0, t - 2) for p in a]
        for pa, pb, gr in zip(a, b, grads):
            pa.grad, pb.grad = gr.to(dtype), gr.to(dtype)
        oa.step()
        ob.step()
    return a, b, oa, ob


@pytest.mark.parametrize("warm_start", [False, True])
@pytest.mark.parametrize("limiter", [True, False])
def test_foreach_matches_the_loop_float64(warm_start, limiter):
    a, b, oa, ob = _run_pair(torch.float64, warm_start=warm_start, limiter=limiter, weight_decay=0.1)
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pb, pa, rtol=1e-12, atol=1e-14)
    for pa, pb in zip(a, b):
        for key, val in oa.state[pa].items():
            other = ob.state[pb][key]
            if isinstance(val, torch.Tensor):
                assert other.dtype == val.dtype and other.shape == val.shape
                torch.testing.assert_close(other, val, rtol=1e-12, atol=1e-300)
            else:
                assert other == val


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_matches_the_loop_low_precision(dtype):
    """fp32: the batched sums may round differently; bf16: the same, plus one rounding into p."""
    a, b, _, _ = _run_pair(dtype)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for pa, pb in zip(a, b):
        assert pb.dtype == dtype
        torch.testing.assert_close(pb.float(), pa.float(), rtol=tol, atol=tol)


def test_foreach_adam_group_is_the_loops_arithmetic():
    """Element-wise ops only: the foreach Adam group gives the loop's numbers exactly (fp32)."""
    a, b, _, _ = _run_pair(torch.float32)
    for pa, pb in zip(a, b):
        if pa.dim() != 2:
            assert torch.equal(pa, pb)


def test_foreach_chunks_agree_with_one_chunk(monkeypatch):
    """Buckets larger than FOREACH_CHUNK_NUMEL are split; chunk sizes do not change the step."""
    import curvopt.optim.matrix as racs_mod

    _, one, _, _ = _run_pair(torch.float64)
    monkeypatch.setattr(racs_mod, "FOREACH_CHUNK_NUMEL", 60)  # one 6x9 matrix per chunk
    _, split, _, _ = _run_pair(torch.float64)
    for p1, p2 in zip(one, split):
        torch.testing.assert_close(p2, p1, rtol=1e-13, atol=1e-15)


def test_foreach_state_dict_round_trip_and_switch():
    """A foreach run's state loads into a loop optimizer (and back): the state layout is the same."""
    a, b, oa, ob = _run_pair(torch.float64, steps=3)
    saved = copy.deepcopy(ob.state_dict())
    c = [torch.nn.Parameter(p.detach().clone()) for p in b]
    oc = _grouped(c, foreach=False)
    oc.load_state_dict(saved)
    assert oc.param_groups[0]["foreach"] is True  # the saved group's setting comes back
    oc.param_groups[0]["foreach"] = oc.param_groups[1]["foreach"] = False
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in b]
    for pb, pc, gr in zip(b, c, grads):
        pb.grad, pc.grad = gr.clone(), gr.clone()
    ob.step()
    oc.step()
    for pb, pc in zip(b, c):
        torch.testing.assert_close(pc, pb, rtol=1e-12, atol=1e-14)


def test_foreach_defaults_to_the_loop_on_cpu_and_rejects_bad_values():
    p = torch.nn.Parameter(torch.zeros(3, 4))
    opt = RACS([p])
    assert opt.param_groups[0]["foreach"] is None and not opt._use_foreach(opt.param_groups[0], [p])
    with pytest.raises(ValueError, match="foreach"):
        RACS([p], foreach="yes")


def test_batched_fixed_point_solves_each_matrix():
    torch.manual_seed(0)
    P = torch.rand(4, 6, 9, dtype=torch.float64)
    q0 = torch.rand(4, 6, dtype=torch.float64)
    for start in (None, q0):
        s, q = racs_fixed_point(P, 5, start)
        for i in range(4):
            si, qi = racs_fixed_point(P[i], 5, None if start is None else q0[i])
            torch.testing.assert_close(s[i], si, rtol=1e-13, atol=0)
            torch.testing.assert_close(q[i], qi, rtol=1e-13, atol=0)
