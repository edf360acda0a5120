"""The one case list of the optimizer tests: a record per method, its builder and its known limits.

Modelled on curvlinops' ``test/cases.py`` (one list of cases, every test parametrised over it)
and optax's ``_common_test.py`` (one contract run over every optimizer). A :class:`Case` is

* a name: every export of :mod:`curvopt.optim` (``curvopt.optim.__all__``) and every
  :class:`~curvopt.api.Algorithm` implementation in ``src/curvopt`` (the loop's
  :class:`~curvopt.training.algorithm.TorchOptimizerAlgorithm` included, once as the loop builds it
  and once around ``torch.optim.LBFGS``, its closure path);
* a factory: ``build(module, params, **overrides)`` for ``torch.optim.Optimizer``\\ s (``kind ==
  "torch"``) and ``build(objective, data, **overrides)`` for ``Algorithm``\\ s (``kind ==
  "algorithm"``); :func:`make_algorithm` gives the ``Algorithm`` the training loop steps for
  either (a torch optimizer wrapped in ``TorchOptimizerAlgorithm``, as ``build_algorithm`` does);
* what the tests need to know about it: invalid settings, how to add parameter groups, the steps,
  learning rate and tolerance the contract's clauses need (:class:`Progress`);
* its documented limitations, as data: ``needs_closure``, ``supports_complex``,
  ``sparse_supported``, and per property a ``skips`` reason (cannot hold by design) or an
  ``xfails`` reason (does not hold in code this repository must not patch; strict).

Two suites read it: ``tests/optim/test_optim_conformance.py`` (every export as a torch citizen: the
properties :data:`PROPERTIES`) and ``tests/optim/test_contract.py`` (every case through the loop's
protocol: the clauses :data:`CLAUSES`). Shared code lives here: the tiny problems, the builders and
:func:`round_trip` (a state-dict round trip, used by both suites).
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import curvopt.optim as optim_pkg
from curvopt.api import DataBundle
from curvopt.objective import Objective, mean_loss
from curvopt.optim import lowrank
from curvopt.training.algorithm import TorchOptimizerAlgorithm

LR = 0.05
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
NAN, INF = math.nan, math.inf

# the properties of the conformance suite and the clauses of the contract (the keys of a case's
# skips / xfails)
PROPERTIES = (
    "step",
    "closure",
    "param_groups_lr0",
    "add_param_group",
    "scheduler_linear",
    "frozen_and_no_grad",
    "state_dict",
    "weights_only",
    "deepcopy",
    "pickle",
    "float64",
    "bfloat16",
    "complex",
    "invalid_hparams",
    "sparse_grad",
    "determinism",
    "compile",
)
CLAUSES = ("finite_step", "round_trip", "progress")


# -------------------------------------------------------------------------- the tiny problems
class TinyNet(nn.Module):
    """4 → 6 → 3 MLP (51 parameters); ``extra`` adds a frozen matrix and two parameters the loss never uses."""

    def __init__(self, dtype: torch.dtype = F32, extra: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 6, dtype=dtype)
        self.l2 = nn.Linear(6, 3, dtype=dtype)
        if extra:
            self.frozen = nn.Parameter(torch.randn(5, 3, dtype=dtype), requires_grad=False)
            self.unused = nn.Parameter(torch.randn(3, 5, dtype=dtype))
            self.unused_bias = nn.Parameter(torch.randn(5, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def make_data(dtype: torch.dtype = F32, n: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and random labels (nothing to learn: the conformance suite only moves weights)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen).to(dtype)
    y = torch.randint(0, 3, (n,), generator=gen)
    return x, y


def make_model(dtype: torch.dtype = F32, extra: bool = False, seed: int = 0) -> TinyNet:
    """The net with parameters drawn from a generator seeded with ``seed``.

    (Not ``torch.manual_seed``: it seeds every accelerator backend lazily, ~3 ms a call.)
    """
    model = TinyNet(dtype, extra)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((0.5 * torch.randn(p.shape, generator=gen, dtype=F64)).to(dtype))
    return model


def batch(
    data: tuple[torch.Tensor, torch.Tensor], t: int, size: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data
    i = (t * size) % x.shape[0]
    return x[i : i + size], y[i : i + size]


def matrices(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in params if p.dim() == 2]


def vectors(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in params if p.dim() != 2]


def params_of(model: nn.Module) -> list[nn.Parameter]:
    return list(model.parameters())


def ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, in float32 for bf16 outputs (float64 stays float64)."""
    return F.cross_entropy(out if out.dtype == F64 else out.float(), y)


def learnable_problem(loss_kind: str, n: int = 64, seed: int = 5) -> DataBundle:
    """A problem :class:`TinyNet` can fit (the contract's progress clause).

    ``cross_entropy``: labels of a random linear teacher (separable classes); ``squared_error``:
    targets ``0.8·tanh(x A)`` of a random teacher (SHF-LSMR's least-squares objective).
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n + 16, 4, generator=gen)
    teacher = 2.0 * torch.randn(4, 3, generator=gen)
    if loss_kind == "cross_entropy":
        y = (x @ teacher).argmax(dim=1)
    elif loss_kind == "squared_error":
        y = 0.8 * torch.tanh(x @ teacher / 2.0)
    else:
        raise ValueError(f"no learnable problem for loss {loss_kind!r}")
    return DataBundle(train=(x[:n], y[:n]), val=(x[n:], y[n:]))


def full_loss(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], loss_kind: str) -> float:
    """The mean loss of ``model`` on a whole split."""
    x, y = data
    with torch.no_grad():
        return float(mean_loss(model(x), y, loss_kind))


# -------------------------------------------------------------------------- the record
@dataclass(frozen=True)
class Progress:
    """What the contract's progress clause needs: ``steps`` steps (with ``overrides`` of the
    builder's defaults) bring the full-batch loss of :func:`learnable_problem` below ``fraction``
    of its start."""

    steps: int = 40
    fraction: float = 0.5
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """One optimizer or ``Algorithm``: how to build it, and its documented limits.

    ``build(module, params, **overrides)`` for ``kind == "torch"`` (``module`` owns ``params``;
    model-level factories use ``module`` only), ``build(objective, data, **overrides)`` for
    ``kind == "algorithm"``.

    Limits as data: ``skips`` maps a property (:data:`PROPERTIES`) or clause (:data:`CLAUSES`) that
    cannot hold by design to the reason; ``xfails`` one that does not hold in code this
    repository must not patch (a strict xfail, so that a fix upstream turns the test red).
    """

    name: str
    kind: str  # "torch" | "algorithm"
    build: Callable[..., Any]
    add_groups: Callable[[list[nn.Parameter]], list[dict[str, Any]]] | None = None
    invalid: list[dict[str, Any]] = field(default_factory=list)
    loss_kind: str = "cross_entropy"
    exported: bool = True  # a name of curvopt.optim.__all__ (else: an Algorithm found in src/curvopt)
    algorithm: str | None = None  # the class of the Algorithm build returns (kind == "algorithm")
    factory_of: str | None = None  # a one-line loop factory of this exported class
    needs_closure: bool = False  # step needs the closure (torch.optim.LBFGS)
    supports_complex: bool = False  # complex params work, as torch.view_as_real would
    sparse_supported: bool = False  # sparse gradients work (and equal the dense step)
    upstream: str | None = None  # official package it wraps (lowrank.official_available)
    skips: dict[str, str] = field(default_factory=dict)
    xfails: dict[str, str] = field(default_factory=dict)
    slow: tuple[str, ...] = ()  # properties run in the slow suite only
    compile_warm: int = 4  # eager steps before the compiled one
    fp32_state: dict[str, str] = field(default_factory=dict)  # state kept in float32 on purpose
    no_example: str | None = None  # why the docstring has no runnable example
    # what step's "loss" is: the mean loss before the update on the "batch", or on the "train" split
    reported_loss: str = "batch"
    round_trip_steps: int = 2  # steps before the contract's checkpoint
    round_trip_atol: float = 0.0  # 0: bit-identical continuation
    progress: Progress = field(default_factory=Progress)

    def available(self) -> bool:
        """Whether the official package behind the case (if any) is installed."""
        return self.upstream is None or lowrank.official_available(self.upstream)


# -------------------------------------------------------------------------- documented limits
ALGORITHM = "an Algorithm (step(batch) runs its own forward/backward), not a torch.optim.Optimizer: "
NOT_TORCH = {
    "closure": ALGORITHM + "no closure argument",
    "param_groups_lr0": ALGORITHM + "no parameter groups",
    "add_param_group": ALGORITHM + "no parameter groups",
    "scheduler_linear": ALGORITHM + "no param_groups for an LR scheduler (lr is a constructor option)",
    "sparse_grad": ALGORITHM + "gradients are computed inside step, always dense",
    "compile": ALGORITHM + "step(batch) is host-synchronising Python (CG/LSMR loops, line searches); "
    "FGN has its own compile=True flag for the closed-form solve (tests/optim/test_fgn_solvers.py)",
}
SAME_CLASS = (
    "returns an instance of a class compiled under its own entry ({}); compiling it again adds only time"
)
FACTORY = (
    "{0}(objective, data, **cfg) is {1}(objective[, data], **cfg), a one-line loop factory "
    "(test_loop_factories_build_their_class checks it); the property is tested on {1}"
)
FACTORY_PROPS = (
    "state_dict",
    "deepcopy",
    "pickle",
    "determinism",
    "float64",
    "bfloat16",
    "frozen_and_no_grad",
    "round_trip",
    "progress",
)


def _factory_skips(factory: str, cls: str) -> dict[str, str]:
    return {prop: FACTORY.format(factory, cls) for prop in FACTORY_PROPS}


UPSTREAM_COMPILE = (
    "upstream {}'s step ({}, Python-side state objects) is not our code; compiling it is upstream's concern"
)
UPSTREAM_CLOSURE = (
    "upstream step is @torch.no_grad() and calls the closure without torch.enable_grad(), so a closure "
    "that calls backward() fails (documented in curvopt.optim.lowrank; wrap the closure's body in "
    "torch.enable_grad())"
)
UPSTREAM_WEIGHTS_ONLY = (
    "the state holds upstream projector objects, which torch.load(weights_only=True) refuses; "
    "torch.serialization.safe_globals(curvopt.optim.lowrank.state_globals(method)) allows them "
    "(test_lowrank_state_loads_weights_only_with_safe_globals)"
)
UPSTREAM_SPARSE = (
    "upstream raises on the sparse gradient only when it reaches that parameter, after updating the "
    "groups before it (its Adam group comes first): a clear error, but not before any change"
)
UPSTREAM_APOLLO_ATTRS = (
    "upstream APOLLO keeps scale_front/disable_nl as instance attributes, which torch.optim.Optimizer's "
    "__getstate__ drops: the copy fails at its next step (AttributeError). Copy through state_dict instead"
)
UPSTREAM_XFAILS = {
    "closure": UPSTREAM_CLOSURE,
    "weights_only": UPSTREAM_WEIGHTS_ONLY,
    "sparse_grad": UPSTREAM_SPARSE,
}
SHF_WORK_STREAM = "{} belongs to the SHF work stream (not edited here)"

# state kept in float32 for float64 parameters on purpose
QT_FP32 = (
    "Alice's Q̃ defaults to qtilde_dtype='float32' (docs/alice.md); qtilde_dtype=None follows the parameters"
)


# -------------------------------------------------------------------------- builders
def _matrix_groups(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    groups = [{"params": matrices(params)}, {"params": vectors(params), "adam": True}]
    return [g for g in groups if g["params"]]


ALICE = {"rank": 2, "update_interval": 2, "leading": 1}
# one ESE, before step 2 (copies, loads and lr changes are tested on both sides of it);
# hvp_reuse=False: the linearised product costs a torch.fx trace (~0.5 s) per ESE, and the
# products are the same maths (tests/optim/test_fosi_optimizer.py covers the default path)
FOSI_OPTS = {"k": 2, "ese_period": None, "ese_warmup": 2, "hvp_reuse": False}
FOSI_DATA = make_data()


def _fosi_kw(module: nn.Module, kw: dict[str, Any]) -> dict[str, Any]:
    return {"model": module, **FOSI_OPTS, **kw}


def _ese_batch(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = next(module.parameters()).dtype
    x, y = FOSI_DATA
    return x.to(dtype), y


def _split(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    """Two parameter groups, matrices and vectors (FOSI's base and torch's own optimizers)."""
    return [g for g in ({"params": matrices(params)}, {"params": vectors(params)}) if g["params"]]


def _build_fosi_class(module, params, lr=LR, **kw):
    base = torch.optim.RMSprop(_split(params), lr=lr)
    return optim_pkg.FOSI(base, ce, _ese_batch(module), **_fosi_kw(module, kw))


def _fosi_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(groups, ce, ese_batch, lr=…)`` for fosi_adam / fosi_heavy_ball / fosi_gd."""

    def build(module, params, lr=LR, **kw):
        return fn(_split(params), ce, _ese_batch(module), lr=lr, **_fosi_kw(module, kw))

    return build


def _lowrank_builder(fn: Callable[..., Any]) -> Callable[..., Any]:
    def build(module, params, lr=LR, **kw):
        return fn(vectors(params), matrices(params), lr=lr, **{"rank": 2, "update_proj_gap": 2, **kw})

    return build


def _lowrank_groups(method: str) -> Callable[[list[nn.Parameter]], list[dict[str, Any]]]:
    extra = {
        "galore": {"rank": 2, "update_proj_gap": 2, "scale": 0.3, "proj_type": "std"},
        "fira": {"rank": 2, "update_proj_gap": 2, "alpha": 0.3, "proj_type": "std"},
        "apollo": {
            "rank": 2,
            "update_proj_gap": 2,
            "scale": 1.0,
            "proj": "random",
            "scale_type": "channel",
            "proj_type": "std",
        },
    }[method]

    def groups(params):
        return [{"params": vectors(params)}, {"params": matrices(params), **extra}]

    return groups


def _sub_module(module: nn.Module, params: list[nn.Parameter]) -> nn.Module:
    """A container holding exactly the modules (and loose parameters) that own ``params``."""
    ids = {id(p) for p in params}
    sub = nn.ModuleList()
    for child in module.children():
        if any(id(p) in ids for p in child.parameters()):
            sub.append(child)
    holder = nn.Module()
    for name, p in module.named_parameters(recurse=False):
        if id(p) in ids:
            holder.register_parameter(name, p)
    if len(list(holder.parameters(recurse=False))):
        sub.append(holder)
    return sub


def _build_optimizer(module, params, lr=LR, **kw):
    return optim_pkg.build_optimizer(
        _sub_module(module, params), "alice", lr=lr, lm_head_in_method=True, **{**ALICE, **kw}
    )


def _build_grouped(module, params, lr=LR, **kw):
    objective = SimpleNamespace(model=_sub_module(module, params))
    return optim_pkg.build_grouped(objective, None, "racs", lr=lr, lm_head_in_method=True, **kw)


def _fosi_algorithm(objective, data, lr=LR, **kw):
    model = objective.model
    params = [p for p in model.parameters() if p.requires_grad]
    ese = batch(data.train, 0, 32)
    fosi = optim_pkg.fosi_heavy_ball(params, ce, ese, lr=lr, model=model, **{**FOSI_OPTS, **kw})
    return optim_pkg.FOSIAlgorithm(objective, fosi)


def _torch_optimizer_algorithm(objective, data, lr=LR, **kw):
    """The loop's wrapper as build_algorithm makes it: SGD with momentum, an lr scheduler, micro-batches."""
    opt = torch.optim.SGD(objective.model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    return TorchOptimizerAlgorithm(objective, opt, scheduler=scheduler, micro_batch_size=8, **kw)


def _lbfgs_algorithm(objective, data, lr=1.0, **kw):
    """The wrapper's other path: torch.optim.LBFGS gets the closure (it re-evaluates the loss)."""
    opt = torch.optim.LBFGS(
        objective.model.parameters(), lr=lr, max_iter=4, history_size=4, line_search_fn="strong_wolfe"
    )
    return TorchOptimizerAlgorithm(objective, opt, **kw)


BAD_LR = [{"lr": -1.0}, {"lr": NAN}, {"lr": INF}]
SHF_OPTS = {"batch_size": 16, "maxiter": 4, "miniter": 1, "max_batch_size": 32}
HFCG_OPTS = {"cg_maxiter": 4, "numchunks": 2, "cg_min_gap": 1}
BAD_STEP = [{"lr": -1.0}, {"lr": NAN}, {"lr": INF}, {"damping": NAN}, {"damping": 0.0}, {"damping": INF}]
# the progress clause's settings: the lr of the case's builder raised where the default needs more
# than 40 steps; RACS and Alice normalise their matrix updates (about lr per entry, whatever the
# gradient's size), so they need lr = 0.2
NORMALISED = {"lr": 0.2}

TORCH_CASES = [
    Case(
        "MatrixOptimizer",
        "torch",
        lambda module, params, lr=LR, **kw: optim_pkg.MatrixOptimizer(
            [{**g, "adam": True} for g in _split(params)], {"lr": lr, **kw}
        ),
        lambda params: [{"params": params, "adam": True}],
        [
            *BAD_LR,
            {"adam_betas": (1.0, 0.999)},
            {"adam_betas": (NAN, 0.9)},
            {"adam_eps": NAN},
            {"weight_decay": NAN},
        ],
        progress=Progress(10, overrides={"lr": 0.1}),
    ),
    Case(
        "RACS",
        "torch",
        lambda module, params, lr=LR, **kw: optim_pkg.RACS(_matrix_groups(params), lr=lr, **kw),
        _matrix_groups,
        [
            *BAD_LR,
            {"beta": 1.5},
            {"beta": NAN},
            {"alpha": NAN},
            {"gamma": NAN},
            {"eps": NAN},
            {"adam_betas": (0.9, 1.0)},
        ],
        progress=Progress(40, overrides=NORMALISED),
    ),
    Case(
        "Alice",
        "torch",
        lambda module, params, lr=LR, **kw: optim_pkg.Alice(_matrix_groups(params), lr=lr, **{**ALICE, **kw}),
        _matrix_groups,
        [
            *BAD_LR,
            {"betas": (0.9, 0.9, 1.0)},
            {"betas": (NAN, 0.9, 0.9)},
            {"alpha_c": NAN},
            {"eps": NAN},
            {"gamma": NAN},
        ],
        fp32_state={"Qt": QT_FP32},
        progress=Progress(30, overrides=NORMALISED),
    ),
    Case(
        "alice0",
        "torch",
        lambda module, params, lr=LR, **kw: optim_pkg.alice0(
            _matrix_groups(params), lr=lr, **{**ALICE, **kw}
        ),
        _matrix_groups,
        [*BAD_LR, {"betas": (0.9, 1.5)}, {"betas": (0.9,)}, {"alpha": NAN}],
        skips={"compile": SAME_CLASS.format("Alice")},
        progress=Progress(40, overrides=NORMALISED),
    ),
    Case(
        "FOSI",
        "torch",
        _build_fosi_class,
        lambda params: [{"params": params}],
        [
            *BAD_LR,
            {"alpha": NAN},
            {"alpha": -1.0},
            {"eps": NAN},
            {"eps": 0.0},
            {"newton_momentum": "ema", "newton_beta": 1.5},
            {"newton_momentum": "ema", "newton_beta": NAN},
            {"lr_clip": NAN},
            {"ese_period": 0},
        ],
        slow=("compile",),
        compile_warm=2,
        progress=Progress(15),
    ),
    Case(
        "fosi_adam",
        "torch",
        _fosi_factory(optim_pkg.fosi_adam),
        lambda params: [{"params": params}],
        [*BAD_LR, {"betas": (1.0, 0.999)}, {"betas": (0.9, NAN)}, {"alpha": NAN}, {"eps": NAN}],
        slow=("compile",),
        compile_warm=2,
        progress=Progress(10, overrides={"lr": 0.1}),
    ),
    Case(
        "fosi_heavy_ball",
        "torch",
        _fosi_factory(optim_pkg.fosi_heavy_ball),
        lambda params: [{"params": params}],
        [*BAD_LR, {"momentum": -0.5}, {"alpha": NAN}, {"eps": NAN}, {"lr_clip": NAN}],
        compile_warm=2,
        progress=Progress(30),
    ),
    Case(
        "fosi_gd",
        "torch",
        _fosi_factory(optim_pkg.fosi_gd),
        lambda params: [{"params": params}],
        [*BAD_LR, {"alpha": INF}, {"eps": NAN}],
        skips={"compile": SAME_CLASS.format("fosi_heavy_ball: FOSI on the SGD fast path")},
        compile_warm=2,
        progress=Progress(20, overrides={"lr": 0.5}),
    ),
    Case(
        "make_base_optimizer",
        "torch",
        lambda module, params, lr=LR, **kw: optim_pkg.make_base_optimizer(
            "heavy_ball", _split(params), lr, **kw
        ),
        lambda params: [{"params": params}],
        supports_complex=True,
        sparse_supported=True,
        skips={
            "compile": SAME_CLASS.format("torch.optim.SGD, torch's own tests"),
            "invalid_hparams": "returns torch.optim.SGD/Adam unchanged: their validation is torch's "
            "(torch accepts lr=nan); FOSI, which wraps them, refuses a non-finite lr",
        },
        progress=Progress(30),
    ),
    Case(
        "galore",
        "torch",
        _lowrank_builder(optim_pkg.galore),
        _lowrank_groups("galore"),
        [*BAD_LR, {"betas": (1.0, 0.9)}, {"eps": NAN}, {"weight_decay": NAN}, {"rank": 0}],
        upstream="galore",
        skips={"compile": UPSTREAM_COMPILE.format("GaLore", "torch.linalg.svd on the projection")},
        xfails=UPSTREAM_XFAILS,
        progress=Progress(60, overrides={"lr": 0.1}),
    ),
    Case(
        "fira",
        "torch",
        _lowrank_builder(optim_pkg.fira),
        _lowrank_groups("fira"),
        [*BAD_LR, {"betas": (0.9, 1.0)}, {"eps": NAN}, {"adam_lr": NAN}],
        upstream="fira",
        skips={"compile": UPSTREAM_COMPILE.format("Fira", "torch.linalg.svd on the projection")},
        xfails=UPSTREAM_XFAILS,
        progress=Progress(20, overrides={"lr": 0.1}),
    ),
    Case(
        "apollo",
        "torch",
        _lowrank_builder(optim_pkg.apollo),
        _lowrank_groups("apollo"),
        [*BAD_LR, {"betas": (NAN, 0.9)}, {"eps": 0.0}, {"update_proj_gap": 0}],
        upstream="apollo",
        skips={"compile": UPSTREAM_COMPILE.format("APOLLO", "seeded random projections")},
        xfails={
            **UPSTREAM_XFAILS,
            "add_param_group": "upstream APOLLO gives each parameter its projection seed in __init__ "
            "only; a projected group added later fails with KeyError('seed')",
            "deepcopy": UPSTREAM_APOLLO_ATTRS,
            "pickle": UPSTREAM_APOLLO_ATTRS,
        },
        progress=Progress(30, overrides={"lr": 0.1}),
    ),
    Case(
        "build_optimizer",
        "torch",
        _build_optimizer,
        _matrix_groups,
        [*BAD_LR, {"betas": (0.9, 0.9, 2.0)}, {"eps": NAN}],
        skips={"compile": SAME_CLASS.format("Alice")},
        fp32_state={"Qt": QT_FP32},
        progress=Progress(30, overrides=NORMALISED),
    ),
    Case(
        "build_grouped",
        "torch",
        _build_grouped,
        _matrix_groups,
        [*BAD_LR, {"beta": NAN}, {"alpha": NAN}],
        skips={"compile": SAME_CLASS.format("RACS")},
        progress=Progress(40, overrides=NORMALISED),
    ),
]

BF16_ONLY_32 = {
    "SHF": "SHF-LSMR runs LSMR and its variance test in the parameters' dtype; bf16 (8 mantissa bits) "
    "cannot resolve the paper's tolerances (ftol 1e-5), the method is float32/64 only",
    "HFCG": "Martens' HF-CG runs CG with a relative progress test of 5e-4 in the parameters' dtype; bf16 "
    "cannot resolve it, the method is float32/64 only",
}

ALGORITHM_CASES = [
    Case(
        "FGN",
        "algorithm",
        lambda obj, data, **kw: optim_pkg.FGN(obj, **kw),
        invalid=[*BAD_STEP, {"cg_tol": NAN}],
        algorithm="FGN",
        skips=NOT_TORCH,
        progress=Progress(20, overrides={"lr": 1.0, "damping": 0.1}),
    ),
    Case(
        "SGN",
        "algorithm",
        lambda obj, data, **kw: optim_pkg.SGN(obj, **kw),
        invalid=[*BAD_STEP, {"cg_tol": NAN}],
        algorithm="SGN",
        skips=NOT_TORCH,
        progress=Progress(10, overrides={"lr": 1.0, "damping": 0.1}),
    ),
    Case(
        "KFAC",
        "algorithm",
        lambda obj, data, **kw: optim_pkg.KFAC(obj, **{"lr": LR, "momentum": 0.5, **kw}),
        invalid=[
            *BAD_STEP,
            {"momentum": NAN},
            {"momentum": -0.5},
            {"min_damping": NAN},
            {"damping_adaptation_decay": NAN},
        ],
        algorithm="KFAC",
        skips=NOT_TORCH,
        round_trip_steps=5,  # after the first damping adaptation (every 5 steps) and before an inverse update
        progress=Progress(15, overrides={"lr": "adaptive", "momentum": "adaptive"}),
    ),
    Case(
        "SHF",
        "algorithm",
        lambda obj, data, **kw: optim_pkg.SHF(obj, data, **{**SHF_OPTS, **kw}),
        invalid=[{"damping": NAN}],
        loss_kind="squared_error",
        algorithm="SHF",
        skips={**NOT_TORCH, "bfloat16": BF16_ONLY_32["SHF"]},
        no_example=SHF_WORK_STREAM.format("shf.py") + "; docs/shf.md shows its use",
        round_trip_steps=6,  # after the batch-size rule starts (iteration stall_window + 1 = 6)
        progress=Progress(5, overrides={"damping": 1.0, "maxiter": 20}),
    ),
    Case(
        "HFCG",
        "algorithm",
        lambda obj, data, **kw: optim_pkg.HFCG(obj, data, **{**HFCG_OPTS, **kw}),
        invalid=[{"initlambda": NAN}],
        algorithm="HFCG",
        reported_loss="train",
        skips={**NOT_TORCH, "bfloat16": BF16_ONLY_32["HFCG"]},
        no_example=SHF_WORK_STREAM.format("hf_cg.py"),
        progress=Progress(5, overrides={"initlambda": 1.0, "cg_maxiter": 20}),
    ),
    Case(
        "FOSIAlgorithm",
        "algorithm",
        _fosi_algorithm,
        invalid=[*BAD_LR, {"alpha": NAN}, {"eps": NAN}],
        algorithm="FOSIAlgorithm",
        skips=NOT_TORCH,
        progress=Progress(15, overrides={"lr": 0.2}),
    ),
    Case(
        "build_fgn",
        "algorithm",
        lambda obj, data, **kw: optim_pkg.build_fgn(obj, data, **kw),
        invalid=BAD_STEP,
        algorithm="FGN",
        factory_of="FGN",
        skips={**NOT_TORCH, **_factory_skips("build_fgn", "FGN")},
    ),
    Case(
        "build_sgn",
        "algorithm",
        lambda obj, data, **kw: optim_pkg.build_sgn(obj, data, **kw),
        invalid=BAD_STEP,
        algorithm="SGN",
        factory_of="SGN",
        skips={**NOT_TORCH, **_factory_skips("build_sgn", "SGN")},
    ),
    Case(
        "build_kfac",
        "algorithm",
        lambda obj, data, **kw: optim_pkg.build_kfac(obj, data, **{"lr": LR, "momentum": 0.5, **kw}),
        invalid=BAD_STEP,
        algorithm="KFAC",
        factory_of="KFAC",
        skips={**NOT_TORCH, **_factory_skips("build_kfac", "KFAC")},
    ),
    Case(
        "build_shf",
        "algorithm",
        lambda obj, data, **kw: optim_pkg.build_shf(obj, data, **{**SHF_OPTS, **kw}),
        invalid=[{"damping": NAN}],
        loss_kind="squared_error",
        algorithm="SHF",
        factory_of="SHF",
        skips={**NOT_TORCH, **_factory_skips("build_shf", "SHF")},
        no_example=SHF_WORK_STREAM.format("shf.py"),
    ),
    Case(
        "build_hf_cg",
        "algorithm",
        lambda obj, data, **kw: optim_pkg.build_hf_cg(obj, data, **{**HFCG_OPTS, **kw}),
        invalid=[{"initlambda": NAN}],
        algorithm="HFCG",
        reported_loss="train",
        factory_of="HFCG",
        skips={**NOT_TORCH, **_factory_skips("build_hf_cg", "HFCG")},
        no_example=SHF_WORK_STREAM.format("hf_cg.py"),
    ),
    Case(
        "build_fosi",
        "algorithm",
        lambda obj, data, **kw: optim_pkg.build_fosi(
            obj, data, **{"lr": LR, **FOSI_OPTS, "ese_batch_size": 32, **kw}
        ),
        invalid=[*BAD_LR, {"alpha": NAN}, {"k": 0}, {"eps": NAN}],
        algorithm="FOSIAlgorithm",
        skips=NOT_TORCH,
        progress=Progress(15, overrides={"lr": 0.2}),
    ),
]

# Algorithm implementations that are no export of curvopt.optim: the contract only
LOOP_CASES = [
    Case(
        "TorchOptimizerAlgorithm",
        "algorithm",
        _torch_optimizer_algorithm,
        exported=False,
        algorithm="TorchOptimizerAlgorithm",
        progress=Progress(20, overrides={"lr": 0.2}),
    ),
    Case(
        "TorchOptimizerAlgorithm-LBFGS",
        "algorithm",
        _lbfgs_algorithm,
        exported=False,
        algorithm="TorchOptimizerAlgorithm",
        needs_closure=True,
        progress=Progress(10),
    ),
]

CASES: tuple[Case, ...] = (*TORCH_CASES, *ALGORITHM_CASES, *LOOP_CASES)
BY_NAME: dict[str, Case] = {c.name: c for c in CASES}
EXPORTS: dict[str, Case] = {c.name: c for c in CASES if c.exported}

# the flat views the conformance suite reads (its properties; the contract reads case.skips and
# case.xfails for its clauses, and tests/optim/test_contract.py checks every key of every case)
SKIPS: dict[tuple[str, str], str] = {
    (c.name, p): r for c in CASES for p, r in c.skips.items() if p not in CLAUSES
}
XFAILS: dict[tuple[str, str], str] = {
    (c.name, p): r for c in CASES for p, r in c.xfails.items() if p not in CLAUSES
}
NO_EXAMPLE: dict[str, str] = {c.name: c.no_example for c in CASES if c.no_example}
FP32_STATE: dict[tuple[str, str], str] = {(c.name, k): r for c in CASES for k, r in c.fp32_state.items()}
FACTORY_OF: dict[str, str] = {c.name: c.factory_of for c in CASES if c.factory_of}
ALGORITHMS: tuple[str, ...] = tuple(c.name for c in EXPORTS.values() if c.kind == "algorithm")


# -------------------------------------------------------------------------- shared drivers
def quiet(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)`` with warnings silenced (the builders warn about tiny-problem settings)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


def make_algorithm(case: Case, objective: Objective, data: DataBundle, **kw: Any) -> Any:
    """The :class:`~curvopt.api.Algorithm` the training loop steps for ``case``.

    A torch optimizer is built on the model's parameters and wrapped in
    :class:`TorchOptimizerAlgorithm`, as ``curvopt.training.build.build_algorithm`` does.
    """
    if case.kind == "torch":
        model = objective.model
        return TorchOptimizerAlgorithm(objective, quiet(case.build, model, params_of(model), **kw))
    return quiet(case.build, objective, data, **kw)


@dataclass
class Twin:
    """One side of a round trip: a model, how to take step ``t`` (returns the reported scalars)
    and the state to save / load (an optimizer's or an ``Algorithm``'s ``state_dict``)."""

    model: nn.Module
    step: Callable[[int], Any]
    state_dict: Callable[[], dict[str, Any]]
    load_state_dict: Callable[[dict[str, Any]], None]


def round_trip(
    make: Callable[[int, dict[str, Any] | None], Twin],
    steps_before: int,
    steps_after: int,
    *,
    weights_only: bool,
    loop_order: bool = False,
    same_rng: bool = False,
    check_state: Callable[[dict[str, Any]], None] | None = None,
    safe_globals: list[Any] | None = None,
) -> tuple[Twin, Twin, list[Any], list[Any]]:
    """Save after ``steps_before`` steps, load into a fresh twin, run both ``steps_after`` more.

    ``make(seed, weights)`` builds a twin whose model starts from ``seed`` (then from ``weights``,
    when given, before the optimizer is built). The first twin (seed 0) runs ``steps_before`` steps
    and saves its state through ``torch.save`` / ``torch.load(weights_only=...)``; the fresh one
    (seed 7) gets the first's weights and loads that state: weights first, then the optimizer built
    on them, or with ``loop_order`` as the training loop resumes (build, load the model, load the
    state). ``same_rng``: both continue from the global RNG state at the save (the loop checkpoints
    it). ``check_state`` sees the saved state first. Returns both twins and the scalars each step
    after the load reported, for the caller to compare.
    """
    a = make(0, None)
    for t in range(steps_before):
        a.step(t)
    state = a.state_dict()
    if check_state is not None:
        check_state(state)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    if safe_globals is None:
        loaded = torch.load(buf, weights_only=weights_only)
    else:
        with torch.serialization.safe_globals(safe_globals):
            loaded = torch.load(buf, weights_only=weights_only)
    rng = torch.get_rng_state()
    if loop_order:
        b = make(7, None)
        b.model.load_state_dict(a.model.state_dict())
    else:
        b = make(7, a.model.state_dict())
    b.load_state_dict(loaded)
    out_a, out_b = [], []
    for twin, out in ((a, out_a), (b, out_b)):
        if same_rng:
            torch.set_rng_state(rng)
        for t in range(steps_before, steps_before + steps_after):
            out.append(twin.step(t))
    return a, b, out_a, out_b


def assert_same(a: nn.Module, b: nn.Module, atol: float = 0.0) -> None:
    """Parameters equal bit for bit (``atol == 0``) or to ``atol``."""
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        if atol == 0.0:
            assert torch.equal(pa, pb), f"{name} differs"
        else:
            torch.testing.assert_close(pa, pb, rtol=0.0, atol=atol, msg=f"{name} differs")
