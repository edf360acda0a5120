"""GaLore, Fira and APOLLO baselines: the official PyPI packages behind our configs.

The paper ran "the official GaLore and Fira code" (docs/alice.md, "Flags and choices where the
paper is silent"), so we do too rather than re-derive
them: ``galore-torch`` 1.0 (``GaLoreAdamW``), ``fira`` 1.0.2 (``FiraAdamW``) and ``apollo-torch``
1.0.3 (``APOLLOAdamW``, cited-only in the paper; run here for completeness). All three install
with torch 2.13.0 (CPU) and import cleanly; ``galore-torch`` and ``apollo-torch`` import
``bitsandbytes`` at package import (0.50.2 works on CPU), ``fira`` declares ``tensorly`` and
``bitsandbytes`` but does not import them. None of the optimizers we run needs ``bitsandbytes``
(only the packages' 8-bit variants do), so where it is missing (a GPU node without it: it is a
41 MiB wheel) :func:`official_class` loads the optimizer's own module (``galore_torch.adamw``,
``apollo_torch.apollo``) without running the package's ``__init__``: the same class, the same code.

Each package takes the GaLore-style parameter groups built by
:mod:`curvopt.optim.grouping`: one plain group (their own bias-corrected AdamW, ε = 1e-6) and one
group whose parameters carry the projection keys. What their code does, which the paper's
comparison inherits (quirks kept; docs/decisions.md, RACS-19):

* **GaLore** (Alg. 8): every ``update_proj_gap`` steps (at 0-based step 0, 200, …) the top-r
  singular vectors of the current gradient on the smaller side; Adam with bias correction on
  ``σ = UᵀG``; update ``λ·scale·U·Adam(σ)``.
* **Fira**: GaLore plus the residual compensation ``(G − scale·UUᵀG)·diag(‖Adam(σ)_j‖/‖σ_j‖)``
  (the ``scale`` inside the residual is the official code's quirk, kept), added at ``λ`` (not
  ``λ·scale``) under the norm-growth limiter γ = 1.01 (hard-coded there).
* **APOLLO** (Alg. 9): random Gaussian projection (or SVD with ``proj="svd"``), Adam on the
  projection, the raw gradient scaled channel-wise (``scale_type="channel"``) or tensor-wise
  (APOLLO-Mini: rank 1, ``"tensor"``, ``scale=128``), limiter on. It stores the m×r random matrix
  (the paper's Table 3 counts APOLLO-Mini as ``2n + 2``, i.e. a regenerated projection).

The projector objects live in the optimizer state (pickled by ``state_dict``, as upstream).

Where the upstream classes fall short of a ``torch.optim`` citizen (tests/optim/test_optim_conformance.py
marks each gap), we wrap at construction and document the rest rather than patch their code:

* **hyper-parameters**: upstream accepts ``lr=nan`` (and NaN/inf betas, ε, weight decay); our
  factories :func:`galore`, :func:`fira`, :func:`apollo` refuse them with ``ValueError``, and
  refuse complex parameters with ``TypeError`` (upstream would run its real SVD/Adam on them).
  Groups added later with ``add_param_group`` go to upstream unchecked;
* **closure**: upstream ``step`` runs under ``torch.no_grad()`` and calls the closure without
  re-enabling gradients, so a closure that calls ``backward()`` fails. Wrap its body in
  ``with torch.enable_grad():`` or call ``loss.backward()`` before ``step()``;
* **weights_only loading**: the saved state holds the projector objects, which
  ``torch.load(..., weights_only=True)`` refuses unless allowed:
  ``with torch.serialization.safe_globals(state_globals("galore")): torch.load(path, weights_only=True)``
  (:func:`state_globals`);
* sparse gradients raise upstream's ``RuntimeError`` ("Adam does not support sparse gradients").
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import sys
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from curvopt.optim.checks import (
    NONNEG,
    POSITIVE,
    UNIT,
    Range,
    check_floating,
    check_hparams,
    count,
    optional,
    tuple_of,
)

log = logging.getLogger(__name__)

PACKAGES = {
    "galore": ("galore_torch", "GaLoreAdamW", "galore-torch"),
    "fira": ("fira", "FiraAdamW", "fira"),
    "apollo": ("apollo_torch", "APOLLOAdamW", "apollo-torch"),
}
# Where each class is defined (the package's __init__ re-exports it and also imports bitsandbytes).
DEFINED_IN = {"galore": ("adamw", "AdamW"), "apollo": ("apollo", "AdamW")}


def _import_without_package_init(package: str, submodule: str) -> Any:
    """Import ``package.submodule`` without executing ``package/__init__.py``.

    The package is entered in ``sys.modules`` as a bare module whose ``__path__`` is the installed
    folder, so the submodule's relative imports resolve as usual.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"no package named {package!r}")
    bare = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(package, None, is_package=True))
    bare.__path__ = list(spec.submodule_search_locations)
    sys.modules[package] = bare
    try:
        return importlib.import_module(f"{package}.{submodule}")
    except BaseException:
        del sys.modules[package]
        raise


def official_class(method: str) -> type[torch.optim.Optimizer]:
    """Import the upstream optimizer class of a baseline.

    Args:
        method: ``"galore"``, ``"fira"`` or ``"apollo"`` (any name starting with ``apollo``).

    Returns:
        ``GaLoreAdamW``, ``FiraAdamW`` or ``APOLLOAdamW``.

    Raises:
        ImportError: If the package is missing; the message says what to install.
    """
    key = "apollo" if method.startswith("apollo") else method
    module, attr, dist = PACKAGES[key]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                mod = importlib.import_module(module)
            except ImportError as err:
                missing = (getattr(err, "name", None) or "").split(".")[0]
                if missing != "bitsandbytes" or key not in DEFINED_IN:
                    raise
                # only the package's 8-bit optimizers need bitsandbytes: load the class's own module
                sys.modules.pop(module, None)
                submodule, defined_as = DEFINED_IN[key]
                own = _import_without_package_init(module, submodule)
                mod = sys.modules[module]
                setattr(mod, attr, getattr(own, defined_as))  # the name the package exports
                log.info(
                    "%s: bitsandbytes is not installed; loaded %s.%s directly", method, module, submodule
                )
    except ImportError as err:
        raise ImportError(
            f"the {method} baseline runs the official package: pip install torch==2.13.0 {dist} "
            f"(import of {module!r} failed: {err})"
        ) from err
    return getattr(mod, attr)


def official_available(method: str) -> bool:
    """Whether the official package of a baseline can be imported.

    Args:
        method: As in :func:`official_class`.

    Returns:
        ``True`` when :func:`official_class` succeeds.
    """
    try:
        official_class(method)
    except ImportError:
        return False
    return True


def state_globals(method: str) -> list[type]:
    """The classes a saved state of the official optimizer holds besides tensors and numbers.

    For ``torch.load(..., weights_only=True)``, which refuses arbitrary objects::

        with torch.serialization.safe_globals(state_globals("galore")):
            state = torch.load(path, weights_only=True)

    Args:
        method: ``"galore"``, ``"fira"`` or ``"apollo"`` (any name starting with ``apollo``).

    Returns:
        The projector classes of that package.

    Raises:
        ImportError: If the package is missing.
        ValueError: If ``method`` is unknown.
    """
    official_class(method)  # imports the package (or its modules) as the optimizer does
    key = "apollo" if method.startswith("apollo") else method
    modules = {
        "galore": [("galore_torch.galore_projector", "GaLoreProjector")],
        "fira": [("fira.gradient_projection", "GradientProjector")],
        "apollo": [
            ("apollo_torch.random_projector", "GradientProjector"),
            ("apollo_torch.svd_projector", "GradientProjector"),
        ],
    }
    if key not in modules:
        raise ValueError(f"unknown method {method!r}; choose galore, fira or apollo")
    out = []
    for module, attr in modules[key]:
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):  # a package version without that projector
            continue
    return out


#: What every factory refuses that upstream accepts silently (NaN/inf/negative settings), declared once;
#: 0-d tensor values are checked by value (:mod:`curvopt.optim.checks`).
LOWRANK_RANGES: dict[str, Range] = {
    **dict.fromkeys(("lr", "weight_decay"), NONNEG),
    "adam_lr": optional(NONNEG),
    "eps": POSITIVE,
    "betas": tuple_of(2, UNIT),
    **dict.fromkeys(("rank", "update_proj_gap"), count(1)),
}


def _two_groups(
    adam_params: Iterable[torch.nn.Parameter],
    method_params: Iterable[torch.nn.Parameter],
    adam_lr: float | None,
    **method_options: Any,
) -> list[dict[str, Any]]:
    """The parameter grouping (docs/alice.md, "Parameter grouping") as the official packages take it.

    An Adam group (optionally with its own lr) and a group carrying the projection options; empty
    groups are dropped.
    """
    groups = [
        {"params": list(adam_params), **({"lr": adam_lr} if adam_lr is not None else {})},
        {"params": list(method_params), **method_options},
    ]
    return [g for g in groups if g["params"]]


# Per method, what the factory passes on besides lr, betas, eps and weight decay: the options of the
# projected group (in upstream's key order) and those of the optimizer class (fixed ones as values).
_OPTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...], dict[str, Any]]] = {
    "galore": (("rank", "update_proj_gap", "scale", "proj_type"), (), {"no_deprecation_warning": True}),
    "fira": (("rank", "update_proj_gap", "alpha", "proj_type"), (), {"no_deprecation_warning": True}),
    "apollo": (
        ("rank", "proj", "scale_type", "update_proj_gap", "scale", "proj_type"),
        ("scale_front", "disable_nl"),
        {},
    ),
}


def _official(
    method: str,
    adam_params: Iterable[torch.nn.Parameter],
    method_params: Iterable[torch.nn.Parameter],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adam_lr: float | None,
    **options: Any,
) -> torch.optim.Optimizer:
    """The factories' one body: check the settings, build the two groups, construct upstream's class.

    Args:
        method: ``"galore"``, ``"fira"`` or ``"apollo"`` (a key of :data:`_OPTIONS`).
        adam_params: Parameters of the plain (AdamW) group.
        method_params: 2-D weights that get the projected update.
        lr: Base learning rate of both groups.
        betas: AdamW betas.
        eps: AdamW ε.
        weight_decay: Decoupled weight decay.
        adam_lr: Own learning rate for the plain group (``None``: ``lr``).
        **options: The method's own options (``rank``, ``update_proj_gap``, ...; see :data:`_OPTIONS`).

    Returns:
        The optimizer.
    """
    group_keys, class_keys, fixed = _OPTIONS[method]
    cls = official_class(method)
    adam_params, method_params = list(adam_params), list(method_params)
    check_hparams(method, LOWRANK_RANGES, {**locals(), **options})
    check_floating(method, adam_params + method_params)
    groups = _two_groups(adam_params, method_params, adam_lr, **{key: options[key] for key in group_keys})
    class_options = {**{key: options[key] for key in class_keys}, **fixed}
    return cls(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **class_options)


def galore(
    adam_params: Iterable[torch.nn.Parameter],
    method_params: Iterable[torch.nn.Parameter],
    lr: float = 0.02,
    rank: int = 128,
    update_proj_gap: int = 200,
    scale: float = 0.3,
    proj_type: str = "std",
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    adam_lr: float | None = None,
) -> torch.optim.Optimizer:
    """Official ``GaLoreAdamW`` (Table 7: lr 0.02, scale 0.3, rank 128/256/256/512, gap 200).

    Args:
        adam_params: Parameters of the plain (AdamW) group.
        method_params: 2-D weights that get the projected update.
        lr: Base learning rate of both groups.
        rank: Projection rank r.
        update_proj_gap: Steps between SVD refreshes of the projection.
        scale: GaLore's update scale.
        proj_type: The package's projection side option (``"std"``: the smaller side).
        betas: AdamW betas.
        eps: AdamW ε.
        weight_decay: Decoupled weight decay.
        adam_lr: Own learning rate for the plain group (``None``: ``lr``).

    Returns:
        The optimizer.

    Raises:
        ImportError: If ``galore-torch`` is not installed.
        ValueError: If ``lr``, ``adam_lr`` or ``weight_decay`` is negative or not finite, ``eps``
            is not finite and positive, ``betas`` are not in ``[0, 1)``, or ``rank`` /
            ``update_proj_gap`` is not a positive integer.
        TypeError: If a parameter is complex (or not floating point).

    Example:
        The projected update on the hidden matrix, upstream's AdamW on the rest (the module
        docstring lists where upstream differs from ``torch.optim``: the closure, ``weights_only``):

        >>> import torch
        >>> from curvopt.optim import galore
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        >>> others = [model[0].bias, *model[2].parameters()]
        >>> opt = galore(others, [model[0].weight], lr=0.01, rank=2, update_proj_gap=2)
        >>> x, y = torch.randn(16, 4), torch.randn(16, 2)
        >>> for _ in range(3):
        ...     opt.zero_grad()
        ...     torch.nn.functional.mse_loss(model(x), y).backward()
        ...     opt.step()
        >>> opt.state[model[0].weight]["step"]
        3
    """
    return _official("galore", **locals())


def fira(
    adam_params: Iterable[torch.nn.Parameter],
    method_params: Iterable[torch.nn.Parameter],
    lr: float = 0.02,
    rank: int = 128,
    update_proj_gap: int = 200,
    alpha: float = 0.3,
    proj_type: str = "std",
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    adam_lr: float | None = None,
) -> torch.optim.Optimizer:
    """Official ``FiraAdamW`` (Table 7 values; ``alpha`` is Fira's name for GaLore's scale).

    Args:
        adam_params: Parameters of the plain (AdamW) group.
        method_params: 2-D weights that get the projected update.
        lr: Base learning rate of both groups.
        rank: Projection rank r.
        update_proj_gap: Steps between SVD refreshes of the projection.
        alpha: Update scale (GaLore's ``scale``).
        proj_type: The package's projection side option.
        betas: AdamW betas.
        eps: AdamW ε.
        weight_decay: Decoupled weight decay.
        adam_lr: Own learning rate for the plain group (``None``: ``lr``).

    Returns:
        The optimizer.

    Raises:
        ImportError: If ``fira`` is not installed.
        ValueError: If ``lr``, ``adam_lr`` or ``weight_decay`` is negative or not finite, ``eps``
            is not finite and positive, ``betas`` are not in ``[0, 1)``, or ``rank`` /
            ``update_proj_gap`` is not a positive integer.
        TypeError: If a parameter is complex (or not floating point).

    Example:
        Stepped with a closure: upstream calls it under ``torch.no_grad()``, so the closure
        re-enables gradients itself (the module docstring lists where upstream differs from
        ``torch.optim``):

        >>> import torch
        >>> from curvopt.optim import fira
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        >>> opt = fira([model[0].bias, *model[2].parameters()], [model[0].weight], lr=0.01, rank=2)
        >>> x, y = torch.randn(16, 4), torch.randn(16, 2)
        >>> def closure():
        ...     with torch.enable_grad():
        ...         opt.zero_grad()
        ...         loss = torch.nn.functional.mse_loss(model(x), y)
        ...         loss.backward()
        ...     return loss
        >>> losses = [float(opt.step(closure)) for _ in range(3)]
        >>> opt.state[model[0].weight]["step"]
        3
    """
    return _official("fira", **locals())


def apollo(
    adam_params: Iterable[torch.nn.Parameter],
    method_params: Iterable[torch.nn.Parameter],
    lr: float = 0.01,
    rank: int = 128,
    update_proj_gap: int = 200,
    scale: float = 1.0,
    proj: str = "random",
    scale_type: str = "channel",
    proj_type: str = "std",
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    scale_front: bool = False,
    disable_nl: bool = False,
    adam_lr: float | None = None,
) -> torch.optim.Optimizer:
    """Official ``APOLLOAdamW``.

    APOLLO: rank ≈ h/4, channel, random, scale 1; APOLLO-Mini: rank 1, tensor, random, scale 128;
    APOLLO-svd: ``proj="svd"``, channel.

    Args:
        adam_params: Parameters of the plain (AdamW) group.
        method_params: 2-D weights that get the projected update.
        lr: Base learning rate of both groups.
        rank: Projection rank r.
        update_proj_gap: Steps between projection refreshes.
        scale: Update scale.
        proj: ``"random"`` (Gaussian) or ``"svd"`` projection.
        scale_type: ``"channel"`` or ``"tensor"`` (APOLLO-Mini) gradient scaling.
        proj_type: The package's projection side option.
        betas: AdamW betas.
        eps: AdamW ε.
        weight_decay: Decoupled weight decay.
        scale_front: The package's ``scale_front`` option.
        disable_nl: The package's ``disable_nl`` option (norm-growth limiter off).
        adam_lr: Own learning rate for the plain group (``None``: ``lr``).

    Returns:
        The optimizer.

    Raises:
        ImportError: If ``apollo-torch`` is not installed.
        ValueError: If ``lr``, ``adam_lr`` or ``weight_decay`` is negative or not finite, ``eps``
            is not finite and positive, ``betas`` are not in ``[0, 1)``, or ``rank`` /
            ``update_proj_gap`` is not a positive integer.
        TypeError: If a parameter is complex (or not floating point).

    Example:
        APOLLO-Mini (rank 1, one scale for the whole tensor) on the hidden matrix, upstream's
        AdamW on the rest:

        >>> import torch
        >>> from curvopt.optim import apollo
        >>> x, y = torch.randn(16, 4), torch.randn(16, 2)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        >>> mini = {"rank": 1, "scale_type": "tensor", "scale": 128.0}
        >>> opt = apollo([model[0].bias, *model[2].parameters()], [model[0].weight], lr=0.01, **mini)
        >>> for _ in range(3):
        ...     opt.zero_grad()
        ...     torch.nn.functional.mse_loss(model(x), y).backward()
        ...     opt.step()
        >>> opt.state[model[0].weight]["step"]
        3
    """
    return _official("apollo", **locals())


def projected_state_numel(shape: tuple[int, int], rank: int, **_: Any) -> dict[str, int]:
    """State of GaLore/Fira/APOLLO(-svd) for one weight matrix.

    The projection (smaller side × r) and Adam's two moments (r × larger side); the official SVD
    keeps at most min(m, n) vectors.

    Args:
        shape: The weight's shape.
        rank: Projection rank r.
        **_: Ignored (uniform signature with the other layouts).

    Returns:
        Elements per state tensor: ``projection``, ``exp_avg``, ``exp_avg_sq``.
    """
    m, n = sorted(shape)
    r = min(int(rank), m)
    return {"projection": m * r, "exp_avg": r * n, "exp_avg_sq": r * n}


def fira_state_numel(shape: tuple[int, int], rank: int, **kw: Any) -> dict[str, int]:
    """State of Fira for one weight matrix: GaLore's plus the limiter's previous norm.

    Args:
        shape: The weight's shape.
        rank: Projection rank r.
        **kw: Passed to :func:`projected_state_numel`.

    Returns:
        Elements per state tensor.
    """
    return {**projected_state_numel(shape, rank, **kw), "limiter_norm": 1}


def apollo_state_numel(shape: tuple[int, int], rank: int, **kw: Any) -> dict[str, int]:
    """State of APOLLO for one weight matrix, as the package stores it.

    The random matrix is kept (m×r), plus the limiter norm.

    Args:
        shape: The weight's shape.
        rank: Projection rank r (not capped: a random projection can have any rank).
        **kw: Ignored.

    Returns:
        Elements per state tensor.
    """
    m, n = sorted(shape)
    r = int(rank)  # a random projection can have any rank
    return {"projection": m * r, "exp_avg": r * n, "exp_avg_sq": r * n, "limiter_norm": 1}
