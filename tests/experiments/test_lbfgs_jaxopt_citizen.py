"""JaxoptLBFGS (experiments/fosi_tasks/lbfgs_jaxopt.py) as a torch citizen (issue 43): a deep copy
or a pickle continues as the original, and ``lr`` is refused by name unless it is 1.0 (the line
search chooses the step; before, ``lr=`` was an unexpected keyword and a group lr set by a scheduler
was ignored)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from experiments.fosi_tasks.lbfgs_jaxopt import OPTIONS, JaxoptLBFGS

SCALES = torch.tensor([1.0, 10.0, 3.0], dtype=torch.float64)


def _problem(**kw):
    x = torch.nn.Parameter(torch.tensor([3.0, -2.0, 1.0], dtype=torch.float64))
    opt = JaxoptLBFGS([x], history_size=3, **kw)
    return x, opt


def _steps(x, opt, n):
    def closure():
        opt.zero_grad()
        loss = (SCALES * x * x).sum() + (x[0] * x[1]) ** 2
        loss.backward()
        return loss.detach()

    return [float(opt.step(closure)) for _ in range(n)]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_keeps_the_options_and_continues_identically(how):
    """Before: the copy lost every option (torch.optim.Optimizer.__getstate__ keeps only defaults, state
    and param_groups) and its next step raised AttributeError: no attribute 'increase_factor'."""
    x, opt = _problem()
    _steps(x, opt, 2)  # curvature pairs exist
    copier = copy.deepcopy if how == "deepcopy" else (lambda o: pickle.loads(pickle.dumps(o)))
    x_b, opt_b = copier((x, opt))
    assert opt_b.param_groups[0]["params"][0] is x_b
    assert {k: getattr(opt_b, k) for k in OPTIONS} == {k: getattr(opt, k) for k in OPTIONS}
    assert len(opt_b.state[x_b]["s"]) == 2
    assert _steps(x, opt, 3) == _steps(x_b, opt_b, 3)
    assert torch.equal(x, x_b)


@pytest.mark.parametrize("lr", [0.1, 2.0, torch.tensor(0.5), "fast"])
def test_an_lr_other_than_one_is_refused_by_name(lr):
    with pytest.raises(ValueError, match=r"^JaxoptLBFGS: lr=.* is not used: the line search chooses") as err:
        _problem(lr=lr)
    assert "\n" not in str(err.value)


def test_lr_one_is_accepted_and_changes_nothing():
    x, opt = _problem()
    y, opt_lr = _problem(lr=1.0)
    z, opt_t = _problem(lr=torch.tensor(1.0))
    assert _steps(x, opt, 3) == _steps(y, opt_lr, 3) == _steps(z, opt_t, 3)


def test_a_scheduler_changing_lr_is_refused_at_the_step_before_any_change():
    """Before: the group's lr was never read, so a schedule was ignored silently."""
    x, opt = _problem()
    _steps(x, opt, 1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched.step()
    before = x.detach().clone()
    with pytest.raises(ValueError, match=r"lr=0.5 is not used"):
        _steps(x, opt, 1)
    assert torch.equal(x, before)
