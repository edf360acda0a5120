"""Every optimizer of ``curvopt.optim`` as a torch citizen (issue 27).

Modelled on PyTorch's ``OptimizerInfo`` tests (``torch/testing/_internal/common_optimizers.py``,
``test/optim/test_optim.py``) and pytorch-optimizer's suite: one registry entry per export of
:mod:`curvopt.optim` (classes and the documented factories), and one test per property, run over
every entry. Two shapes of optimizer are exported (``curvopt.api``):

* ``torch`` — ``torch.optim.Optimizer``\\ s driven by ``zero_grad / backward / step``: every
  property below applies;
* ``algorithm`` — :class:`~curvopt.api.Algorithm`\\ s driven by ``step(batch)`` (they run their
  own forward/backward): closures, param groups, schedulers and sparse gradients do not exist for
  them, the rest (hyper-parameter validation, state dicts, copies, dtypes, frozen parameters,
  determinism) does.

The entries, their builders and their quirks are the shared case list ``tests/cases.py`` (which
``tests/optim/test_contract.py`` runs through the loop's protocol too). Where a property cannot hold for
an entry by design it is a documented skip (the case's ``skips``, flattened into
``cases.SKIPS``); where it does not hold in code this repository must not patch (the official
GaLore / Fira / APOLLO packages; ``shf.py`` and ``hf_cg.py`` belong to another work stream) it is a
strict xfail (``xfails``, ``cases.XFAILS``), so a fix upstream turns the test red until the case is
updated. Both are checked by :func:`test_exception_tables_are_well_formed`.

Everything runs on tiny models (an MLP of 51 parameters, one intra-op thread): the file takes
about 25 s on two CPU cores. ``torch.compile`` uses the ``eager`` backend (Dynamo's tracing, graph
breaks and guards, where the failures were; no code generation) so that it stays fast; the
``inductor`` variant and the two slowest Dynamo cases are marked ``slow`` (``make test-slow``).
"""

import copy
import doctest
import importlib
import math
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvopt.optim as optim_pkg
from curvopt.api import DataBundle
from curvopt.objective import Objective
from curvopt.optim import lowrank
from tests.cases import (
    ALGORITHMS,
    ALICE,
    BF16,
    EXPORTS,
    F32,
    F64,
    FACTORY_OF,
    FOSI_OPTS,
    FP32_STATE,
    LR,
    NO_EXAMPLE,
    NOT_TORCH,
    PROPERTIES,
    SKIPS,
    XFAILS,
    Case,
    Twin,
    _ese_batch,
    _matrix_groups,
    assert_same,
    batch,
    ce,
    make_data,
    make_model,
    params_of,
    round_trip,
)

ENTRIES: dict[str, Case] = EXPORTS  # one entry per name of curvopt.optim.__all__


# -------------------------------------------------------------------------- the problem
@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add overhead (and the file must stay fast on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -------------------------------------------------------------------------- the registry
def check(name: str, prop: str) -> Case:
    """The entry, after the tables: a documented skip, or a skip for a missing upstream package.

    (Strict xfails are attached as marks by :func:`cases`, so that they run.)
    """
    if (name, prop) in SKIPS:
        pytest.skip(SKIPS[(name, prop)])
    if not ENTRIES[name].available():
        pytest.skip(f"the official {name} package is not installed")
    return ENTRIES[name]


def cases(kinds: tuple[str, ...], props: tuple[str, ...] | str) -> list[Any]:
    """``pytest.param(name, prop)`` for every entry of ``kinds`` and property; xfails marked (strict)."""
    props = (props,) if isinstance(props, str) else props
    out = []
    for e in ENTRIES.values():
        if e.kind not in kinds:
            continue
        for prop in props:
            marks = []
            if (e.name, prop) in XFAILS:
                marks.append(pytest.mark.xfail(reason=XFAILS[(e.name, prop)], strict=True))
            out.append(
                pytest.param(e.name, prop, marks=marks, id=e.name if len(props) == 1 else f"{e.name}-{prop}")
            )
    return out


TORCH, ALGO, BOTH = ("torch",), ("algorithm",), ("torch", "algorithm")


# -------------------------------------------------------------------------- torch helpers
def build(entry: Case, model: nn.Module, params: list[nn.Parameter] | None = None, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return entry.build(model, params_of(model) if params is None else params, **kw)


def train(
    model: nn.Module, opt: Any, steps: int, data=None, start: int = 0, closure: bool = False
) -> list[float]:
    data = make_data(next(model.parameters()).dtype) if data is None else data
    losses = []
    for t in range(start, start + steps):
        xb, yb = batch(data, t)

        def fn(xb=xb, yb=yb):
            opt.zero_grad()
            loss = ce(model(xb), yb)
            loss.backward()
            return loss

        if closure:
            losses.append(float(opt.step(fn).detach()))
        else:
            losses.append(float(fn().detach()))
            opt.step()
    return losses


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def torch_twin(entry: Case) -> Callable[[int, dict[str, Any] | None], Twin]:
    """A round-trip side (cases.round_trip): the net from ``seed`` (then ``weights``) and the optimizer."""

    def make(seed: int, weights: dict[str, Any] | None) -> Twin:
        model = make_model(seed=seed)
        if weights is not None:
            model.load_state_dict(weights)
        opt = build(entry, model)
        return Twin(model, lambda t: train(model, opt, 1, start=t), opt.state_dict, opt.load_state_dict)

    return make


# -------------------------------------------------------------------------- torch properties
@pytest.mark.parametrize("name,prop", cases(TORCH, "step"))
def test_step_moves_every_trained_parameter(name, prop):
    entry = check(name, prop)
    model = make_model()
    opt = build(entry, model)
    assert isinstance(opt, torch.optim.Optimizer)
    before = snapshot(model)
    losses = train(model, opt, 4)
    assert all(math.isfinite(v) for v in losses)
    for p, p0 in zip(model.parameters(), before):
        assert torch.isfinite(p).all() and not torch.equal(p, p0)
    assert opt.step() is None  # without a closure there is no loss to return


@pytest.mark.parametrize("name,prop", cases(BOTH, "closure"))
def test_step_with_closure_returns_the_loss_and_equals_the_plain_step(name, prop):
    entry = check(name, prop)
    model_a, model_b = make_model(), make_model()
    opt_a, opt_b = build(entry, model_a), build(entry, model_b)
    plain = train(model_a, opt_a, 4)
    with_closure = train(model_b, opt_b, 4, closure=True)
    assert plain == with_closure
    assert_same(model_a, model_b)


@pytest.mark.parametrize("name,prop", cases(BOTH, "param_groups_lr0"))
def test_a_group_with_lr_zero_does_not_move(name, prop):
    """Several groups; each in turn gets lr = 0 (after some steps): it stays, the others move."""
    entry = check(name, prop)
    model = make_model()
    opt = build(entry, model)
    assert len(opt.param_groups) >= 2, "the entry's builder should make several groups"
    for i in range(len(opt.param_groups)):
        model_i = make_model()  # a fresh twin (not a deepcopy: that is a property of its own)
        opt_i = build(entry, model_i)
        train(model_i, opt_i, 3)  # state (and FOSI's eigenbasis) exists before the lr drops
        opt_i.param_groups[i]["lr"] = 0.0
        still = {id(p) for p in opt_i.param_groups[i]["params"]}
        before = snapshot(model_i)
        train(model_i, opt_i, 3, start=3)
        for (n, p), p0 in zip(model_i.named_parameters(), before):
            if id(p) in still:
                assert torch.equal(p, p0), f"{n} moved with lr = 0 (group {i})"
            else:
                assert not torch.equal(p, p0), f"{n} did not move (group {i} at lr = 0)"


@pytest.mark.parametrize("name,prop", cases(BOTH, "add_param_group"))
def test_add_param_group_extends_the_optimizer(name, prop):
    entry = check(name, prop)
    model = make_model()
    first = list(model.l1.parameters())
    opt = build(entry, model, first)
    train(model, opt, 2)
    assert entry.add_groups is not None
    n_groups = len(opt.param_groups)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for group in entry.add_groups(list(model.l2.parameters())):
            opt.add_param_group(group)
    assert len(opt.param_groups) > n_groups
    before = snapshot(model)
    train(model, opt, 3, start=2)
    for p, p0 in zip(model.parameters(), before):
        assert torch.isfinite(p).all() and not torch.equal(p, p0)
    for p in model.l2.parameters():
        assert any(p is q for g in opt.param_groups for q in g["params"])
    with pytest.raises(ValueError, match="more than one parameter group|appear in more"):
        opt.add_param_group({"params": [model.l2.bias]})


@pytest.mark.parametrize("name,prop", cases(BOTH, "scheduler_linear"))
def test_step_lr_scales_the_whole_step_by_exactly_its_factor(name, prop):
    """StepLR(gamma=0.1) after some steps: the next update is 0.1 × the update at the old lr (float64)."""
    entry = check(name, prop)
    model = make_model(F64)
    opt = build(entry, model)
    data = make_data(F64)
    train(model, opt, 3, data)  # FOSI: the ESE before step 2 has run
    model_b = make_model(F64)  # a twin in the same state (not a deepcopy: a property of its own)
    opt_b = build(entry, model_b)
    train(model_b, opt_b, 3, data)
    assert_same(model, model_b)
    sched = torch.optim.lr_scheduler.StepLR(opt_b, step_size=1, gamma=0.1)
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": attached mid-run on purpose
        warnings.simplefilter("ignore")
        sched.step()
    assert all(
        g["lr"] == pytest.approx(0.1 * g0["lr"]) for g, g0 in zip(opt_b.param_groups, opt.param_groups)
    )
    before = snapshot(model)
    train(model, opt, 1, data, start=3)
    train(model_b, opt_b, 1, data, start=3)
    for p0, pa, pb in zip(before, model.parameters(), model_b.parameters()):
        torch.testing.assert_close(pb - p0, 0.1 * (pa - p0), rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("name,prop", cases(TORCH, "frozen_and_no_grad"))
def test_frozen_and_gradient_free_parameters_are_untouched(name, prop):
    entry = check(name, prop)
    model = make_model(extra=True)
    opt = build(entry, model)
    idle = {"frozen": model.frozen, "unused": model.unused, "unused_bias": model.unused_bias}
    before = {k: p.detach().clone() for k, p in idle.items()}
    train(model, opt, 5)  # across FOSI's ESE
    for key, p in idle.items():
        assert torch.equal(p, before[key]), f"{key} moved"
        assert p.grad is None, f"{key} got a .grad"
    assert not torch.equal(model.l1.weight, make_model(extra=True).l1.weight)


@pytest.mark.parametrize("name,prop", cases(TORCH, "state_dict"))
def test_state_dict_round_trip_continues_bit_identically(name, prop):
    entry = check(name, prop)

    def layout(sd):
        assert {"state", "param_groups"} <= set(sd), "torch.optim's state_dict layout"

    a, b, _, _ = round_trip(torch_twin(entry), 3, 3, weights_only=False, check_state=layout)
    assert_same(a.model, b.model)
    assert a.state_dict().keys() == b.state_dict().keys()


@pytest.mark.parametrize("name,prop", cases(TORCH, "weights_only"))
def test_state_dict_loads_with_weights_only(name, prop):
    entry = check(name, prop)
    a, b, _, _ = round_trip(torch_twin(entry), 3, 2, weights_only=True)
    assert_same(a.model, b.model)


def _copy_continues(entry: Case, copier: Callable[[Any], Any], steps_before: int) -> None:
    model = make_model()
    opt = build(entry, model)
    train(model, opt, steps_before)
    model_b, opt_b = copier((model, opt))
    assert type(opt_b) is type(opt)
    for group in opt_b.param_groups:  # the copy optimises the copied parameters
        for p in group["params"]:
            assert any(p is q for q in model_b.parameters())
    train(model, opt, 4, start=steps_before)
    train(model_b, opt_b, 4, start=steps_before)
    assert_same(model, model_b)


@pytest.mark.parametrize("steps_before", [0, 3])
@pytest.mark.parametrize("name,prop", cases(TORCH, "deepcopy"))
def test_deepcopy_continues_identically(name, prop, steps_before):
    _copy_continues(check(name, prop), copy.deepcopy, steps_before)


@pytest.mark.parametrize("steps_before", [0, 3])
@pytest.mark.parametrize("name,prop", cases(TORCH, "pickle"))
def test_pickle_continues_identically(name, prop, steps_before):
    _copy_continues(check(name, prop), lambda obj: pickle.loads(pickle.dumps(obj)), steps_before)


@pytest.mark.parametrize("name,prop", cases(TORCH, ("float64", "bfloat16")))
def test_float64_and_bfloat16_parameters(name, prop):
    entry = check(name, prop)
    dtype = {"float64": F64, "bfloat16": BF16}[prop]
    model = make_model(dtype)
    opt = build(entry, model)
    before = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, opt, 5)
    for p, p0 in zip(model.parameters(), before):
        assert p.dtype == dtype and torch.isfinite(p.float()).all() and not torch.equal(p, p0)
    if dtype == F64:  # nothing in the state silently dropped to a lower precision
        for st in opt.state.values():
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1:
                    assert v.dtype == F64 or (name, key) in FP32_STATE, f"state {key!r} is {v.dtype}"


@pytest.mark.parametrize("name,prop", cases(TORCH, "complex"))
def test_complex_parameters_work_or_raise_a_clear_error(name, prop):
    entry = check(name, prop)
    model = make_model(torch.complex64)
    try:
        opt = build(entry, model)
    except (TypeError, ValueError) as err:
        assert "complex" in str(err) or "floating" in str(err), str(err)
        return
    assert entry.supports_complex, f"{name} accepted complex parameters; say how it treats them"
    # accepted: it must act on them as on their real view (torch.view_as_real)
    real = [nn.Parameter(torch.view_as_real(p.detach().clone())) for p in model.parameters()]
    opt_real = entry.build(model, real)
    x = torch.randn(8, 4, dtype=torch.complex64)
    for _ in range(3):
        opt.zero_grad()
        (model(x).abs() ** 2).mean().backward()
        for p, r in zip(model.parameters(), real):
            r.grad = torch.view_as_real(p.grad).clone()
        opt.step()
        opt_real.step()
    for p, r in zip(model.parameters(), real):
        torch.testing.assert_close(torch.view_as_real(p.detach()), r.detach())


@pytest.mark.parametrize("name,prop", cases(TORCH, "invalid_hparams"))
def test_invalid_hyperparameters_raise_value_error_at_construction(name, prop):
    entry = check(name, prop)
    assert entry.invalid, f"{name}: list its invalid settings"
    for bad in entry.invalid:
        with pytest.raises(ValueError):
            build(entry, make_model(), **bad)
            pytest.fail(f"{name} accepted {bad}")


@pytest.mark.parametrize("name,prop", cases(BOTH, "sparse_grad"))
def test_sparse_gradients_raise_a_clear_error_before_any_change(name, prop):
    entry = check(name, prop)
    model = make_model()
    opt = build(entry, model)
    train(model, opt, 3)
    opt.zero_grad()
    ce(model(batch(make_data(), 3)[0]), batch(make_data(), 3)[1]).backward()
    if entry.sparse_supported:  # it must then equal the dense step (torch.optim.SGD's case)
        twin_model, twin = copy.deepcopy((model, opt))
        for p, q in zip(model.parameters(), twin_model.parameters()):
            q.grad = p.grad.clone()  # deepcopy does not copy .grad
        twin.step()
        model.l2.weight.grad = model.l2.weight.grad.to_sparse()
        opt.step()
        for p, q in zip(model.parameters(), twin_model.parameters()):
            torch.testing.assert_close(p, q)
        return
    model.l2.weight.grad = model.l2.weight.grad.to_sparse()
    before = snapshot(model)
    with pytest.raises((RuntimeError, TypeError, ValueError), match="(?i)sparse"):
        opt.step()
    for p, p0 in zip(model.parameters(), before):
        assert torch.equal(p, p0), "a parameter moved before the error"


@pytest.mark.parametrize("name,prop", cases(TORCH, "determinism"))
def test_same_seed_same_result(name, prop):
    entry = check(name, prop)
    runs = []
    for _ in range(2):
        model = make_model(seed=3)
        torch.manual_seed(11)
        opt = build(entry, model)
        train(model, opt, 5)
        runs.append(model)
    assert_same(*runs)


COMPILE_BACKEND = "eager"


def _compile_case(entry: Case, backend: str, warm: int = 4, compiled_steps: int = 1) -> None:
    """Twins run ``warm`` eager steps, then one steps eagerly and the other through ``torch.compile``.

    The compiled update must match the eager one to 1e-4 of its size. Not bitwise: a traced graph
    may reassociate sums, and Adam-type normalisations m/(√v + ε) amplify rounding across many
    steps where v is tiny, so only a few compiled steps from a common state are compared.
    """
    torch._dynamo.reset()
    model_e, model_c = make_model(), make_model()
    opt_e, opt_c = build(entry, model_e), build(entry, model_c)
    train(model_e, opt_e, warm)
    train(model_c, opt_c, warm)
    assert_same(model_e, model_c)
    before = snapshot(model_e)
    compiled = torch.compile(opt_c.step, backend=backend)
    data = make_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(warm, warm + compiled_steps):
            xb, yb = batch(data, t)
            for model, opt, step in ((model_e, opt_e, opt_e.step), (model_c, opt_c, compiled)):
                opt.zero_grad()
                ce(model(xb), yb).backward()
                step()
    for (name, pe), pc, p0 in zip(model_e.named_parameters(), model_c.parameters(), before, strict=True):
        size = float((pe - p0).detach().norm())
        assert size > 0, f"{name} did not move"
        assert float((pc - pe).detach().norm()) <= 1e-4 * size, f"{name}: compiled and eager updates differ"
    torch._dynamo.reset()


# compiled in the slow suite only (a case's ``slow``): FOSI and fosi_adam, where Dynamo traces their
# torch base optimizer (RMSprop, Adam) as well, ~5 s each on two loaded cores; fosi_heavy_ball keeps
# FOSI's own update in the fast suite


def _compile_cases() -> list[Any]:
    out = []
    for case in cases(BOTH, "compile"):
        if "compile" in ENTRIES[case.values[0]].slow:
            case = pytest.param(*case.values, marks=[*case.marks, pytest.mark.slow], id=case.id)
        out.append(case)
    return out


@pytest.mark.parametrize("name,prop", _compile_cases())
def test_torch_compile_of_step(name, prop):
    # FOSI: the compiled step is the one with the ESE (before step 2), which runs eagerly inside it
    # (the case's compile_warm)
    entry = check(name, prop)
    _compile_case(entry, COMPILE_BACKEND, warm=entry.compile_warm)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["MatrixOptimizer", "RACS", "Alice", "fosi_adam", "fosi_heavy_ball"])
def test_torch_compile_of_step_inductor(name):
    entry = check(name, "compile")
    _compile_case(entry, "inductor", warm=entry.compile_warm)


# -------------------------------------------------------------------------- algorithm helpers
def algorithm_problem(entry: Case, dtype: torch.dtype = F32, seed: int = 0, freeze_l1: bool = False):
    model = make_model(dtype, seed=seed)
    if freeze_l1:
        model.l1.requires_grad_(False)
    x, y = make_data(dtype)
    if entry.loss_kind == "squared_error":
        y = F.one_hot(y, 3).to(dtype)
    data = DataBundle(train=(x, y), val=(x[:16], y[:16]))
    return Objective(model, entry.loss_kind), data


def build_algorithm(entry: Case, objective: Objective, data: DataBundle, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return entry.build(objective, data, **kw)


def run_algorithm(alg: Any, data: DataBundle, steps: int, start: int = 0) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(start, start + steps):
            alg.step(batch(data.train, t))


# -------------------------------------------------------------------------- algorithm properties
@pytest.mark.parametrize("name,prop", cases(ALGO, "step"))
def test_algorithm_step_moves_the_model(name, prop):
    entry = check(name, prop)
    objective, data = algorithm_problem(entry)
    alg = build_algorithm(entry, objective, data)
    before = snapshot(objective.model)
    run_algorithm(alg, data, 2)
    assert all(torch.isfinite(p).all() for p in objective.model.parameters())
    assert any(not torch.equal(p, p0) for p, p0 in zip(objective.model.parameters(), before))


@pytest.mark.parametrize("name,prop", cases(ALGO, "state_dict"))
def test_algorithm_state_dict_round_trip_and_weights_only(name, prop):
    entry = check(name, prop)

    def make(seed: int, weights: dict[str, Any] | None) -> Twin:
        objective, data = algorithm_problem(entry, seed=seed)
        if weights is not None:
            objective.model.load_state_dict(weights)
        alg = build_algorithm(entry, objective, data)
        return Twin(
            objective.model,
            lambda t: run_algorithm(alg, data, 1, start=t),
            alg.state_dict,
            alg.load_state_dict,
        )

    a, b, _, _ = round_trip(make, 1, 2, weights_only=True)
    assert_same(a.model, b.model)


@pytest.mark.parametrize("name,prop", cases(ALGO, ("deepcopy", "pickle")))
def test_algorithm_copies_continue_identically(name, prop):
    entry = check(name, prop)
    how = prop
    objective, data = algorithm_problem(entry)
    alg = build_algorithm(entry, objective, data)
    run_algorithm(alg, data, 1)
    copier = copy.deepcopy if how == "deepcopy" else (lambda obj: pickle.loads(pickle.dumps(obj)))
    alg_b = copier(alg)
    model_b = alg_b.objective.model
    assert model_b is not objective.model
    run_algorithm(alg, data, 2, start=1)
    run_algorithm(alg_b, data, 2, start=1)
    assert_same(objective.model, model_b)


@pytest.mark.parametrize("name,prop", cases(ALGO, "determinism"))
def test_algorithm_same_seed_same_result(name, prop):
    entry = check(name, prop)
    models = []
    for _ in range(2):
        objective, data = algorithm_problem(entry, seed=3)
        torch.manual_seed(11)
        run_algorithm(build_algorithm(entry, objective, data), data, 2)
        models.append(objective.model)
    assert_same(*models)


@pytest.mark.parametrize("name,prop", cases(ALGO, ("float64", "bfloat16")))
def test_algorithm_float64_and_bfloat16(name, prop):
    entry = check(name, prop)
    dtype = {"float64": F64, "bfloat16": BF16}[prop]
    objective, data = algorithm_problem(entry, dtype)
    alg = build_algorithm(entry, objective, data)
    before = snapshot(objective.model)
    run_algorithm(alg, data, 3)
    params = list(objective.model.parameters())
    assert all(p.dtype == dtype and torch.isfinite(p.float()).all() for p in params)
    assert any(not torch.equal(p, p0) for p, p0 in zip(params, before))


@pytest.mark.parametrize("name,prop", cases(ALGO, "complex"))
def test_algorithm_complex_parameters_raise_a_clear_error(name, prop):
    entry = check(name, prop)
    model = make_model(torch.complex64)
    x = torch.randn(32, 4, dtype=torch.complex64)
    y = torch.randint(0, 3, (32,)) if entry.loss_kind == "cross_entropy" else torch.randn(32, 3)
    objective, data = Objective(model, entry.loss_kind), DataBundle(train=(x, y), val=(x[:8], y[:8]))
    with pytest.raises((TypeError, ValueError), match="(?i)complex|floating"):
        alg = build_algorithm(entry, objective, data)
        run_algorithm(alg, data, 1)


@pytest.mark.parametrize("name,prop", cases(ALGO, "invalid_hparams"))
def test_algorithm_invalid_hyperparameters_raise_value_error(name, prop):
    entry = check(name, prop)
    assert entry.invalid
    for bad in entry.invalid:
        objective, data = algorithm_problem(entry)
        with pytest.raises(ValueError):
            build_algorithm(entry, objective, data, **bad)
            pytest.fail(f"{name} accepted {bad}")


@pytest.mark.parametrize("name,prop", cases(ALGO, "frozen_and_no_grad"))
def test_algorithm_leaves_frozen_parameters_alone(name, prop):
    entry = check(name, prop)
    objective, data = algorithm_problem(entry, freeze_l1=True)
    alg = build_algorithm(entry, objective, data)
    before = snapshot(objective.model.l1)
    run_algorithm(alg, data, 2)
    for p, p0 in zip(objective.model.l1.parameters(), before):
        assert torch.equal(p, p0) and p.grad is None
    assert not torch.equal(objective.model.l2.weight, make_model().l2.weight)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_algorithm_skips_are_by_design(name):
    """The premise of the documented skips: an Algorithm has no torch.optim.Optimizer interface."""
    for prop in NOT_TORCH:
        assert SKIPS[(name, prop)] == NOT_TORCH[prop]
    objective, data = algorithm_problem(ENTRIES[name])
    alg = build_algorithm(ENTRIES[name], objective, data)
    assert not isinstance(alg, torch.optim.Optimizer)
    assert not hasattr(alg, "param_groups") and not hasattr(alg, "zero_grad")
    assert callable(alg.step) and callable(alg.state_dict) and callable(alg.load_state_dict)


@pytest.mark.parametrize("factory", sorted(FACTORY_OF))
def test_loop_factories_build_their_class(factory):
    """The premise of the factory skips: build_X(objective, data, **cfg) == X(objective, …, **cfg)."""
    cls = getattr(optim_pkg, FACTORY_OF[factory])
    entry = ENTRIES[factory]
    objective, data = algorithm_problem(entry)
    alg = build_algorithm(entry, objective, data)
    assert type(alg) is cls and alg.objective is objective
    objective_b, _ = algorithm_problem(entry)
    direct = build_algorithm(ENTRIES[FACTORY_OF[factory]], objective_b, data)
    run_algorithm(alg, data, 1)
    run_algorithm(direct, data, 1)
    assert_same(objective.model, objective_b.model)


# -------------------------------------------------------------------------- specific regressions
def test_alice0_takes_the_betas_pair_of_its_docstring():
    model = make_model()
    opt = optim_pkg.alice0(_matrix_groups(params_of(model)), lr=LR, betas=(0.8, 0.7), **ALICE)
    assert opt.defaults["betas"] == (0.8, 0.7, 0.0)
    assert optim_pkg.alice0(_matrix_groups(params_of(model)), betas=(0.8, 0.7, 0.99), **ALICE).defaults[
        "betas"
    ] == (0.8, 0.7, 0.0)
    train(model, opt, 3)
    assert "Qt" not in opt.state[model.l1.weight]


def test_fosi_factories_share_one_argument_order():
    """(params, loss_fn, ese_batch, lr=…) for all three; the old HB/GD order (params, lr, loss_fn, …) is refused."""
    results = {}
    for order in ("new_positional", "keywords"):
        model = make_model()
        ese = _ese_batch(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if order == "new_positional":
                opts = [
                    optim_pkg.fosi_heavy_ball(
                        model.parameters(), ce, ese, 0.1, 0.8, model=model, **FOSI_OPTS
                    ),
                ]
            elif order == "keywords":
                opts = [
                    optim_pkg.fosi_heavy_ball(
                        model.parameters(),
                        loss_fn=ce,
                        ese_batch=ese,
                        lr=0.1,
                        momentum=0.8,
                        model=model,
                        **FOSI_OPTS,
                    )
                ]
        deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert not deprecations
        group = opts[0].param_groups[0]
        assert (group["lr"], group["momentum"]) == (0.1, 0.8)
        train(model, opts[0], 4)
        results[order] = model
    assert_same(results["new_positional"], results["keywords"])
    model = make_model()
    for factory in (optim_pkg.fosi_heavy_ball, optim_pkg.fosi_gd):  # the old order: a number as loss_fn
        with pytest.raises(TypeError, match="callable"):
            factory(model.parameters(), 0.1, ce, _ese_batch(model), model=model, **FOSI_OPTS)
    gd_new = optim_pkg.fosi_gd(model.parameters(), ce, _ese_batch(model), lr=0.1, model=model, **FOSI_OPTS)
    assert gd_new.param_groups[0]["lr"] == 0.1
    adam = optim_pkg.fosi_adam(model.parameters(), ce, _ese_batch(model), 0.02, model=model, **FOSI_OPTS)
    assert adam.param_groups[0]["lr"] == 0.02
    with pytest.raises(TypeError, match="callable"):
        optim_pkg.fosi_adam(model.parameters(), "not a loss", _ese_batch(model), model=model)


MSE_SCRIPT = textwrap.dedent(
    """
    import logging, torch, torch.nn.functional as F
    from torch import nn
    from curvopt.optim import fosi_adam, fosi_heavy_ball
    logging.basicConfig(level=logging.WARNING)
    for factory, reuse in ((fosi_heavy_ball, True), (fosi_adam, False)):  # linearize / plain jvp(grad)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        x, y = torch.randn(16, 4), torch.randn(16, 3)
        opt = factory(model.parameters(), F.mse_loss, (x, y), lr=0.05, model=model, k=2,
                      ese_period=2, hvp_reuse=reuse)
        for _ in range(5):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        assert opt.ese_count == 2 and opt.hvp_mode == "reverse_over_reverse", (opt.ese_count, opt.hvp_mode)
        assert all(torch.isfinite(p).all() for p in model.parameters())
    print("MSE-OK")
    """
)


def test_fosi_with_mse_loss_never_crashes_the_process():
    """F.mse_loss under torch.func.linearize segfaults (a torch bug); FOSI probes forward mode first.

    Run in a subprocess: a segmentation fault fails this test instead of killing pytest.
    """
    src = str(Path(optim_pkg.__file__).resolve().parents[2])  # the curvopt under test
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-c", MSE_SCRIPT], capture_output=True, text=True, timeout=300, check=False, env=env
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "MSE-OK" in proc.stdout
    assert "reverse_over_reverse" in proc.stderr  # the fallback is logged


def test_fosi_state_dict_of_the_old_layout_still_loads():
    model = make_model()
    opt = build(ENTRIES["fosi_heavy_ball"], model)
    train(model, opt, 3)
    sd = opt.state_dict()
    old = {"base": {"state": sd["state"], "param_groups": sd["param_groups"]}, "fosi": sd["fosi"]}
    model_b = make_model(seed=7)
    model_b.load_state_dict(model.state_dict())
    opt_b = build(ENTRIES["fosi_heavy_ball"], model_b)
    opt_b.load_state_dict(copy.deepcopy(old))
    train(model, opt, 3, start=3)
    train(model_b, opt_b, 3, start=3)
    assert_same(model, model_b)
    with pytest.raises(ValueError, match="FOSI state dict"):
        opt_b.load_state_dict({"state": {}, "param_groups": sd["param_groups"]})


def test_lowrank_state_loads_weights_only_with_safe_globals():
    """The documented workaround of the upstream weights_only gap."""
    for method in ("galore", "fira", "apollo"):
        if not lowrank.official_available(method):
            continue
        a, b, _, _ = round_trip(
            torch_twin(ENTRIES[method]), 3, 2, weights_only=True, safe_globals=lowrank.state_globals(method)
        )
        assert_same(a.model, b.model)


# -------------------------------------------------------------------------- docs and tables
DOCTEST_MODULES = (
    "matrix",
    "racs",
    "alice",
    "fosi.optimizer",
    "fosi.factories",
    "fosi_adapter",
    "kfac",
    "fgn",
    "sgn",
    "lowrank",
    "grouping",
)


@pytest.mark.parametrize("module", DOCTEST_MODULES)
def test_docstring_examples_run(module):
    if module == "lowrank" and not all(lowrank.official_available(m) for m in ("galore", "fira", "apollo")):
        pytest.skip("the official GaLore/Fira/APOLLO packages are not installed")
    mod = importlib.import_module(f"curvopt.optim.{module}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize("name", sorted(optim_pkg.__all__))
def test_every_public_optimizer_documents_its_loop(name):
    if name in NO_EXAMPLE:
        pytest.skip(NO_EXAMPLE[name])
    doc = getattr(optim_pkg, name).__doc__ or ""
    assert ">>>" in doc, f"{name}'s docstring has no runnable example"
    if ENTRIES[name].kind == "torch":
        for call in (".zero_grad()", ".backward()", ".step("):
            assert call in doc, f"{name}'s example lacks {call}"
    else:
        assert ".step((" in doc or ".step((x" in doc, f"{name}'s example lacks step(batch)"


def test_exception_tables_are_well_formed():
    """Every export has an entry; every skip/xfail names a known entry and property and gives a reason."""
    assert set(ENTRIES) == set(optim_pkg.__all__)
    known = set(PROPERTIES)
    for table in (SKIPS, XFAILS):
        for (name, prop), reason in table.items():
            assert name in ENTRIES and prop in known, (name, prop)
            assert isinstance(reason, str) and len(reason) > 20
    assert not set(SKIPS) & set(XFAILS)
    for name in NO_EXAMPLE:
        assert name in ENTRIES


# -------------------------------------------------------------------------- more torch citizenship (issue 43)
# Properties added after issue 43's conformance pass. Their documented skips live here (tests/cases.py
# is shared with the contract suite); test_more_exception_tables_are_well_formed checks them, and
# the tests named in a skip's reason check its premise. Torch optimizers: tensor hyper-parameters,
# torch.optim's flags, state-dict hooks, reordered groups, zero_grad(set_to_none=False), step hooks,
# 0-d and 1-d parameters, extreme gradient scales, autocast + GradScaler (amp). Algorithms (every
# export, the loop factories included): tensor hyper-parameters, one frozen parameter inside a
# trained layer, mixed float32/float64 parameters (FGN, SGN, K-FAC train them as the float64 twin;
# SHF, HF-CG and FOSI refuse them up front), parameters on the meta device (refused when built).
MORE_TORCH = (
    "tensor_hparams",
    "flags",
    "state_dict_hooks",
    "reordered_groups",
    "zero_grad_keep",
    "step_hooks",
    "tiny_shapes",
    "grad_scale",
    "amp",
)
MORE_ALGO = ("tensor_hparams", "frozen_param", "mixed_dtype", "meta")
FOSI_FAMILY = ("FOSI", "fosi_adam", "fosi_heavy_ball", "fosi_gd")
UPSTREAM_LOWRANK = ("galore", "fira", "apollo")
UPSTREAM_NOT_OURS = "the official {} package's optimizer is not our code (curvopt.optim.lowrank wraps it): {}"
TORCH_SGD = "make_base_optimizer returns torch.optim.SGD unchanged: {} (torch's behaviour, not ours)"
MORE_SKIPS: dict[tuple[str, str], str] = {
    **{
        (name, "reordered_groups"): UPSTREAM_NOT_OURS.format(
            name, "it inherits torch.optim's by-position load_state_dict"
        )
        for name in UPSTREAM_LOWRANK
    },
    ("make_base_optimizer", "tensor_hparams"): TORCH_SGD.format(
        "torch.optim.SGD accepts lr=tensor(nan) and lr=inf (test_torch_sgd_accepts_a_nan_tensor_lr)"
    ),
    ("make_base_optimizer", "reordered_groups"): TORCH_SGD.format(
        "its load_state_dict matches groups by position and checks only their sizes "
        "(test_torch_sgd_loads_reordered_groups_by_position)"
    ),
}


def check_more(name: str, prop: str) -> Case:
    if (name, prop) in MORE_SKIPS:
        pytest.skip(MORE_SKIPS[(name, prop)])
    if not ENTRIES[name].available():
        pytest.skip(f"the official {name} package is not installed")
    return ENTRIES[name]


def more_cases(kinds: tuple[str, ...], prop: str) -> list[Any]:
    return [pytest.param(e.name, prop, id=e.name) for e in ENTRIES.values() if e.kind in kinds]


def _loss_step(model: nn.Module, opt: Any, t: int, sign: float = 1.0, set_to_none: bool = True) -> None:
    xb, yb = batch(make_data(next(model.parameters()).dtype), t)
    opt.zero_grad(set_to_none=set_to_none)
    (sign * ce(model(xb), yb)).backward()
    opt.step()


@pytest.mark.parametrize("name,prop", more_cases(TORCH, "tensor_hparams"))
def test_a_tensor_lr_steps_like_the_float_and_a_nan_one_is_refused(name, prop):
    entry = check_more(name, prop)
    model_a, model_b = make_model(), make_model()
    opt_a, opt_b = build(entry, model_a), build(entry, model_b, lr=torch.tensor(LR, dtype=F64))
    train(model_a, opt_a, 4)
    train(model_b, opt_b, 4)
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
    for bad in (math.nan, -1.0, math.inf):
        with pytest.raises(ValueError, match="(?i)lr|learning rate"):
            build(entry, make_model(), lr=torch.tensor(bad))


@pytest.mark.parametrize("name,prop", more_cases(ALGO, "tensor_hparams"))
def test_algorithm_tensor_hyperparameters_are_checked_by_value(name, prop):
    entry = check_more(name, prop)
    key = next(iter(entry.invalid[0]))  # its first invalid setting names a step size or damping
    objective, data = algorithm_problem(entry)
    with pytest.raises(ValueError, match=key):
        build_algorithm(entry, objective, data, **{key: torch.tensor(math.nan)})
    good = entry.progress.overrides.get(key, 1.0)
    if isinstance(good, str):
        good = 1.0
    alg = build_algorithm(entry, objective, data, **{key: torch.tensor(float(good))})
    run_algorithm(alg, data, 1)
    assert all(torch.isfinite(p).all() for p in objective.model.parameters())


@pytest.mark.parametrize("name,prop", more_cases(TORCH, "flags"))
def test_maximize_foreach_differentiable_are_supported_or_refused(name, prop):
    """torch.optim's flags: a flag is either honoured or refused by name at construction, never ignored."""
    entry = check_more(name, prop)
    for flag in ("maximize", "foreach", "differentiable"):
        try:
            opt = build(entry, make_model(), **{flag: True})
        except (TypeError, ValueError) as err:
            assert flag in str(err), str(err)
            continue
        model, model_ref = make_model(F64), make_model(F64)  # float64: no rounding amplified by a refresh
        opt = build(entry, model, **{flag: True})
        if flag == "maximize":  # maximising the loss = minimising its negative
            opt_ref = build(entry, model_ref)
            for t in range(3):
                _loss_step(model, opt, t)
                _loss_step(model_ref, opt_ref, t, sign=-1.0)
        else:  # the same maths as the default
            opt_ref = build(entry, model_ref, **{flag: False})
            for t in range(3):
                _loss_step(model, opt, t)
                _loss_step(model_ref, opt_ref, t)
        for p, q in zip(model.parameters(), model_ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{flag}=True")


@pytest.mark.parametrize("name,prop", more_cases(TORCH, "state_dict_hooks"))
def test_state_dict_hooks_are_called(name, prop):
    entry = check_more(name, prop)
    model = make_model()
    opt = build(entry, model)
    train(model, opt, 3)
    calls: list[str] = []

    def post(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
        calls.append("post")
        sd["param_groups"][0]["marker"] = 1
        return sd

    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(post)
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    sd = opt.state_dict()
    assert sd["param_groups"][0].get("marker") == 1 or any(
        isinstance(v, dict) and v.get("param_groups", [{}])[0].get("marker") == 1 for v in sd.values()
    )
    opt.load_state_dict(sd)
    assert calls == ["pre", "post", "load_pre", "load_post"], calls
    train(model, opt, 2, start=3)


@pytest.mark.parametrize("name,prop", more_cases(TORCH, "reordered_groups"))
def test_a_state_dict_with_reordered_groups_is_refused(name, prop):
    """torch.optim maps saved groups to the optimizer's by position: a reordered optimizer would apply one
    group's state to another's parameters. Refused by name, before anything is loaded."""
    entry = check_more(name, prop)
    model = make_model()
    opt = build(entry, model)
    train(model, opt, 3)
    sd = opt.state_dict()
    opt_b = build(entry, make_model())
    assert len(opt_b.param_groups) >= 2
    opt_b.param_groups.reverse()
    with pytest.raises(ValueError, match="(?i)group"):
        opt_b.load_state_dict(copy.deepcopy(sd))
    assert not opt_b.state


@pytest.mark.parametrize("name,prop", more_cases(TORCH, "zero_grad_keep"))
def test_zero_grad_without_none_gives_the_same_steps(name, prop):
    entry = check_more(name, prop)
    model_a, model_b = make_model(), make_model()
    opt_a, opt_b = build(entry, model_a), build(entry, model_b)
    for t in range(4):
        _loss_step(model_a, opt_a, t)
        _loss_step(model_b, opt_b, t, set_to_none=False)
    assert_same(model_a, model_b)
    opt_b.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model_b.parameters())


@pytest.mark.parametrize("name,prop", more_cases(TORCH, "step_hooks"))
def test_step_pre_and_post_hooks_run_around_every_step(name, prop):
    entry = check_more(name, prop)
    model = make_model()
    opt = build(entry, model)
    calls: list[str] = []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    post = opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    train(model, opt, 3)
    assert calls == ["pre", "post"] * 3, calls
    pre.remove()
    post.remove()
    train(model, opt, 1, start=3)
    assert len(calls) == 6


class ShapesNet(nn.Module):
    """The tiny net with a 0-d scale and a 1-d shift on its output."""

    def __init__(self) -> None:
        super().__init__()
        net = make_model()
        self.l1, self.l2 = net.l1, net.l2
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.shift = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x))) * self.scale + self.shift


@pytest.mark.parametrize("name,prop", more_cases(TORCH, "tiny_shapes"))
def test_zero_and_one_dimensional_parameters_are_trained(name, prop):
    entry = check_more(name, prop)
    model = ShapesNet()
    opt = build(entry, model)
    before = snapshot(model)
    train(model, opt, 4)
    for (key, p), p0 in zip(model.named_parameters(), before):
        assert p.shape == p0.shape and torch.isfinite(p).all(), key
        assert not torch.equal(p, p0), f"{key} did not move"


@pytest.mark.parametrize("name,prop", more_cases(TORCH, "grad_scale"))
@pytest.mark.parametrize("scale", [1e30, 1e-30])
def test_extreme_gradient_scales_step_finitely_or_are_refused_unchanged(name, prop, scale):
    """Gradients ×1e30 (finite in float32) and ×1e-30: finite parameters, or a clear error before any change."""
    from curvopt.errors import NonFiniteError

    entry = check_more(name, prop)
    model = make_model()
    opt = build(entry, model)
    train(model, opt, 3)  # state (and FOSI's eigenbasis) exists
    xb, yb = batch(make_data(), 3)
    opt.zero_grad()
    ce(model(xb), yb).backward()
    for p in model.parameters():
        p.grad.mul_(scale)
    before = snapshot(model)
    try:
        opt.step()
        if hasattr(opt, "raise_if_nonfinite"):
            opt.raise_if_nonfinite()
    except (NonFiniteError, FloatingPointError, ValueError) as err:
        assert "\n" not in str(err).strip() and len(str(err)) > 30
        for p, p0 in zip(model.parameters(), before):
            assert torch.equal(p, p0), "a parameter moved before the error"
        return
    for key, p in model.named_parameters():
        assert torch.isfinite(p).all(), f"{key} is not finite after a step with gradients ×{scale:g}"


def _amp_step(model: nn.Module, opt: Any, t: int, scaler: Any = None, poison: bool = False) -> None:
    """One step of the mixed-precision recipe: a bf16 autocast forward (float32 parameters), then
    ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` (or a plain step)."""
    xb, yb = batch(make_data(), t)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=BF16):
        loss = ce(model(xb), yb)
    if scaler is None:
        loss.backward()
        opt.step()
        return
    scaler.scale(loss).backward()
    if poison:  # an overflowed gradient, as fp16 training meets: the scaler must skip the step
        model.l1.weight.grad[0, 0] = math.inf
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("name,prop", more_cases(TORCH, "amp"))
def test_autocast_and_grad_scaler_flow(name, prop):
    """torch.amp's recipe on the CPU: the autocast (bfloat16) forward trains the float32 parameters, the
    GradScaler's step equals the unscaled one (a power-of-two scale is exact), and a step whose
    gradients overflowed is skipped whole (the optimizer's state untouched) while the scale halves."""
    entry = check_more(name, prop)
    model_a, model_b = make_model(), make_model()
    opt_a, opt_b = build(entry, model_a), build(entry, model_b)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    before = snapshot(model_b)
    for t in range(4):  # across FOSI's ESE
        _amp_step(model_a, opt_a, t)
        _amp_step(model_b, opt_b, t, scaler)
    for (key, pa), pb, p0 in zip(model_a.named_parameters(), model_b.parameters(), before):
        assert pb.dtype == F32 and torch.isfinite(pb).all() and not torch.equal(pb, p0), key
        torch.testing.assert_close(
            pb, pa, rtol=1e-5, atol=1e-6, msg=f"{key}: scaled and unscaled steps differ"
        )
    state = copy.deepcopy(opt_b.state_dict())
    weights = snapshot(model_b)
    _amp_step(model_b, opt_b, 4, scaler, poison=True)
    assert scaler.get_scale() == 2.0**9
    for (key, p), p0 in zip(model_b.named_parameters(), weights):
        assert torch.equal(p, p0), f"{key} moved in a step the scaler skipped"
    assert_same_state(opt_b.state_dict(), state)
    _amp_step(model_b, opt_b, 5, scaler)  # and training goes on
    assert all(torch.isfinite(p).all() for p in model_b.parameters())


def assert_same_state(a: Any, b: Any, path: str = "state") -> None:
    """Two state dicts hold equal values (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    elif hasattr(a, "__dict__") and not callable(a):  # upstream projector objects: by their fields
        assert type(a) is type(b), path
        assert_same_state(vars(a), vars(b), f"{path}.__dict__")
    else:
        assert a == b, path


@pytest.mark.parametrize("name,prop", more_cases(ALGO, "frozen_param"))
def test_algorithm_trains_around_one_frozen_parameter(name, prop):
    """One frozen parameter inside a trained layer (l1's bias; its weight trains): it stays, gets no
    .grad, and every other parameter moves (the factories too: each is a different entry point)."""
    entry = check_more(name, prop)
    objective, data = algorithm_problem(entry)
    model = objective.model
    model.l1.bias.requires_grad_(False)
    alg = build_algorithm(entry, objective, data)
    before = snapshot(model)
    run_algorithm(alg, data, 2)
    for (key, p), p0 in zip(model.named_parameters(), before):
        assert torch.isfinite(p).all(), key
        if key == "l1.bias":
            assert torch.equal(p, p0) and p.grad is None, "the frozen l1.bias moved or got a .grad"
        else:
            assert not torch.equal(p, p0), f"{key} did not move"


class MixedNet(nn.Module):
    """The tiny net with its first layer in ``first`` and its second in ``second`` (casts between)."""

    def __init__(self, first: torch.dtype = F32, second: torch.dtype = F64) -> None:
        super().__init__()
        net = make_model()
        self.l1 = net.l1.to(first)
        self.l2 = net.l2.to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x.to(self.l1.weight.dtype))).to(self.l2.weight.dtype))


@pytest.mark.parametrize("name,prop", more_cases(ALGO, "mixed_dtype"))
def test_algorithm_mixed_float32_float64_parameters_are_supported_or_refused_up_front(name, prop):
    """float32 and float64 parameters in one model: refused at construction with one line naming the
    dtypes and what to do, or trained as the all-float64 twin is (to float32 rounding), each parameter
    keeping its dtype."""
    entry = check_more(name, prop)
    mixed, twin = MixedNet(F32, F64), MixedNet(F64, F64)
    data = algorithm_problem(entry, F64)[1]
    objective = Objective(mixed, entry.loss_kind)
    before = snapshot(mixed)
    try:
        alg = build_algorithm(entry, objective, data)
    except (TypeError, ValueError) as err:
        msg = str(err)
        assert "\n" not in msg and "float32" in msg and "float64" in msg, msg
        assert "model.float()" in msg or "model.double()" in msg, f"say what to do: {msg}"
        return
    run_algorithm(alg, data, 2)
    run_algorithm(build_algorithm(entry, Objective(twin, entry.loss_kind), data), data, 2)
    for (key, p), q, p0 in zip(mixed.named_parameters(), twin.parameters(), before):
        assert p.dtype == p0.dtype and torch.isfinite(p).all() and not torch.equal(p, p0), key
        torch.testing.assert_close(p.double(), q, rtol=1e-3, atol=1e-4, msg=f"{key} differs from float64")


@pytest.mark.parametrize("name,prop", more_cases(ALGO, "meta"))
def test_algorithm_meta_parameters_are_refused_at_construction(name, prop):
    """A model on the meta device (built for its shapes only) has no values to step: refused by name
    when the Algorithm is built, not inside its first step with torch's device error."""
    entry = check_more(name, prop)
    objective, data = algorithm_problem(entry)
    objective.model.to("meta")
    with pytest.raises((TypeError, ValueError), match="meta device") as err:
        build_algorithm(entry, objective, data)
    assert "\n" not in str(err.value) and "materialise" in str(err.value)


def test_more_exception_tables_are_well_formed():
    for (name, prop), reason in MORE_SKIPS.items():
        assert name in ENTRIES and prop in MORE_TORCH + MORE_ALGO, (name, prop)
        assert isinstance(reason, str) and len(reason) > 20


def test_torch_sgd_loads_reordered_groups_by_position():
    """The premise of make_base_optimizer's reordered_groups skip: torch.optim.SGD does not refuse it."""
    model = make_model()
    opt = build(ENTRIES["make_base_optimizer"], model)
    train(model, opt, 2)
    opt_b = build(ENTRIES["make_base_optimizer"], make_model())
    opt_b.param_groups.reverse()
    opt_b.load_state_dict(opt.state_dict())  # no error: the matrices' momenta now sit on the biases
    bias = opt_b.param_groups[0]["params"][0]
    assert bias.dim() == 1 and opt_b.state[bias]["momentum_buffer"].dim() == 2


def test_torch_sgd_accepts_a_nan_tensor_lr():
    """The premise of make_base_optimizer's tensor_hparams skip (torch's check, not ours)."""
    params = [nn.Parameter(torch.zeros(2))]
    torch.optim.SGD(params, lr=torch.tensor(math.nan), momentum=0.9)
    torch.optim.SGD(params, lr=math.inf, momentum=0.9)
