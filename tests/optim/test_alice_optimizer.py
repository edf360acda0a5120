"""Alice / Alice-0 (Algorithms 2-4, 10) against a NumPy float64 reference, switch and
compensation properties, degenerate shapes, state_dict round trips and bad input."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from curvopt.optim.alice import Alice, alice0
from curvopt.optim.alice_basis import (
    SEED_STRIDE,
    compensation_explicit,
    sample_indices,
    switch_basis,
    switch_generator,
)

# ----------------------------------------------------------------------------- NumPy reference


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one thread is as fast, and MKL's threaded SVD/EVD slows down ~50x when other
    processes share the 2 cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def np_canonical(U):
    idx = np.abs(U).argmax(axis=0)
    sign = np.sign(U[idx, np.arange(U.shape[1])])
    sign[sign == 0] = 1
    return U * sign


def np_top_eig(A, k):
    w, V = np.linalg.eigh(0.5 * (A + A.T))
    order = np.argsort(-w)[:k]
    return np_canonical(V[:, order])


def np_subspace_iteration(matvec, U0):
    Q, _ = np.linalg.qr(matvec(U0))
    V = Q.T @ matvec(Q)
    w, E = np.linalg.eigh(0.5 * (V + V.T))
    return np_canonical(Q @ E[:, np.argsort(-w)])


def np_switch(Up, r, lead, idx):
    m = Up.shape[0]
    if r >= m:
        return Up
    Qf, _ = np.linalg.qr(Up, mode="complete")
    Uc = Qf[:, r:]
    k = min(r - lead, m - r)
    return np.hstack([Up[:, : r - k], Uc[:, idx]])


def alice_reference(
    W0,
    grads,
    lr,
    alpha=0.3,
    alpha_c=0.4,
    betas=(0.9, 0.9, 0.999),
    rank=4,
    lead=2,
    K=3,
    gamma=1.01,
    eps=1e-8,
    seed=0,
):
    """Algorithm 4 (+ Alg. 2, 3, 10) from the paper with the spec's decisions (§10.9-18):
    exact EVD at t = 1, Rayleigh-Ritz lift, Q̃ re-projected at a switch, ε in ω and 1/√p, U on the
    smaller side. Float64 NumPy; only the complement draw uses the optimizer's seeded indices."""
    b1, b2, b3 = betas
    W = W0.copy()
    transposed = W.shape[0] > W.shape[1]
    m, n = (W.shape[1], W.shape[0]) if transposed else W.shape
    r = min(rank, m)
    lead = min(lead, r)
    U = np.zeros((m, r))
    Qt, m1, v, p, phi = np.zeros((r, r)), np.zeros((r, n)), np.zeros((r, n)), np.zeros(n), 0.0
    pseed, n_switch = seed * SEED_STRIDE + 0, 0
    out, switches = [], []
    for t, Graw in enumerate(grads, start=1):
        G = Graw.T if transposed else Graw
        if t == 1 or t % K == 0:
            if t == 1:
                Up = np_top_eig((1 - b3) * G @ G.T, r)
            else:
                U0 = U

                def matvec(X, U0=U0, G=G, Qt=Qt):
                    return (1 - b3) * G @ (G.T @ X) + b3 * U0 @ (Qt @ (U0.T @ X))

                Up = np_subspace_iteration(matvec, U0)
            k = min(r - lead, m - r)
            idx = sample_indices(switch_generator(pseed, n_switch), m - r, k).numpy() if m > r else []
            n_switch += 1
            Unew = np_switch(Up, r, lead, idx)
            if t > 1:
                R = Unew.T @ U
                Qt = R @ Qt @ R.T
            U = Unew
            switches.append((t, Up, U))
        sigma = U.T @ G
        Qt = b3 * Qt + (1 - b3) * sigma @ sigma.T
        m1 = b1 * m1 + (1 - b1) * sigma
        v = b2 * v + (1 - b2) * sigma**2
        omega = m1 / (np.sqrt(v) + eps)
        upd = U @ omega
        if m > r:
            p = b1 * p + (1 - b1) * np.maximum((G**2).sum(0) - (sigma**2).sum(0), 0)
            C = math.sqrt(m - r) * (G - U @ sigma) / (np.sqrt(p) + eps)[None, :]
            cn = np.linalg.norm(C)
            eta = 1.0 if phi == 0 else gamma / max(cn / phi, gamma)
            phi = eta * cn
            upd = upd + alpha_c * eta * C
        W = W - lr * alpha * (upd.T if transposed else upd)
        out.append(W.copy())
    return out, switches


def make_grads(shape, steps, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(shape)
    # correlated over time (a shared component), growing so the limiter is exercised
    return [(base + 0.5 * rng.standard_normal(shape)) * (1.5 ** max(0, t - 2)) for t in range(steps)]


def run_alice(W0, grads, **kw):
    p = torch.nn.Parameter(torch.tensor(W0))
    opt = Alice([p], **kw)
    out = []
    for G in grads:
        p.grad = torch.tensor(G)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out, opt, p


SHAPES = {
    "wide_m_gt_r": ((8, 14), 4, 2),
    "tall_transposed": ((14, 8), 4, 2),
    "square": ((9, 9), 3, 1),
    "m_lt_r_full_rank": ((5, 12), 8, 2),
    "few_complement_dirs": ((8, 20), 6, 1),  # m − r = 2 < r − l = 5
}


@pytest.mark.parametrize("case", sorted(SHAPES))
@pytest.mark.parametrize("beta3", [0.999, 0.0], ids=["alice", "alice0"])
@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
def test_alice_matches_numpy_reference(case, beta3, foreach):
    """Steps 1 (EVD + switch), 2 (plain), 3 (refresh: subspace iteration + switch), 4, 5, 6
    (refresh) with K = 3, against the float64 reference."""
    shape, rank, lead = SHAPES[case]
    W0 = np.random.default_rng(1).standard_normal(shape)
    grads = make_grads(shape, 6, seed=2)
    betas = (0.9, 0.9, beta3)
    ref, _ = alice_reference(W0, grads, lr=0.05, betas=betas, rank=rank, lead=lead, K=3)
    got, opt, p = run_alice(
        W0,
        grads,
        lr=0.05,
        betas=betas,
        rank=rank,
        leading=lead,
        update_interval=3,
        clamp_rank=rank > min(shape),
        foreach=foreach,
    )
    for t, (a, b) in enumerate(zip(got, ref), start=1):
        # eigenvectors of nearby matrices amplify rounding, so ~1e-10 absolute differences are
        # expected; an algorithmic slip shows up at 1e-3 or more
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8, err_msg=f"step {t}")
    assert ("Qt" in opt.state[p]) == (beta3 > 0)


def test_alice0_factory_sets_beta3_zero():
    p = torch.nn.Parameter(torch.randn(4, 6))
    opt = alice0([p], betas=(0.9, 0.9, 0.999), rank=2)
    assert opt.param_groups[0]["betas"] == (0.9, 0.9, 0.0)


def test_explicit_and_fused_compensation_agree():
    shape = (10, 16)
    W0 = np.random.default_rng(3).standard_normal(shape)
    grads = make_grads(shape, 5, seed=4)
    a, _, _ = run_alice(W0, grads, lr=0.1, rank=3, leading=1, update_interval=2, fused_compensation=True)
    b, _, _ = run_alice(W0, grads, lr=0.1, rank=3, leading=1, update_interval=2, fused_compensation=False)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12)


def test_compensation_is_column_scaled_residual():
    rng = np.random.default_rng(5)
    m, n, r = 7, 11, 3
    G = rng.standard_normal((m, n))
    U = np.linalg.qr(rng.standard_normal((m, r)))[0]
    p = rng.uniform(0.5, 2.0, n)
    C = compensation_explicit(torch.tensor(G), torch.tensor(U), torch.tensor(p), eps=0.0).numpy()
    expected = np.sqrt(m - r) * (np.eye(m) - U @ U.T) @ G @ np.diag(1 / np.sqrt(p))
    np.testing.assert_allclose(C, expected, rtol=1e-12)
    # and it is orthogonal to span(U): the compensation only acts on the discarded directions
    np.testing.assert_allclose(U.T @ C, 0, atol=1e-12)


def test_optimal_compensation_p_is_ema_of_residual_column_norms():
    """Alg. 3 line 1 with β = β1: p tracks ‖g_j‖² − ‖Uᵀg_j‖² (the residual's squared column norms)."""
    shape = (6, 10)
    W0 = np.zeros(shape)
    grads = make_grads(shape, 3, seed=6)
    _, opt, prm = run_alice(W0, grads[:1], lr=0.0, rank=2, leading=1, update_interval=100)
    U = opt.state[prm]["U"].numpy()
    G = grads[0]
    res = G - U @ (U.T @ G)
    np.testing.assert_allclose(opt.state[prm]["p"].numpy(), 0.1 * (res**2).sum(0), rtol=1e-10)


def test_switch_keeps_leading_columns_and_is_orthonormal():
    rng = np.random.default_rng(7)
    m, r, lead = 12, 5, 2
    Up = torch.linalg.qr(torch.tensor(rng.standard_normal((m, r))))[0]
    U = switch_basis(Up, r, lead, switch_generator(3, 0), "complement")
    torch.testing.assert_close(U[:, :lead], Up[:, :lead], rtol=0, atol=0)
    torch.testing.assert_close(U.T @ U, torch.eye(r, dtype=U.dtype), atol=1e-12, rtol=0)
    # the r − l new directions are orthogonal to ALL of the new leading basis (complement of U')
    torch.testing.assert_close(
        Up.T @ U[:, lead:], torch.zeros(r, r - lead, dtype=U.dtype), atol=1e-12, rtol=0
    )
    # different switches draw different directions, the same (seed, count) the same ones
    U_again = switch_basis(Up, r, lead, switch_generator(3, 0), "complement")
    U_next = switch_basis(Up, r, lead, switch_generator(3, 1), "complement")
    assert torch.equal(U, U_again) and not torch.allclose(U, U_next)


def test_optimizer_u_stays_orthonormal_across_switches():
    shape = (10, 13)
    W0 = np.random.default_rng(8).standard_normal(shape)
    grads = make_grads(shape, 7, seed=9)
    lead = 2
    _, switches = alice_reference(W0, grads, lr=0.05, rank=4, lead=lead, K=3)
    p = torch.nn.Parameter(torch.tensor(W0))
    opt = Alice([p], lr=0.05, rank=4, leading=lead, update_interval=3)
    seen = 0
    for t, G in enumerate(grads, start=1):
        p.grad = torch.tensor(G)
        opt.step()
        U = opt.state[p]["U"]
        torch.testing.assert_close(U.T @ U, torch.eye(4, dtype=U.dtype), atol=1e-12, rtol=0)
        for ts, Up, _ in switches:
            if ts == t:  # l leading columns of the new Rayleigh-Ritz basis are kept
                np.testing.assert_allclose(U[:, :lead].numpy(), Up[:, :lead], atol=1e-7)
                seen += 1
    assert seen == 3  # t = 1, 3, 6


@pytest.mark.parametrize("mode", ["none", "gaussian", "gaussian_mix", "full_basis"])
def test_switch_ablation_modes(mode):
    rng = np.random.default_rng(10)
    m, r, lead = 10, 4, 2
    Up = torch.linalg.qr(torch.tensor(rng.standard_normal((m, r))))[0]
    U = switch_basis(Up, r, lead, switch_generator(0, 0), mode)
    assert U.shape == (m, r)
    norms = torch.linalg.vector_norm(U, dim=0)
    torch.testing.assert_close(norms, torch.ones(r, dtype=U.dtype))
    if mode == "none":
        assert torch.equal(U, Up)
    if mode in ("gaussian_mix", "full_basis"):
        assert torch.equal(U[:, :lead], Up[:, :lead])
    if mode == "full_basis":  # orthonormal, and the new ones are orthogonal to the kept ones
        torch.testing.assert_close(U.T @ U, torch.eye(r, dtype=U.dtype), atol=1e-12, rtol=0)


@pytest.mark.parametrize("compensation", ["none", "fira", "fira_plus"])
@pytest.mark.parametrize("switch", ["complement", "gaussian"])
def test_ablation_variants_run_and_differ(compensation, switch):
    shape = (8, 12)
    W0 = np.random.default_rng(11).standard_normal(shape)
    grads = make_grads(shape, 4, seed=12)
    got, _, _ = run_alice(
        W0, grads, lr=0.05, rank=3, leading=1, update_interval=2, compensation=compensation, switch=switch
    )
    base, _, _ = run_alice(W0, grads, lr=0.05, rank=3, leading=1, update_interval=2)
    assert np.isfinite(got[-1]).all()
    assert not np.allclose(got[-1], base[-1])


def test_no_compensation_no_switch_is_low_rank_eigen_adam():
    """With compensation off the update lies in span(U) (the GaLore-like part of Alice)."""
    shape = (9, 12)
    W0 = np.zeros(shape)
    grads = make_grads(shape, 1, seed=13)
    got, opt, p = run_alice(W0, grads, lr=1.0, alpha=1.0, rank=3, compensation="none", switch="none")
    U = opt.state[p]["U"].numpy()
    step = got[0]
    np.testing.assert_allclose((np.eye(9) - U @ U.T) @ step, 0, atol=1e-12)
    # first step: ω = 0.1σ/(√(0.1σ²) + ε) ≈ √0.1·sign(σ)
    sigma = U.T @ grads[0]
    np.testing.assert_allclose(
        step, -U @ (0.1 * sigma / (np.sqrt(0.1 * sigma**2) + 1e-8)), rtol=1e-9, atol=1e-12
    )


def test_rank_above_a_weight_or_leading_above_rank_is_refused():
    p = torch.nn.Parameter(torch.randn(4, 7))
    with pytest.raises(
        ValueError, match=r"rank=50 exceeds the projected side \(4\) of a weight of shape \(4, 7\)"
    ):
        Alice([p], rank=50)
    with pytest.raises(ValueError, match="leading=3 exceeds rank=2"):
        Alice([p], rank=2, leading=3)
    assert Alice([p], rank=2).param_groups[0]["leading"] == 2  # the default 40, capped at the rank


def test_full_rank_when_rank_exceeds_dims():
    p = torch.nn.Parameter(torch.randn(4, 7, dtype=torch.float64))
    opt = Alice([p], lr=0.1, rank=50, leading=40, update_interval=2, clamp_rank=True)
    for _ in range(3):
        p.grad = torch.randn(4, 7, dtype=torch.float64)
        opt.step()
    U = opt.state[p]["U"]
    assert U.shape == (4, 4)
    torch.testing.assert_close(U.T @ U, torch.eye(4, dtype=U.dtype), atol=1e-12, rtol=0)


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4)])
def test_non_matrix_parameters_are_rejected(shape):
    with pytest.raises(ValueError, match="2-D"):
        Alice([torch.nn.Parameter(torch.zeros(shape))])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"switch": "nope"},
        {"compensation": "nope"},
        {"betas": (0.9, 0.9)},
        {"rank": 0},
        {"update_interval": 0},
        {"lr": float("nan")},
        {"lr": float("inf")},
        {"lr": -0.1},
        {"eps": -1e-8},
        {"eps": float("nan")},
        {"alpha": -0.3},
        {"alpha": float("nan")},
        {"alpha_c": -0.4},
        {"gamma": float("nan")},
        {"weight_decay": -0.1},
    ],
)
def test_bad_hyperparameters_are_rejected(kwargs):
    with pytest.raises(ValueError):
        Alice([torch.nn.Parameter(torch.zeros(3, 4))], **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta3", [0.999, 0.0])
def test_state_dict_round_trip_gives_identical_steps(dtype, beta3):
    """Save after 3 steps, load into a fresh optimizer, continue through a refresh (t = 4):
    the same switch directions are drawn and every parameter is bitwise equal."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in [(8, 12), (12, 8), (5,)]]
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "adam": True}]  # noqa: E731
    kw = dict(lr=0.05, rank=3, leading=1, update_interval=4, betas=(0.9, 0.9, beta3))
    opt = Alice(groups(params), **kw)
    grads = [[torch.randn(p.shape).to(dtype) for p in params] for _ in range(7)]
    for gs in grads[:3]:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = Alice(groups(clones), **kw)
    opt2.load_state_dict(saved)
    if beta3 > 0:
        assert opt2.state[clones[0]]["Qt"].dtype == torch.float32
    assert opt2.state[clones[0]]["U"].dtype == dtype
    for gs in grads[3:]:
        for p, q, g in zip(params, clones, gs):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
        for p, q in zip(params, clones):
            assert torch.equal(p, q)
    assert opt.state[params[0]]["n_switch"] == 2


def test_bf16_parameters_follow_fp32_run():
    torch.manual_seed(2)
    W = 0.01 * torch.randn(16, 24)  # small weights: bf16 rounding of W + ΔW stays below ΔW
    grads = [torch.randn(16, 24) for _ in range(3)]
    p32, p16 = torch.nn.Parameter(W.clone()), torch.nn.Parameter(W.clone().bfloat16())
    o32 = Alice([p32], lr=0.05, rank=4, leading=2, update_interval=2)
    o16 = Alice([p16], lr=0.05, rank=4, leading=2, update_interval=2)
    for g in grads:
        p32.grad, p16.grad = g.clone(), g.clone().bfloat16()
        o32.step()
        o16.step()
    d32, d16 = p32.detach() - W, p16.detach().float() - W
    assert torch.linalg.norm(d16 - d32) / torch.linalg.norm(d32) < 0.05
    assert o16.state[p16]["exp_avg"].dtype == torch.bfloat16 and o16.state[p16]["Qt"].dtype == torch.float32


def test_state_numel_matches_allocated_state():
    for shape, rank in [((8, 12), 3), ((12, 8), 3), ((5, 9), 7)]:
        for beta3 in (0.999, 0.0):
            p = torch.nn.Parameter(torch.randn(shape))
            opt = Alice([p], rank=rank, betas=(0.9, 0.9, beta3), clamp_rank=True)
            p.grad = torch.randn(shape)
            opt.step()
            expected = Alice.state_numel(shape, rank=rank, betas=(0.9, 0.9, beta3))
            got = {k: v.numel() for k, v in opt.state[p].items() if torch.is_tensor(v)}
            assert got == expected


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_is_refused_before_any_change(bad):
    """A NaN/inf gradient used to reach eigh (a raw LinAlgError) or the weights; now the step
    raises NonFiniteError naming the parameter, and nothing (weights, state) has changed."""
    from curvopt.errors import NonFiniteError

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 12)), torch.nn.Parameter(torch.randn(5))]
    opt = Alice([{"params": params[:1]}, {"params": params[1:], "adam": True}], rank=3, leading=1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict())
    params[0].grad = torch.randn_like(params[0])
    params[1].grad = torch.randn_like(params[1])
    params[1].grad[2] = bad
    with pytest.raises(NonFiniteError, match=r"parameter #1 \(shape \(5,\)\) holds NaN or inf"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    after = opt.state_dict()["state"]
    assert all(
        torch.equal(state["state"][i][k], after[i][k])
        for i in after
        for k in after[i]
        if torch.is_tensor(after[i][k])
    )


# --- foreach (plain steps of same-shape matrices stacked; the default on CUDA) against the loop ---

FOREACH_SHAPES = [(8, 14), (8, 14), (14, 8), (8, 14), (14, 8), (9, 9), (5, 12)]


def _foreach_pair(dtype, steps=7, **kw):
    g = torch.Generator().manual_seed(0)
    w0 = [torch.randn(s, generator=g, dtype=torch.float64) for s in FOREACH_SHAPES]
    a = [torch.nn.Parameter(w.clone().to(dtype)) for w in w0]
    b = [torch.nn.Parameter(w.clone().to(dtype)) for w in w0]
    opts = dict(lr=0.05, rank=4, leading=2, update_interval=3, clamp_rank=True, **kw)
    oa, ob = Alice(a, foreach=False, **opts), Alice(b, foreach=True, **opts)
    for t in range(steps):
        grads = [
            torch.randn(s, generator=g, dtype=torch.float64) * 1.5 ** max(0, t - 2) for s in FOREACH_SHAPES
        ]
        for pa, pb, gr in zip(a, b, grads):
            pa.grad, pb.grad = gr.to(dtype), gr.to(dtype)
        oa.step()
        ob.step()
    return a, b, oa, ob


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"betas": (0.9, 0.9, 0.0)},
        {"compensation": "none"},
        {"bias_correction": True, "weight_decay": 0.1},
        {"moments_on_switch": "reset", "reproject_qtilde": False},
        {"switch": "none", "subspace_steps": 2},
    ],
    ids=["alice", "alice0", "no_compensation", "bias_correction_wd", "reset_no_reproject", "switch_none"],
)
def test_foreach_matches_the_loop_float64(kw):
    """K = 3: step 1 is the EVD start (looped), 3 and 6 refreshes and 2, 4, 5, 7 plain steps (both
    stacked, k = 3 and 2 per shape)."""
    a, b, oa, ob = _foreach_pair(torch.float64, **kw)
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pb, pa, rtol=1e-10, atol=1e-12)
        for key, val in oa.state[pa].items():
            other = ob.state[pb][key]
            if isinstance(val, torch.Tensor):
                assert other.dtype == val.dtype
                torch.testing.assert_close(other, val, rtol=1e-10, atol=1e-12)
            else:
                assert other == val, key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_matches_the_loop_low_precision(dtype):
    a, b, _, _ = _foreach_pair(dtype)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
    for pa, pb in zip(a, b):
        assert pb.dtype == dtype
        torch.testing.assert_close(pb.float(), pa.float(), rtol=tol, atol=tol)


def test_foreach_loops_the_ablations_it_does_not_batch():
    """Fira-style compensation has no stacked form: the foreach setting gives the loop's numbers exactly."""
    a, b, _, _ = _foreach_pair(torch.float64, compensation="fira")
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)


def test_foreach_chunks_agree_with_one_chunk(monkeypatch):
    import curvopt.optim.matrix as racs_mod  # the chunking helper Alice shares with RACS

    _, one, _, _ = _foreach_pair(torch.float64)
    monkeypatch.setattr(racs_mod, "FOREACH_CHUNK_NUMEL", 120)  # one 8x14 matrix per chunk
    _, split, _, _ = _foreach_pair(torch.float64)
    for p1, p2 in zip(one, split):
        torch.testing.assert_close(p2, p1, rtol=1e-12, atol=1e-14)
