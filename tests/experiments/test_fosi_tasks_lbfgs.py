"""The FOSI tasks' L-BFGS baseline (conf/optimizer/lbfgs.yaml) takes steps: its line search has a
budget (decisions FOSI-X). torch.optim.LBFGS with max_iter=1 and the default max_eval gives the
strong-Wolfe search no evaluation, so a step whose first trial raises the loss is a zero step."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from experiments.fosi_tasks.lbfgs_jaxopt import JaxoptLBFGS
from experiments.runs import REPO_ROOT

CONFIG = REPO_ROOT / "conf" / "optimizer" / "lbfgs.yaml"


def _lbfgs(params, **override) -> torch.optim.LBFGS:
    spec = OmegaConf.to_container(OmegaConf.load(CONFIG))
    assert spec.pop("_target_") == "torch.optim.LBFGS"
    spec.pop("name")
    spec.update(override)
    return torch.optim.LBFGS(params, **spec)


def _run(steps: int, **override) -> list[float]:
    """f(x) = ½·100·x² from x₀ = 0.1 (f₀ = 0.5). torch's first trial step is min(1, 1/|g|)·(−g)
    = −1: it lands at x = −0.9, f = 40.5, so only a line search can find a decrease."""
    x = torch.tensor([0.1], dtype=torch.float64, requires_grad=True)
    opt = _lbfgs([x], **override)

    def closure():
        opt.zero_grad()
        f = 50.0 * (x * x).sum()
        f.backward()
        return f

    values = []
    for _ in range(steps):
        opt.step(closure)
        values.append(float(50.0 * (x.detach() ** 2).sum()))
    return values


def test_config_gives_the_line_search_a_budget():
    assert OmegaConf.load(CONFIG).max_eval > 1


def test_config_lbfgs_converges_where_the_first_trial_overshoots():
    values = _run(10)
    assert values[0] < 0.5  # the first step already decreases f
    assert values[-1] < 1e-10


def test_without_a_budget_lbfgs_stands_still():
    """torch's default max_eval (= 1 for max_iter=1): every step is a zero step here."""
    f0 = 50.0 * 0.1**2
    assert _run(10, max_eval=1) == [f0] * 10


# -- the jaxopt reading (experiments/fosi_tasks/lbfgs_jaxopt.py) ------------------------------------
def _quadratic_closure(opt, x, matrices, b, which):
    def closure():
        opt.zero_grad()
        A = matrices[which[0]]
        f = 0.5 * x @ A @ x - b @ x
        f.backward()
        return f

    return closure


def test_jaxopt_lbfgs_solves_a_quadratic():
    """Full batch: the iterates reach the dense solution A⁻¹b."""
    gen = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(8, 8, generator=gen, dtype=torch.float64))
    A = (Q * torch.logspace(0, 2, 8, dtype=torch.float64)) @ Q.T
    b = torch.randn(8, generator=gen, dtype=torch.float64)
    x = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    opt = JaxoptLBFGS([x], history_size=10)
    closure = _quadratic_closure(opt, x, [A], b, [0])
    for _ in range(40):
        opt.step(closure)
    assert torch.allclose(x.detach(), torch.linalg.solve(A, b), atol=1e-8)


def test_jaxopt_lbfgs_pairs_gradients_of_one_batch():
    """y = g(θ_new) − g(θ) on the step's own batch: for quadratic batches, y = A_batch·s."""
    gen = torch.Generator().manual_seed(1)
    mats = []
    for scale in (1.0, 5.0):
        M = torch.randn(6, 6, generator=gen, dtype=torch.float64)
        mats.append(scale * (M @ M.T + 6 * torch.eye(6, dtype=torch.float64)))
    b = torch.randn(6, generator=gen, dtype=torch.float64)
    x = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    opt = JaxoptLBFGS([x], history_size=5)
    which = [0]
    closure = _quadratic_closure(opt, x, mats, b, which)
    for k in range(4):
        which[0] = k % 2
        opt.step(closure)
        st = opt.state[x]
        assert torch.allclose(st["y"][-1], mats[k % 2] @ st["s"][-1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("on_failure", "moved"), [("last", True), ("best", False)])
def test_jaxopt_lbfgs_failed_line_search(on_failure, moved):
    """One evaluation allowed and the first trial (t = 1 along −g) overshoots: jaxopt takes the
    unsafe step (``last``); ``best`` (torch's rule) stays."""
    x = torch.tensor([0.1], dtype=torch.float64, requires_grad=True)
    opt = JaxoptLBFGS([x], maxls=1, on_failure=on_failure)

    def closure():
        opt.zero_grad()
        f = 50.0 * (x * x).sum()
        f.backward()
        return f

    opt.step(closure)
    assert not opt.state[x]["met"]
    assert float(x.detach()) == pytest.approx(0.1 - 10.0 if moved else 0.1)


def test_jaxopt_lbfgs_refuses_bad_settings():
    x = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match="on_failure"):
        JaxoptLBFGS([x], on_failure="skip")
    with pytest.raises(ValueError, match="c1 < c2"):
        JaxoptLBFGS([x], c1=0.9, c2=0.1)


def test_jaxopt_reading_composes_from_the_lbfgs_config():
    from experiments.fosi_tasks.lbfgs_jaxopt import reading_overrides
    from experiments.runs import compose_config

    opt = compose_config(["experiment=fosi_ae_paper", *reading_overrides(20, "best")]).optimizer
    assert opt["_target_"] == "experiments.fosi_tasks.lbfgs_jaxopt.JaxoptLBFGS"
    assert opt.history_size == 20 and opt.on_failure == "best"
    assert not {"lr", "max_iter", "max_eval", "line_search_fn"} & set(opt.keys())
    kwargs = {k: v for k, v in opt.items() if k not in ("_target_", "name", "grad_clip_value")}  # run keys
    JaxoptLBFGS([torch.zeros(2, requires_grad=True)], **kwargs)  # every key is an argument


def test_jaxopt_backtracking_grows_uncapped_and_takes_the_unsafe_step():
    """jaxopt's earlier search: the first trial is 1.5 × the previous step with no cap; when no
    trial meets the conditions within maxls, the last one is taken (here: f rises)."""
    x = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    opt = JaxoptLBFGS([x], linesearch="backtracking", max_stepsize=math.inf, maxls=2)

    def closure():
        opt.zero_grad()
        f = 0.5 * (x * x).sum()
        f.backward()
        return f

    st = opt.state[x]
    st["stepsize"] = 100.0  # as if earlier steps had grown it: the next trial is 150
    opt.step(closure)
    assert not st["met"] and st["stepsize"] == pytest.approx(150.0 * 0.8)
    assert float(x.detach()) == pytest.approx(1.0 - 120.0)  # d = −g = −1: an unsafe step up the bowl


def test_the_jaxopt_reading_docstring_example_runs():
    import doctest

    from experiments.fosi_tasks import lbfgs_jaxopt

    result = doctest.testmod(lbfgs_jaxopt, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("make", ["torch", "jaxopt_zoom", "jaxopt_backtracking"])
def test_the_loop_logs_each_lbfgs_step_length_and_size(make):
    """The adapter's record of an L-BFGS step: ``ls_step`` is the line search's step length and
    ``step_norm`` the distance the parameters moved (checked against the parameters themselves)."""
    from curvopt.objective import Objective
    from curvopt.training.algorithm import TorchOptimizerAlgorithm

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    x = torch.randn(16, 3, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64) + 0.1
    if make == "torch":
        opt = _lbfgs(model.parameters())
    else:
        opt = JaxoptLBFGS(model.parameters(), linesearch=make.split("_")[1])
    algo = TorchOptimizerAlgorithm(Objective(model, "squared_error"), opt)
    for _ in range(3):
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        info = algo.step((x, y))
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        moved = float(torch.linalg.vector_norm(after - before))
        assert info["ls_step"] > 0.0
        assert info["step_norm"] == pytest.approx(moved, rel=1e-9, abs=1e-12)
        assert moved > 0.0
