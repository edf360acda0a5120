"""The quadratic experiments (experiments/fosi_quadratics): the batched update rules equal the
library FOSI (variant "quadratic") and torch's base optimizers; problem construction; records and
figures from records."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from curvopt.optim.fosi import FOSI, VARIANTS
from curvopt.training.records import read_metrics
from experiments.fosi_quadratics import figures, run
from experiments.fosi_quadratics import quadratics as q

F64 = torch.float64


@pytest.fixture(scope="module")
def problem():
    return q.q1_problem(40, 20.0)


@pytest.mark.parametrize(
    "rule,make_base",
    [
        ("fosi_hb", lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9)),
        ("fosi_gd", lambda ps, lr: torch.optim.SGD(ps, lr=lr)),
        ("fosi_adam", lambda ps, lr: torch.optim.Adam(ps, lr=lr)),
    ],
)
def test_quadratic_rules_equal_library_fosi_quadratic_variant(problem, rule, make_base):
    """The authors' quadratic update rules are the library's FOSI with EMA Newton momentum,
    α = 1 and c = ∞ (c = 1 for Adam): same trajectory to round-off."""
    p = problem
    e = q.ese(p, k=5)
    base = q.base_lr(rule, p.eigenvalues)
    lr = base * e.scale if rule != "fosi_adam" else base
    ref = q.run_batch(p.H, p.theta0, rule, 40, lr, eigenvalues=e.eigenvalues, eigenvectors=e.eigenvectors)[
        0, 0
    ]
    theta = nn.Parameter(p.theta0.clone())
    fosi = FOSI(
        make_base([theta], base),
        lambda ps, b: 0.5 * ps[0] @ p.H @ ps[0],
        0,
        k=5,
        ese_period=None,
        ese_warmup=0,
        num_iters=20,
        **VARIANTS["quadratic"],
    )
    fs = [float(p.f(theta.detach()))]
    for _ in range(40):
        fosi.zero_grad()
        (0.5 * theta @ p.H @ theta).backward()
        fosi.step()
        fs.append(float(p.f(theta.detach())))
    torch.testing.assert_close(torch.tensor(fs, dtype=F64), ref, rtol=1e-8, atol=0)


@pytest.mark.parametrize(
    "rule,make",
    [
        ("hb", lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=0.9)),
        ("gd", lambda ps: torch.optim.SGD(ps, lr=0.02)),
        ("adam", lambda ps: torch.optim.Adam(ps, lr=0.02)),
    ],
)
def test_base_rules_equal_torch_optimizers(problem, rule, make):
    p = problem
    ref = q.run_batch(p.H, p.theta0, rule, 30, 0.02)[0, 0]
    theta = nn.Parameter(p.theta0.clone())
    opt = make([theta])
    fs = [float(p.f(theta.detach()))]
    for _ in range(30):
        opt.zero_grad()
        (0.5 * theta @ p.H @ theta).backward()
        opt.step()
        fs.append(float(p.f(theta.detach())))
    torch.testing.assert_close(torch.tensor(fs, dtype=F64), ref, rtol=1e-10, atol=0)


def test_batched_runs_equal_single_runs(problem):
    """Lockstep batching over rules, learning rates and momenta changes nothing."""
    p = problem
    e = q.ese(p, k=5)
    rules = ["gd", "fosi_hb", "adam", "fosi_adam"]
    lrs = torch.tensor([0.01, 0.02, 0.03, 0.04], dtype=F64)
    betas = torch.tensor([0.8, 0.85, 0.9, 0.95], dtype=F64)
    batched = q.run_batch(
        p.H, p.theta0, rules, 25, lrs, betas, eigenvalues=e.eigenvalues, eigenvectors=e.eigenvectors
    )[0]
    for i, rule in enumerate(rules):
        single = q.run_batch(
            p.H,
            p.theta0,
            rule,
            25,
            float(lrs[i]),
            float(betas[i]),
            eigenvalues=e.eigenvalues,
            eigenvectors=e.eigenvectors,
        )[0, 0]
        torch.testing.assert_close(batched[i], single, rtol=1e-12, atol=0)


def test_problems_have_the_papers_spectra():
    p1 = q.q1_problem(30, 50.0)
    ev = torch.linalg.eigvalsh(p1.H).flip(0)
    torch.testing.assert_close(ev[:3], torch.tensor([50.0, 1.0, 1 / 1.5], dtype=F64), rtol=1e-10, atol=0)
    assert float(p1.eigenvalues[-1]) == pytest.approx(1.5**-28)
    p2 = q.q2_problem()
    ev2 = torch.linalg.eigvalsh(p2.H)
    assert float(ev2[-1]) == pytest.approx(10.0) and float(ev2[0]) == pytest.approx(0.01)
    p3 = q.q3_problem(1.12, 50)
    expected = torch.tensor([1e-3 * 1.12**i for i in range(100)], dtype=F64)
    torch.testing.assert_close(torch.linalg.eigvalsh(p3.H), expected, rtol=1e-8, atol=1e-12)
    assert not torch.allclose(p3.H, torch.diag(torch.diagonal(p3.H)))  # rotated block
    # θ₀ = Q x₀′ with x₀′[1] = 1 along the second-smallest eigenvector
    _, vecs = torch.linalg.eigh(p3.H)
    coords = vecs.T @ p3.theta0
    assert float(coords[1].abs()) == pytest.approx(1.0) and float(coords[5].abs()) == pytest.approx(0.5)
    bs, zetas = q.q3_grid()
    assert len(bs) == 20 and len(zetas) == 26


def test_fig4_records_and_figure(tmp_path):
    run.main(["q2", "--results-dir", str(tmp_path / "res"), "--no-pack"])
    runs = figures.load_summaries(tmp_path / "res", "q2_fig4")
    assert {s["setting"]["optimizer"] for s in runs} == {"gd", "fosi_gd"}
    for s in runs:
        rows = read_metrics(s["_dir"] / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(251))
        assert rows[-1]["f"] == s["f_final"]
        assert (s["_dir"] / "config.yaml").exists()
    by = {s["setting"]["optimizer"]: s for s in runs}
    # Fig. 4's message: FOSI-GD is far below GD early on although κ̃ = 1e5 > κ = 1e3
    gd, fosi = figures.curve(by["gd"]), figures.curve(by["fosi_gd"])
    assert gd[0] == fosi[0] and fosi[10] < 0.2 * gd[10] and fosi[250] < gd[250]
    assert by["fosi_gd"]["setting"]["effective_condition_number"] == pytest.approx(1e5)
    path, values = figures.fig4(tmp_path / "res", tmp_path / "fig")
    assert path.exists() and path.stat().st_size > 10_000
    assert {(v["optimizer"], v["iteration"]) for v in values} >= {("GD", 250), ("FOSI-GD", 0)}
    summary = json.loads((by["gd"]["_dir"] / "summary.json").read_text())
    assert math.isfinite(summary["f_final"])
    # by default the driver packs each experiment: two files, read back the same
    run.main(["q2", "--results-dir", str(tmp_path / "packed")])
    assert sorted(p.name for p in (tmp_path / "packed" / "q2_fig4").iterdir()) == [
        "metrics.parquet",
        "runs.jsonl",
    ]
    packed = {s["setting"]["optimizer"]: s for s in figures.load_summaries(tmp_path / "packed", "q2_fig4")}
    for name, s in by.items():
        assert packed[name]["setting"] == s["setting"] and packed[name]["f_final"] == s["f_final"]
        assert (figures.curve(packed[name]) == figures.curve(s)).all()


def test_legacy_rotation_is_the_authors_scipy():
    """The Q3 block rotation is the one the authors' scipy (< 1.16) drew under numpy seed 1234;
    the reference entries were printed by scipy 1.10.1 / numpy 1.23.5
    (``np.random.seed(1234); special_ortho_group.rvs(d)``). scipy ≥ 1.16 gives another matrix."""
    import numpy as np

    R3 = q.special_ortho_group_legacy(3, np.random.RandomState(1234))
    ref3 = [
        [-0.2453088969018693, 0.4372338412241754, -0.8652456952733948],
        [-0.61971816355888, 0.6156186475379306, 0.4867885357717231],
        [0.7455018060715862, 0.6556220320366922, 0.11994502178949029],
    ]
    np.testing.assert_allclose(R3, ref3, rtol=0, atol=1e-14)
    R50 = q.special_ortho_group_legacy(50, np.random.RandomState(1234))
    np.testing.assert_allclose(
        R50[0, :3], [-0.06901522485825451, -0.047445933424112186, 0.14459876228959354], atol=1e-13
    )
    np.testing.assert_allclose(
        R50[49, 47:], [0.05052989686876203, -0.28970032806439894, -0.010691702362426614], atol=1e-13
    )
    assert np.trace(R50) == pytest.approx(0.2969523945170494, abs=1e-12)
    np.testing.assert_allclose(R50 @ R50.T, np.eye(50), atol=1e-12)
    assert np.linalg.det(R50) == pytest.approx(1.0)
    # q3_problem's default block is this rotation (numpy seed reset per call), and "scipy" is another one
    p = q.q3_problem(1.12, 4)
    diag = [1e-3 * 1.12**i for i in range(100)]
    R4 = q.special_ortho_group_legacy(4, np.random.RandomState(1234))
    block = R4 @ np.diag(diag[:2] + diag[98:]) @ R4.T
    np.testing.assert_allclose(p.H[:4, :4].numpy(), block, rtol=1e-12, atol=0)
    assert not np.allclose(q.q3_problem(1.12, 4, rotation="scipy").H[:4, :4].numpy(), block)


def test_fosi_adam_rule_hand_worked_steps():
    """Two steps of the authors' quadratic FOSI-Adam on H = diag(4, 1), V̂ = e₁ (λ̂ = 4), θ₀ = (1, 1),
    η = 0.05: Newton EMA mn ← 0.9mn + 0.1·nd (α = 1, no bias correction); Adam (bias-corrected,
    eps 1e-8) on g_res only; the Adam step is projected off V̂."""
    H = torch.diag(torch.tensor([4.0, 1.0], dtype=F64))
    V, lam = torch.tensor([[1.0, 0.0]], dtype=F64), torch.tensor([4.0], dtype=F64)
    theta0 = torch.tensor([1.0, 1.0], dtype=F64)
    eta, eps = 0.05, 1e-8
    # step 1: g = (4, 1), nd = (1, 0), g_res = (0, 1); m̂ = 1, v̂ = 1
    x1 = (1.0 - 0.1 * 1.0, 1.0 - eta * 1.0 / (1.0 + eps))
    # step 2: g = (3.6, x1[1]), nd = (0.9, 0), mn = 0.9·0.1 + 0.1·0.9 = 0.18
    m2 = 0.9 * 0.1 * 1.0 + 0.1 * x1[1]
    v2 = 0.999 * 0.001 * 1.0 + 0.001 * x1[1] ** 2
    d2 = (m2 / (1 - 0.9**2)) / (math.sqrt(v2 / (1 - 0.999**2)) + eps)
    x2 = (x1[0] - 0.18, x1[1] - eta * d2)
    f = q.run_batch(H, theta0, "fosi_adam", 2, eta, eigenvalues=lam, eigenvectors=V)[0, 0]
    expected = [2.5, 2.0 * x1[0] ** 2 + 0.5 * x1[1] ** 2, 2.0 * x2[0] ** 2 + 0.5 * x2[1] ** 2]
    torch.testing.assert_close(f, torch.tensor(expected, dtype=F64), rtol=1e-14, atol=0)
