"""FOSI (curvopt.optim.fosi): equality with the base optimizer before the first ESE, Lemma 1, a
step-by-step reference implementation of the paper's Algorithm 1 and update rule, schedule, state_dict, failures, configs."""

from __future__ import annotations

import copy
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from curvopt.curvature.lanczos import LanczosError, NonSymmetricOperatorError
from curvopt.objective import Objective, mean_loss
from curvopt.optim.fosi import FOSI, fosi_adam, fosi_gd, fosi_heavy_ball
from curvopt.optim.fosi_adapter import build_fosi
from curvopt.training.build import build_algorithm, build_data, build_model
from tests.conftest import compose

F64 = torch.float64


def _quadratic(n: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64))
    lam = torch.logspace(1, -2, n, dtype=F64)
    H = (Q * lam) @ Q.T
    return H, Q, lam, torch.randn(n, generator=gen, dtype=F64)


def _quad_loss(H):
    return lambda ps, batch: 0.5 * ps[0] @ H @ ps[0]


def _mlp_problem(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    return model, x, y


def _ce(out, y):
    return mean_loss(out, y, "cross_entropy")


BASES = {
    "hb": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "gd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("base", sorted(BASES))
def test_fosi_equals_base_bitwise_before_first_ese(base):
    model_a, x, y = _mlp_problem()
    model_b, _, _ = _mlp_problem()
    opt_a = BASES[base](model_a.parameters())
    fosi = FOSI(BASES[base](model_b.parameters()), _ce, (x[:16], y[:16]), model=model_b, k=3, ese_period=6)
    for t in range(6):  # steps 0..5; the first ESE would run before step 6
        xb, yb = x[8 * t : 8 * t + 8], y[8 * t : 8 * t + 8]
        for opt, model in ((opt_a, model_a), (fosi, model_b)):
            opt.zero_grad()
            _ce(model(xb), yb).backward()
            opt.step()
        for pa, pb in zip(model_a.parameters(), model_b.parameters()):
            assert torch.equal(pa, pb), f"step {t}"
    assert fosi.V is None and fosi.ese_due()


def test_lemma1_implied_preconditioner_is_spd_and_alpha_on_the_subspace():
    """Lemma 1 with a diagonal PD base preconditioner d_b = −η diag(q) g₂ and exact V̂:
    P⁻¹ = αV̂ diag(u) V̂ᵀ + η(I − V̂V̂ᵀ) diag(q) (I − V̂V̂ᵀ) is SPD and P⁻¹HV̂ = αV̂."""

    class DiagPrecond(torch.optim.Optimizer):
        def __init__(self, params, lr, q):
            super().__init__(params, {"lr": lr})
            self.q = q

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    p.add_(self.q * p.grad, alpha=-g["lr"])

    n, k, l, alpha, eta = 12, 3, 1, 0.7, 0.05  # noqa: E741
    H, Q, lam, _ = _quadratic(n)
    q = 0.5 + torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=F64)
    # eigenvalues ascending and rows [ℓ smallest asc, k largest asc]
    order = torch.argsort(lam)
    idx = torch.cat([order[:l], order[n - k :]])
    V, lam_hat = Q[:, idx].T, lam[idx]
    theta = nn.Parameter(torch.zeros(n, dtype=F64))
    fosi = FOSI(
        DiagPrecond([theta], eta, q), _quad_loss(H), 0, k=k, l=l, alpha=alpha, ese_period=None, lr_clip=1.0
    )
    fosi.set_basis(V, lam_hat)
    P_inv = torch.empty(n, n, dtype=F64)
    for i in range(n):  # column i of P⁻¹ = −(step taken for gradient e_i) from θ = 0
        with torch.no_grad():
            theta.zero_()
        theta.grad = torch.zeros(n, dtype=F64)
        theta.grad[i] = 1.0
        fosi.step()
        P_inv[:, i] = -theta.detach()
    proj = torch.eye(n, dtype=F64) - V.T @ V
    expected = alpha * V.T @ torch.diag(1.0 / lam_hat.abs()) @ V + eta * proj @ torch.diag(q) @ proj
    # float64 round-off on entries of size ~5: 2e-12 seen on some CPUs (BLAS kernels differ), so 1e-11
    torch.testing.assert_close(P_inv, expected, atol=1e-11, rtol=0)
    torch.testing.assert_close(P_inv, P_inv.T, atol=1e-11, rtol=0)
    assert torch.linalg.eigvalsh(P_inv).min() > 0
    torch.testing.assert_close(P_inv @ H @ V.T, alpha * V.T, atol=1e-10, rtol=0)


def _reference_fosi(H, theta0, base, k, alpha, steps, c, form, ese_at, basis_fn):
    """Straightforward FOSI (the paper's update, full velocity vector, explicit projections) on a
    quadratic; ``basis_fn(theta)`` returns (λ̂ asc, V̂ rows) at each ESE."""
    theta = theta0.clone()
    n = theta.numel()
    vel = torch.zeros(n, dtype=F64)
    V = torch.zeros(k, n, dtype=F64)
    u = torch.zeros(k, dtype=F64)
    s = 1.0
    m = torch.zeros(n, dtype=F64)
    v2 = torch.zeros(n, dtype=F64)
    traj = []
    for t in range(steps):
        if t in ese_at:
            lam, V = basis_fn(theta)
            u = 1.0 / lam.abs()
            s = min(max(abs(lam[-1]) / abs(lam[0]), 1.0), c)
        g = H @ theta
        g1 = V.T @ (V @ g)
        g2 = g - g1
        if form == "heavy_ball":
            vel = g1 + 0.9 * vel
        elif form == "ema":
            vel = 0.1 * g1 + 0.9 * vel
        elif form == "nesterov":
            vel = 1.9 * g1 + 0.81 * vel
        else:
            vel = g1
        d1 = -alpha * V.T @ (u * (V @ vel))
        if base == "hb":
            m = g2.clone() if t == 0 else 0.9 * m + g2
            db = -0.05 * m
        elif base == "nesterov":
            m = g2.clone() if t == 0 else 0.9 * m + g2
            db = -0.05 * (g2 + 0.9 * m)
        elif base == "gd":
            db = -0.05 * g2
        else:  # Adam, lr 1e-2
            m = 0.9 * m + 0.1 * g2
            v2 = 0.999 * v2 + 0.001 * g2 * g2
            mhat, vhat = m / (1 - 0.9 ** (t + 1)), v2 / (1 - 0.999 ** (t + 1))
            db = -1e-2 * mhat / (vhat.sqrt() + 1e-8)
        d2 = db - V.T @ (V @ db)
        theta = theta + s * d2 + d1
        traj.append(theta.clone())
    return torch.stack(traj)


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize(
    "base,form",
    [("hb", "heavy_ball"), ("gd", "none"), ("adam", "ema"), ("nesterov", "nesterov"), ("hb", "ema")],
)
def test_fosi_steps_match_reference_across_two_eses(base, form, fast_path):
    """Velocity kept across an ESE, projections, lr scaling: library == the spec's formulas."""
    n, k, alpha = 12, 3, 0.3
    H, Q, lam, theta0 = _quadratic(n)
    bases = [Q[:, :k].flip(1).T, Q[:, 1 : k + 1].flip(1).T]  # the second ESE returns another basis
    lams = [lam[:k].flip(0), lam[1 : k + 1].flip(0)]
    calls = []

    def basis_fn(theta):
        i = len(calls)
        calls.append(i)
        return lams[i], bases[i]

    c = 1.0 if base == "adam" else 3.0
    ref = _reference_fosi(H, theta0, base, k, alpha, 9, c, form, {2, 6}, basis_fn)

    theta = nn.Parameter(theta0.clone())
    fosi = FOSI(
        BASES[base]([theta]),
        _quad_loss(H),
        0,
        k=k,
        alpha=alpha,
        ese_period=4,
        ese_warmup=2,
        newton_momentum=form,
        lr_clip=c,
        fast_path=fast_path,
    )
    installed = []

    def fake_ese(batch=None):  # the exact bases of the reference instead of Lanczos
        fosi.set_basis(bases[len(installed)], lams[len(installed)])
        installed.append(1)
        return SimpleNamespace(iterations=0)

    fosi.run_ese = fake_ese  # type: ignore[method-assign]
    out = []
    for _ in range(9):
        fosi.zero_grad()
        (0.5 * theta @ H @ theta).backward()
        fosi.step()
        out.append(theta.detach().clone())
    assert len(installed) == 2
    torch.testing.assert_close(torch.stack(out), ref, atol=1e-12, rtol=1e-10)


def test_lanczos_ese_inside_fosi_finds_the_quadratics_top_eigenpairs():
    n, k = 30, 4
    H, Q, lam, theta0 = _quadratic(n)
    theta = nn.Parameter(theta0.clone())
    fosi = fosi_heavy_ball(
        [theta], _quad_loss(H), 0, lr=0.01, k=k, ese_period=None, ese_warmup=0, num_iters=30
    )
    fosi.zero_grad()
    (0.5 * theta @ H @ theta).backward()
    fosi.step()
    torch.testing.assert_close(fosi.eigenvalues, lam[:k].flip(0), atol=1e-10, rtol=0)
    info = fosi.last_info
    assert info["ese_ran"] == 1 and info["lanczos_iters"] == 30
    assert info["lambda_max"] == pytest.approx(float(lam[0]))
    assert info["lr_scale"] == pytest.approx(min(float(lam[0] / lam[k - 1]), 3.0))


def test_schedule_paper_and_released():
    theta = nn.Parameter(torch.zeros(20))
    mk = lambda **kw: fosi_gd([theta], lambda ps, b: (ps[0] ** 2).sum(), 0, lr=0.1, k=2, **kw)  # noqa: E731
    paper = mk(ese_period=5, ese_warmup=3)
    assert [t for t in range(20) if paper.ese_due(t)] == [3, 8, 13, 18]
    released = mk(ese_period=5, ese_warmup=3, ese_schedule="released")
    assert [t for t in range(20) if released.ese_due(t)] == [7, 12, 17]
    once = mk(ese_period=None, ese_warmup=4)
    assert [t for t in range(20) if once.ese_due(t)] == [4]
    default_w = mk(ese_period=6)
    assert [t for t in range(20) if default_w.ese_due(t)] == [6, 12, 18]


def test_state_dict_round_trip_continues_identically():
    model, x, y = _mlp_problem()
    fosi = FOSI(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        _ce,
        (x[:32], y[:32]),
        model=model,
        k=3,
        ese_period=3,
        ese_warmup=1,
    )

    def run(opt, mdl, steps, offset):
        for t in range(offset, offset + steps):
            opt.zero_grad()
            _ce(mdl(x[t % 8 * 8 : t % 8 * 8 + 8]), y[t % 8 * 8 : t % 8 * 8 + 8]).backward()
            opt.step()

    run(fosi, model, 3, 0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    saved = copy.deepcopy(fosi.state_dict())  # like torch.optim: references to live tensors
    run(fosi, model, 4, 3)  # includes an ESE at t = 4
    expected = [p.detach().clone() for p in model.parameters()]

    model2, _, _ = _mlp_problem(seed=5)
    model2.load_state_dict(state)
    fosi2 = FOSI(
        torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9),
        _ce,
        (x[:32], y[:32]),
        model=model2,
        k=3,
        ese_period=3,
        ese_warmup=1,
    )
    fosi2.load_state_dict(saved)
    assert fosi2.param_groups is fosi2.base.param_groups
    run(fosi2, model2, 4, 3)
    for a, b in zip(expected, model2.parameters()):
        assert torch.equal(a, b)


def test_param_groups_shared_with_base_and_scheduler_reaches_it():
    model, x, y = _mlp_problem()
    base = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[2].parameters(), "lr": 0.01}],
        momentum=0.9,
    )
    fosi = FOSI(base, _ce, (x, y), model=model, k=2, ese_period=2, ese_warmup=1)
    assert fosi.param_groups is base.param_groups and fosi.state is base.state
    assert fosi._fast_path_kind() is None  # different lrs: generic path
    sched = torch.optim.lr_scheduler.StepLR(fosi, step_size=1, gamma=0.5)
    for _ in range(3):
        fosi.zero_grad()
        _ce(model(x), y).backward()
        fosi.step()
        sched.step()
    assert base.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert fosi.ese_count == 1 and fosi.V is not None
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_adam_forces_c_to_one():
    H, _, _, theta0 = _quadratic(20)
    theta = nn.Parameter(theta0.clone())
    fosi = fosi_adam([theta], _quad_loss(H), 0, k=3, lr_clip=10.0, ese_period=None, ese_warmup=0)
    assert fosi.lr_clip == 1.0
    fosi.zero_grad()
    (0.5 * theta @ H @ theta).backward()
    fosi.step()
    assert fosi.scale == 1.0 and fosi.newton_momentum == "ema"


def test_bad_inputs():
    theta = nn.Parameter(torch.zeros(5))
    with pytest.raises(ValueError, match="smaller than the number of parameters"):
        fosi_gd([theta], lambda ps, b: (ps[0] ** 2).sum(), 0, lr=0.1, k=4, l=1)
    with pytest.raises(ValueError, match="ese_batch"):
        fosi_gd([theta], lambda ps, b: (ps[0] ** 2).sum(), None, lr=0.1, k=2)
    with pytest.raises(ValueError, match="newton_momentum"):
        fosi_gd([theta], lambda ps, b: (ps[0] ** 2).sum(), 0, lr=0.1, k=2, newton_momentum="adam")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ese_period": -5}, "ese_period must be a positive number of steps"),
        ({"ese_period": 0}, "ese_period must be a positive number of steps"),
        ({"ese_warmup": -1}, "ese_warmup"),
        ({"alpha": float("nan")}, "alpha"),
        ({"alpha": -0.01}, "alpha"),
        ({"eps": -1e-8}, "eps"),
        ({"lr": float("nan")}, "lr must be a finite"),
        ({"lr": float("inf")}, "lr must be a finite"),
    ],
)
def test_bad_option_values_are_refused(kwargs, match):
    """ese_period=-5 used to mean "a single ESE" silently, and NaN/inf values were accepted."""
    theta = nn.Parameter(torch.zeros(5))
    kwargs = {"lr": 0.1, **kwargs}
    lr = kwargs.pop("lr")
    with pytest.raises(ValueError, match=match):
        fosi_gd([theta], lambda ps, b: (ps[0] ** 2).sum(), 0, lr=lr, k=2, **kwargs)


def _hb_fosi(model, x, y):
    return FOSI(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        _ce,
        (x[:32], y[:32]),
        model=model,
        k=3,
        ese_period=3,
        ese_warmup=1,
        hvp_mode="reverse_over_reverse",  # no linearize tracing per ESE: seconds, not tens
    )


def _hb_steps(opt, mdl, x, y, steps, offset, between=None):
    for t in range(offset, offset + steps):
        opt.zero_grad()
        _ce(mdl(x[t % 8 * 8 : t % 8 * 8 + 8]), y[t % 8 * 8 : t % 8 * 8 + 8]).backward()
        opt.step()
        if between is not None:
            between()


def test_state_dict_does_not_change_the_trajectory():
    """Taking a checkpoint (state_dict) used to sync the SGD fast path's momentum buffers in place,
    which changed later steps by rounding (a FOSI run with checkpoint_every differed from one
    without from step 12). Now it changes nothing: bitwise the same parameters."""
    model, x, y = _mlp_problem()
    fosi = _hb_fosi(model, x, y)
    _hb_steps(fosi, model, x, y, 12, 0)
    plain = [p.detach().clone() for p in model.parameters()]

    model2, _, _ = _mlp_problem()
    fosi2 = _hb_fosi(model2, x, y)
    _hb_steps(fosi2, model2, x, y, 12, 0, between=fosi2.state_dict)
    assert fosi2._buffers_offset  # the fast path's offset buffers are live here
    assert all(torch.equal(a, b) for a, b in zip(plain, model2.parameters()))


def test_state_dict_round_trip_equals_an_uninterrupted_run():
    """Save mid-run on the fast path (buffers offset), load into a fresh FOSI, continue: bitwise the
    run that never saved."""
    model, x, y = _mlp_problem()
    fosi = _hb_fosi(model, x, y)
    _hb_steps(fosi, model, x, y, 11, 0)
    expected = [p.detach().clone() for p in model.parameters()]

    model2, _, _ = _mlp_problem()
    fosi2 = _hb_fosi(model2, x, y)
    _hb_steps(fosi2, model2, x, y, 5, 0)
    saved = copy.deepcopy(fosi2.state_dict())
    weights = {k: v.clone() for k, v in model2.state_dict().items()}
    model3, _, _ = _mlp_problem(seed=5)
    model3.load_state_dict(weights)
    fosi3 = _hb_fosi(model3, x, y)
    fosi3.load_state_dict(saved)
    _hb_steps(fosi3, model3, x, y, 6, 5)
    assert all(torch.equal(a, b) for a, b in zip(expected, model3.parameters()))


def test_non_symmetric_operator_is_detected_in_debug_mode():
    theta = nn.Parameter(torch.randn(30, dtype=F64))

    def random_loss(ps, batch):  # a different quadratic at every call, like dropout left on
        w = torch.rand(30, dtype=F64)
        return 0.5 * (w * ps[0] ** 2).sum() + ps[0][0] * ps[0][1] * w[0]

    fosi = fosi_gd(
        [theta],
        random_loss,
        0,
        lr=0.1,
        k=2,
        ese_period=None,
        ese_warmup=0,
        debug=True,
        on_ese_failure="raise",
    )
    theta.grad = torch.ones(30, dtype=F64)
    with pytest.raises(NonSymmetricOperatorError):
        fosi.step()


def test_failed_ese_stays_on_base_path_and_logs(caplog):
    torch.manual_seed(0)
    theta_a = nn.Parameter(torch.randn(30, dtype=F64))
    theta_b = nn.Parameter(theta_a.detach().clone())

    def nan_loss(ps, batch):
        return (ps[0] ** 2).sum() * float("nan")

    base_only = torch.optim.SGD([theta_a], lr=0.1, momentum=0.9)
    fosi = fosi_heavy_ball([theta_b], nan_loss, 0, lr=0.1, k=2, ese_period=2, ese_warmup=1)
    with caplog.at_level(logging.WARNING, logger="curvopt.optim.fosi"):
        for _ in range(4):
            for th, opt in ((theta_a, base_only), (theta_b, fosi)):
                opt.zero_grad()
                (th**2).sum().backward()
                opt.step()
    assert torch.equal(theta_a, theta_b)  # still exactly the base optimizer
    assert fosi.V is None and fosi.ese_count == 0
    assert fosi.last_info["ese_failed"] == 1 and "non-finite" in fosi.last_ese_error
    assert any("ESE before step" in r.message for r in caplog.records)
    raising = fosi_heavy_ball(
        [theta_b], nan_loss, 0, lr=0.1, k=2, ese_period=None, ese_warmup=0, on_ese_failure="raise"
    )
    with pytest.raises(LanczosError):
        raising.step()


# -- the loop's factory and configs ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fosi_heavy_ball", "fosi_adam", "fosi_gd"])
def test_config_builds_and_runs_eses(name, tmp_path):
    cfg = compose(
        [
            "dataset=synthetic_classification",
            "model=tiny_mlp",
            f"optimizer={name}",
            "logger=none",
            f"paths.results_dir={tmp_path}",
            "optimizer.ese_period=2",
            "optimizer.ese_warmup=1",
            "optimizer.ese_batch_size=48",
        ]
    )
    data = build_data(cfg, torch.float32, torch.device("cpu"))
    model, loss = build_model(cfg, torch.float32, torch.device("cpu"))
    algo = build_algorithm(cfg.optimizer, Objective(model, loss), data)
    assert algo.fosi.ese_batch[0].shape[0] == 48
    x, y = data.train
    rows = [algo.step((x[i * 32 : (i + 1) * 32], y[i * 32 : (i + 1) * 32])) for i in range(4)]
    assert [r["ese_ran"] for r in rows] == [0, 1, 0, 1]
    assert rows[-1]["lambda_max"] >= rows[-1]["lambda_k"] > 0
    assert all(math.isfinite(r["loss"]) for r in rows)
    if name == "fosi_adam":
        assert rows[-1]["lr_scale"] == 1.0


def test_quadratic_variant_via_factory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    data = type("D", (), {})()
    from curvopt.api import DataBundle

    data = DataBundle(train=(torch.randn(20, 4), torch.randint(0, 3, (20,))))
    algo = build_fosi(
        Objective(model, "cross_entropy"),
        data,
        base="heavy_ball",
        variant="quadratic",
        k=2,
        alpha=None,
        lr_clip=None,
        newton_momentum=None,
        ese_batch_size=10,
    )
    f = algo.fosi
    assert (f.alpha, f.lr_clip, f.newton_momentum) == (1.0, math.inf, "ema")
    algo2 = build_fosi(
        Objective(model, "cross_entropy"),
        data,
        base="heavy_ball",
        variant="quadratic",
        k=2,
        alpha=0.5,
        ese_batch_size=10,
    )
    assert algo2.fosi.alpha == 0.5


def test_fast_path_buffers_are_the_true_ones_after_sync():
    """The SGD fast path keeps m′ = m + V̂ᵀz in the base; state_dict() restores the true buffer m
    (the one the generic path builds from g₂)."""
    n, k = 12, 3
    H, Q, lam, theta0 = _quadratic(n)
    out = {}
    for fast in (True, False):
        theta = nn.Parameter(theta0.clone())
        fosi = FOSI(
            torch.optim.SGD([theta], lr=0.05, momentum=0.9, dampening=0.2),
            _quad_loss(H),
            0,
            k=k,
            ese_period=3,
            ese_warmup=1,
            alpha=0.5,
            fast_path=fast,
        )
        for _ in range(8):
            fosi.zero_grad()
            (0.5 * theta @ H @ theta).backward()
            fosi.step()
        buf = fosi.state_dict()["state"][0]["momentum_buffer"].clone()
        out[fast] = (theta.detach().clone(), buf)
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-12, rtol=1e-10)


def test_current_batch_mode_uses_the_step_batch():
    model, x, y = _mlp_problem()
    # reference: a fixed-batch ESE on the same batch at the same point (same seed: same result)
    ref = FOSI(torch.optim.SGD(model.parameters(), lr=0.1), _ce, (x[:8], y[:8]), model=model, k=2)
    ref.run_ese()
    fosi = FOSI(
        torch.optim.SGD(model.parameters(), lr=0.1),
        _ce,
        None,
        model=model,
        k=2,
        ese_period=None,
        ese_warmup=0,
        ese_batch_mode="current",
    )
    fosi.zero_grad()
    _ce(model(x[:8]), y[:8]).backward()
    with pytest.raises(ValueError, match="step\\(batch="):
        fosi.step()
    fosi.step(batch=(x[:8], y[:8]))
    assert fosi.ese_count == 1
    torch.testing.assert_close(fosi.eigenvalues, ref.eigenvalues, rtol=1e-5, atol=1e-6)
    other = FOSI(torch.optim.SGD(model.parameters(), lr=0.1), _ce, (x[32:40], y[32:40]), model=model, k=2)
    other.run_ese()
    assert not torch.allclose(other.eigenvalues, ref.eigenvalues, rtol=1e-3)


def test_factory_clips_gradients_element_wise_before_fosi(tmp_path):
    """The AE task clips before every optimizer. ``clip_grad_value`` reaches FOSI through the loop's
    ``build_algorithm`` (which strips ``grad_clip_value`` from factory configs); before the first
    ESE a FOSI-HB step is then exactly θ − η·clip(g)."""
    cfg = compose(
        [
            "dataset=synthetic_classification",
            "model=tiny_mlp",
            "optimizer=fosi_heavy_ball",
            "logger=none",
            f"paths.results_dir={tmp_path}",
            "optimizer.ese_warmup=5",
            "optimizer.ese_batch_size=16",
            "optimizer.clip_grad_value=0.001",
        ]
    )
    data = build_data(cfg, torch.float32, torch.device("cpu"))
    model, loss = build_model(cfg, torch.float32, torch.device("cpu"))
    algo = build_algorithm(cfg.optimizer, Objective(model, loss), data)
    assert algo.grad_clip_value == 0.001
    x, y = data.train
    before = [p.detach().clone() for p in model.parameters()]
    ref = copy.deepcopy(model)
    mean_loss(ref(x[:32]), y[:32], loss).backward()
    algo.step((x[:32], y[:32]))
    lr = float(cfg.optimizer.lr)
    for p0, p1, r in zip(before, model.parameters(), ref.parameters()):
        torch.testing.assert_close(p1.detach(), p0 - lr * r.grad.clamp(-0.001, 0.001), rtol=0, atol=1e-7)
    # the AE experiment clips FOSI as it clips HB/Adam (0.5 on the repo's ½-scaled loss); the
    # per-optimizer files compose (a key missing from the optimizer's config would fail the struct merge)
    for opt, key in (
        ("fosi_heavy_ball", "clip_grad_value"),
        ("fosi_adam", "clip_grad_value"),
        ("heavy_ball", "grad_clip_value"),
        ("adam", "grad_clip_value"),
    ):
        for experiment in ("fosi_ae", "fosi_ae_paper"):
            ae = compose([f"experiment={experiment}", f"optimizer={opt}"])
            assert ae.optimizer[key] == 0.5


@pytest.mark.parametrize("base", ["hb", "adam", "nesterov", "gd"])
def test_state_dict_just_before_an_ese_drops_the_basis_and_continues_bitwise(base):
    """Taken just before an ESE step, the state dict holds no V̂ (the ESE replaces it), only the
    materialised Newton velocity: a run stopped at an ESE boundary checkpoints (k+ℓ)× less of
    FOSI's own state, and a load still continues bit for bit."""
    x_all = _mlp_problem()[1:]

    def make(model):
        return FOSI(
            BASES[base](model.parameters()),
            _ce,
            (x_all[0][:32], x_all[1][:32]),
            model=model,
            k=3,
            ese_period=3,
            ese_warmup=1,
            hvp_mode="reverse_over_reverse",
        )

    model, x, y = _mlp_problem()
    fosi = make(model)
    _hb_steps(fosi, model, x, y, 12, 0)  # ESEs before steps 1, 4, 7, 10
    expected = [p.detach().clone() for p in model.parameters()]

    model2, _, _ = _mlp_problem()
    fosi2 = make(model2)
    _hb_steps(fosi2, model2, x, y, 6, 0)
    full = fosi2.state_dict()["fosi"]
    assert full["V"] is not None and not full.get("basis_dropped_before_ese")  # step 6: no ESE due
    _hb_steps(fosi2, model2, x, y, 1, 6)
    assert fosi2.ese_due()  # the next step (7) runs an ESE
    saved = copy.deepcopy(fosi2.state_dict())
    assert saved["fosi"]["V"] is None and saved["fosi"]["basis_dropped_before_ese"]
    numel = sum(v.numel() for v in saved["fosi"].values() if isinstance(v, torch.Tensor))
    assert numel < sum(v.numel() for v in full.values() if isinstance(v, torch.Tensor)) / 2

    weights = {k: v.clone() for k, v in model2.state_dict().items()}
    model3, _, _ = _mlp_problem(seed=5)
    model3.load_state_dict(weights)
    fosi3 = make(model3)
    fosi3.load_state_dict(saved)
    _hb_steps(fosi3, model3, x, y, 5, 7)
    assert all(torch.equal(a, b) for a, b in zip(expected, model3.parameters()))


def test_state_dict_before_an_ese_keeps_the_basis_when_a_failed_ese_keeps_it():
    model, x, y = _mlp_problem()
    fosi = FOSI(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        _ce,
        (x[:32], y[:32]),
        model=model,
        k=3,
        ese_period=3,
        ese_warmup=1,
        hvp_mode="reverse_over_reverse",
        on_ese_failure="keep",
    )
    _hb_steps(fosi, model, x, y, 4, 0)
    assert fosi.ese_due() and fosi.state_dict()["fosi"]["V"] is not None


def test_num_iters_and_maximize_are_refused_at_construction():
    """issue 43: num_iters was checked only at the first ESE, and a maximize=True base had its
    first-order part maximised while the Newton part still descended."""
    model = torch.nn.Linear(30, 20)
    batch = (torch.randn(8, 30), torch.randn(8, 20))
    loss = torch.nn.functional.mse_loss
    for bad in (-3, 0, 5, 10_000, 12.5):
        with pytest.raises(ValueError, match="num_iters"):
            FOSI(torch.optim.SGD(model.parameters(), lr=0.1), loss, batch, model=model, num_iters=bad)
    with pytest.raises(ValueError, match="maximize"):
        FOSI(torch.optim.SGD(model.parameters(), lr=0.1, maximize=True), loss, batch, model=model)
    FOSI(torch.optim.SGD(model.parameters(), lr=0.1), loss, batch, model=model, num_iters=40)


@pytest.mark.parametrize(
    "kw",
    [
        {"weight_decay": math.nan},
        {"weight_decay": -1.0},
        {"clip_grad_value": math.nan},
        {"clip_grad_value": 0.0},
    ],
)
def test_build_fosi_refuses_a_bad_weight_decay_or_clip(kw):
    """issue 43: build_fosi let a NaN weight decay or gradient clip through to the first step."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=next(iter(kw))):
        build_fosi(
            Objective(model, "cross_entropy"), None, base="heavy_ball", lr=0.1, ese_batch="current", **kw
        )
