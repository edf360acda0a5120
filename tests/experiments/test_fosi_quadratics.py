"""The quadratic experiments (experiments/fosi_quadratics): the batched update rules equal the
library FOSI (variant "quadratic") and torch's base optimizers; problem construction; records and
figures from records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from curvopt.optim.fosi import FOSI, VARIANTS
from curvopt.training.records import read_metrics
from experiments.fosi_quadratics import audit_authors, figures, robustness, run
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


# -- Figures 7-8: per-run start points, start-point robustness, the audit against the authors' script --
RESULTS = Path(__file__).resolve().parents[2] / "results" / "fosi_quadratics"


def test_run_batch_per_run_start_points(problem):
    """theta0 of shape (B, R, n): each run starts from its own point, as if run alone."""
    p = problem
    e = q.ese(p, k=5)
    gen = torch.Generator().manual_seed(1)
    starts = torch.randn(4, p.n, generator=gen, dtype=F64)
    rules = ["adam", "fosi_adam", "adam", "fosi_adam"]
    batched = q.run_batch(
        p.H[None], starts[None], rules, 20, 0.05, eigenvalues=e.eigenvalues, eigenvectors=e.eigenvectors
    )[0]
    for i, rule in enumerate(rules):
        single = q.run_batch(
            p.H, starts[i], rule, 20, 0.05, eigenvalues=e.eigenvalues, eigenvectors=e.eigenvectors
        )[0, 0]
        torch.testing.assert_close(batched[i], single, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="start points"):
        q.run_batch(
            p.H[None],
            starts[None, :3],
            rules,
            2,
            0.05,
            eigenvalues=e.eigenvalues,
            eigenvectors=e.eigenvectors,
        )


def test_signed_starts_keep_f0_and_the_recorded_start():
    p = q.q3_problem(1.142, 50)
    signs = robustness.sign_draws(6, seed=3)
    drawn, canonical = robustness.signed_starts(p.H, signs)
    torch.testing.assert_close(canonical, p.theta0, rtol=0, atol=0)
    f0 = torch.stack([p.f(t) for t in drawn])
    torch.testing.assert_close(f0, p.f(p.theta0).expand(6), rtol=1e-12, atol=0)  # signs do not change f(θ₀)
    assert not torch.allclose(drawn[0], p.theta0)
    ones = robustness.signed_starts(p.H, torch.ones(1, 100, dtype=F64))[0][0]
    torch.testing.assert_close(ones, p.theta0, rtol=0, atol=1e-15)


def test_robustness_run_on_a_small_grid(monkeypatch, tmp_path):
    """The record: one row per cell; run 0 (eigh's signs) is the Q3 computation of that cell."""
    import numpy as np

    monkeypatch.setattr(q, "q3_grid", lambda: (np.array([1.142, 1.16]), np.array([4, 50])))
    robustness.main(["--draws", "3", "--results-dir", str(tmp_path)])
    rec = json.loads((tmp_path / robustness.RECORD).read_text())
    assert rec["settings"]["draws_per_cell"] == 3 and len(rec["cells"]) == 4
    row = {(c["b"], c["zeta"]): c for c in rec["cells"]}[(1.142, 50)]
    assert row["eigh_signs_fails"]  # the worst cell of the full grid (ratio 2.18)
    assert row["eigh_signs_fosi_adam_f200"] / row["eigh_signs_adam_f200"] == pytest.approx(2.183, abs=1e-3)
    assert 0 <= row["fosi_le_adam"] <= 3 and row["share_fosi_le_adam"] == row["fosi_le_adam"] / 3
    assert rec["summary"]["cells_failing_eigh_signs"] == sum(c["eigh_signs_fails"] for c in rec["cells"])
    path = figures.fig7_robustness(tmp_path, tmp_path / "fig")
    assert path.name == "fig7_start_point_robustness.png" and path.stat().st_size > 10_000


def test_committed_robustness_record_matches_the_q3_records():
    """≥ 50 draws in every cell of the grid; the cells failing from eigh's signs are the Q3 records'."""
    rec = json.loads((RESULTS / robustness.RECORD).read_text())
    assert len(rec["cells"]) == 520 and min(c["draws"] for c in rec["cells"]) >= 50
    table = figures._q3_table(RESULTS)
    fails = {c for c in table["adam"] if table["fosi_adam"][c]["f_final"] > table["adam"][c]["f_final"]}
    assert {(c["b"], c["zeta"]) for c in rec["cells"] if c["eigh_signs_fails"]} == fails
    by = {(c["b"], c["zeta"]): c for c in rec["cells"]}
    for c in fails:  # recomputed vs recorded: round-off of the ESE/BLAS, amplified over 200 Adam steps
        assert by[c]["eigh_signs_fosi_adam_f200"] == pytest.approx(table["fosi_adam"][c]["f_final"], rel=1e-7)
        assert by[c]["eigh_signs_adam_f200"] == pytest.approx(table["adam"][c]["f_final"], rel=1e-7)


def test_committed_audit_record():
    """The authors' script was run on (at least) every failing cell and agrees with ours."""
    rec = json.loads((RESULTS / audit_authors.RECORD).read_text())
    assert rec["authors"]["repository"].endswith("hsivan/fosi") and rec["authors"]["commit"]
    assert {"jax", "jaxlib", "scipy", "numpy"} <= set(rec["versions"]) and rec["versions"]["jax_enable_x64"]
    assert rec["same_failing_cells"] and rec["cells_failing_authors"] == rec["cells_failing_ours"] > 0
    assert rec["max_rel_diff_same_start"] < 1e-8 and rec["theta0_max_abs_diff_same_start"] < 1e-6
    other = {(c["b"], c["zeta"]) for c in rec["cells_other_start"]}
    assert rec["cells_same_start"] + len(other) == rec["cells_audited"]
    assert all(c["same_verdict"] and c["flipped_eigenvectors"] for c in rec["cells_other_start"])
    assert not other & {tuple(c) for c in rec["failing_cells_authors"]}  # every failing cell: the same θ₀
    assert rec["cells_audited"] >= rec["cells_failing_ours_whole_grid"]
    text = (RESULTS / audit_authors.RECORD).read_text()
    assert not any(p in text for p in ("/tmp/", "/work/", "/home/", "/root/"))  # no machine paths


def test_audit_skips_without_checkout_or_jax(tmp_path, capsys):
    assert audit_authors.main(["--authors-src", str(tmp_path / "none"), "--results-dir", str(tmp_path)]) == 0
    assert "skipped: no authors' checkout" in capsys.readouterr().out
    src = tmp_path / "fosi"
    (src / "experiments" / "quadratic").mkdir(parents=True)
    (src / audit_authors.SCRIPT).write_text("")
    assert audit_authors.main(["--authors-src", str(src), "--results-dir", str(tmp_path)]) == 0
    assert "skipped: no --jax-python" in capsys.readouterr().out
    args = [
        "--authors-src",
        str(src),
        "--jax-python",
        str(tmp_path / "no-python"),
        "--results-dir",
        str(tmp_path),
    ]
    assert audit_authors.main(args) == 0
    assert "skipped: cannot start" in capsys.readouterr().out
    assert not (tmp_path / audit_authors.RECORD).exists()


def test_audit_compare_counts_cells_and_differences():
    """Failing cells on both sides, the largest f_t difference over the cells with the same θ₀, and
    the cells where the other eigh flipped an eigenvector (θ₀ = Q x₀′ with x₀′ > 0)."""
    import numpy as np

    t = np.arange(201, dtype=np.float64)
    Q = np.linalg.qr(np.random.default_rng(0).normal(size=(3, 3)))[0]
    x = np.array([0.5, 1.0, 0.5])
    mine = {
        (1.142, 50): {"adam": 1.0 / (1 + t), "fosi_adam": 2.0 / (1 + t), "theta0": Q @ x, "vecs": Q},
        (1.12, 90): {"adam": 2.0 / (1 + t), "fosi_adam": 1.0 / (1 + t), "theta0": Q @ x, "vecs": Q},
    }
    flipped = Q @ (x * np.array([-1.0, 1.0, 1.0]))  # the other code's eigh gave -q_0
    authors = {
        "cells": [
            {
                "b": 1.142,
                "zeta": 50,
                "theta0": list(Q @ x + 1e-12),
                "f": {"adam": list(1.0 / (1 + t)), "fosi_adam": list(2.0 / (1 + t) * (1 + 1e-9))},
            },
            {
                "b": 1.12,
                "zeta": 90,
                "theta0": list(flipped),
                "f": {"adam": list(2.0 / (1 + t) * 1.1), "fosi_adam": list(1.0 / (1 + t))},
            },
        ]
    }
    out = audit_authors.compare(mine, authors)
    assert out["same_failing_cells"] and out["failing_cells_authors"] == [[1.142, 50]]
    assert out["cells_same_start"] == 1 and out["max_rel_diff_same_start"] == pytest.approx(1e-9, rel=1e-6)
    assert out["theta0_max_abs_diff_same_start"] == pytest.approx(1e-12, rel=1e-3)
    assert out["cells_other_start"] == [
        {
            "b": 1.12,
            "zeta": 90,
            "flipped_eigenvectors": [0],
            "max_rel_diff": pytest.approx(0.1),
            "same_verdict": True,
        }
    ]
    assert out["max_rel_diff"] == pytest.approx(0.1)
    assert out["worst_cell_authors"]["ratio"] == pytest.approx(2.0, rel=1e-6)
    assert audit_authors.flipped_eigenvectors(flipped, Q) == [0]
