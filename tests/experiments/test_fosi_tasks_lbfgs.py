"""The FOSI tasks' L-BFGS baseline (conf/optimizer/lbfgs.yaml) takes steps: its line search has a
budget (decisions FOSI-X). torch.optim.LBFGS with max_iter=1 and the default max_eval gives the
strong-Wolfe search no evaluation, so a step whose first trial raises the loss is a zero step."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from experiments.runs import REPO_ROOT

CONFIG = REPO_ROOT / "conf" / "optimizer" / "lbfgs.yaml"


def _lbfgs(x: torch.Tensor, **override) -> torch.optim.LBFGS:
    spec = OmegaConf.to_container(OmegaConf.load(CONFIG))
    assert spec.pop("_target_") == "torch.optim.LBFGS"
    spec.pop("name")
    spec.update(override)
    return torch.optim.LBFGS([x], **spec)


def _run(steps: int, **override) -> list[float]:
    """f(x) = ½·100·x² from x₀ = 0.1 (f₀ = 0.5). torch's first trial step is min(1, 1/|g|)·(−g)
    = −1: it lands at x = −0.9, f = 40.5, so only a line search can find a decrease."""
    x = torch.tensor([0.1], dtype=torch.float64, requires_grad=True)
    opt = _lbfgs(x, **override)

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
