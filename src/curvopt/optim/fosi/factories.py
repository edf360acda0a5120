"""Ready-made FOSI variants, and the paper's base optimizers by name.

The three factories share one signature, FOSI's own order: ``(params, loss_fn, ese_batch, lr, <the
base's options>, **FOSI options)``; everything after ``params`` can be given by keyword. They
differ only in the base optimizer they build, and share one body (:func:`_ready_made`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from curvopt.optim.fosi.optimizer import FOSI
from curvopt.optim.fosi.options import BASES


def _ready_made(
    name: str,
    base_class: type[Optimizer],
    params: Iterable[Any],
    loss_fn: Callable[..., Tensor],
    ese_batch: Any,
    fosi_options: dict[str, Any],
    **base_options: Any,
) -> FOSI:
    """The factories' one body: check ``loss_fn``, build the base on ``params``, wrap it in FOSI."""
    if not callable(loss_fn):
        raise TypeError(f"{name}: loss_fn must be callable, got {type(loss_fn).__name__}")
    return FOSI(base_class(params, **base_options), loss_fn, ese_batch, **fosi_options)


def fosi_heavy_ball(
    params: Iterable[Any],
    loss_fn: Callable[..., Tensor],
    ese_batch: Any = None,
    lr: float = 0.01,
    momentum: float = 0.9,
    **kwargs: Any,
) -> FOSI:
    """FOSI-HB: heavy ball (``torch.optim.SGD(momentum=β)``) as the base, HB-form Newton momentum.

    Args:
        params: The parameters (or parameter groups) to optimize.
        loss_fn: The loss (see :class:`FOSI`).
        ese_batch: The ESE batch (see :class:`FOSI`).
        lr: The heavy-ball learning rate η (0.01, the config default).
        momentum: Heavy-ball momentum β.
        **kwargs: Further :class:`FOSI` options (``model``, ``k``, ``alpha``, ...).

    Returns:
        The FOSI optimizer.

    Raises:
        TypeError: ``loss_fn`` is not callable.
        ValueError: As :class:`FOSI` and ``torch.optim.SGD`` (a negative or non-finite lr, ...).

    Example:
        A classifier (``loss_fn(model(x), y)``) under a step lr schedule, which scales the base
        step and the Newton part alike; the ESE runs before step ``ese_period``:

        >>> import torch
        >>> from curvopt.optim import fosi_heavy_ball
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> loss_fn = torch.nn.functional.cross_entropy
        >>> opt = fosi_heavy_ball(model.parameters(), loss_fn, (x, y), lr=0.1, model=model, k=2, ese_period=2)
        >>> schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        >>> for _ in range(4):
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()
        ...     schedule.step()
        >>> opt.ese_count, opt.param_groups[0]["lr"]
        (1, 0.025)
    """
    return _ready_made(
        "fosi_heavy_ball", torch.optim.SGD, params, loss_fn, ese_batch, kwargs, lr=lr, momentum=momentum
    )


def fosi_adam(
    params: Iterable[Any],
    loss_fn: Callable[..., Tensor],
    ese_batch: Any = None,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    **kwargs: Any,
) -> FOSI:
    """FOSI-Adam: ``torch.optim.Adam`` as the base, EMA Newton momentum, c = 1.

    Args:
        params: The parameters (or parameter groups) to optimize.
        loss_fn: The loss (see :class:`FOSI`).
        ese_batch: The ESE batch (see :class:`FOSI`).
        lr: Adam's learning rate.
        betas: Adam's (β₁, β₂); β₁ is also the Newton momentum's β.
        eps: Adam's ε (not FOSI's ``eps``, which goes in ``kwargs``).
        **kwargs: Further :class:`FOSI` options (``model``, ``k``, ``alpha``, ...).

    Returns:
        The FOSI optimizer.

    Raises:
        TypeError: ``loss_fn`` is not callable.
        ValueError: As :class:`FOSI` and ``torch.optim.Adam`` (lr, betas or eps out of range).

    Example:
        The same classifier stepped with a closure, as any ``torch.optim`` optimizer; Adam's
        learning rate is never scaled (s = 1):

        >>> import torch
        >>> from curvopt.optim import fosi_adam
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> loss_fn = torch.nn.functional.cross_entropy
        >>> opt = fosi_adam(model.parameters(), loss_fn, (x, y), lr=1e-2, model=model, k=2, ese_period=2)
        >>> def closure():
        ...     opt.zero_grad()
        ...     loss = loss_fn(model(x), y)
        ...     loss.backward()
        ...     return loss
        >>> losses = [float(opt.step(closure)) for _ in range(4)]
        >>> opt.ese_count, opt.scale
        (1, 1.0)
    """
    return _ready_made(
        "fosi_adam", torch.optim.Adam, params, loss_fn, ese_batch, kwargs, lr=lr, betas=tuple(betas), eps=eps
    )


def fosi_gd(
    params: Iterable[Any],
    loss_fn: Callable[..., Tensor],
    ese_batch: Any = None,
    lr: float = 0.01,
    **kwargs: Any,
) -> FOSI:
    """FOSI-GD: plain gradient descent (``torch.optim.SGD``) as the base, no Newton momentum.

    Args:
        params: The parameters (or parameter groups) to optimize.
        loss_fn: The loss (see :class:`FOSI`).
        ese_batch: The ESE batch (see :class:`FOSI`).
        lr: The gradient-descent learning rate η (0.01, the config default).
        **kwargs: Further :class:`FOSI` options (``model``, ``k``, ``alpha``, ...).

    Returns:
        The FOSI optimizer.

    Raises:
        TypeError: ``loss_fn`` is not callable.
        ValueError: As :class:`FOSI` and ``torch.optim.SGD``.

    Example:
        Without a model, ``loss_fn(params, batch)`` is a function of the parameter list: here a
        quadratic with Hessian diag(1, …, 6), whose two largest eigenvalues the ESE finds:

        >>> import torch
        >>> from curvopt.optim import fosi_gd
        >>> h = torch.arange(1.0, 7.0)
        >>> def loss_fn(params, batch):
        ...     return 0.5 * (h * params[0] ** 2).sum()
        >>> theta = torch.nn.Parameter(torch.ones(6))
        >>> opt = fosi_gd([theta], loss_fn, (), lr=0.1, k=2, ese_period=None, ese_warmup=0)
        >>> for _ in range(2):
        ...     opt.zero_grad()
        ...     loss_fn([theta], ()).backward()
        ...     opt.step()
        >>> [round(v, 4) for v in opt.eigenvalues.tolist()]
        [5.0, 6.0]
    """
    return _ready_made("fosi_gd", torch.optim.SGD, params, loss_fn, ese_batch, kwargs, lr=lr)


def make_base_optimizer(
    name: str,
    params: Iterable[Any],
    lr: float,
    momentum: float = 0.9,
    betas: Sequence[float] = (0.9, 0.999),
    adam_eps: float = 1e-8,
    weight_decay: float = 0.0,
    fused: bool | None = True,
) -> Optimizer:
    """One of the paper's base optimizers, by name.

    Adam is the fused kernel by default, as the repo's ``optimizer=adam`` baseline, so FOSI-Adam
    and Adam are timed with the same implementation.

    Args:
        name: ``heavy_ball`` (``torch.optim.SGD`` with momentum), ``adam`` (``torch.optim.Adam``)
            or ``gd`` (``torch.optim.SGD`` without momentum); see :data:`BASES`.
        params: The parameters (or parameter groups) to optimize.
        lr: The learning rate.
        momentum: Heavy-ball momentum (``heavy_ball`` only).
        betas: Adam's (β₁, β₂) (``adam`` only).
        adam_eps: Adam's ε (``adam`` only).
        weight_decay: The optimizer's (coupled) weight decay; FOSI warns, since the ESE does not
            see it (docs/decisions.md FOSI-S).
        fused: Adam's ``fused`` flag; ``None`` lets torch choose.

    Returns:
        The optimizer.

    Raises:
        ValueError: ``name`` is not one of :data:`BASES`.

    Example:
        >>> import torch
        >>> from curvopt.optim import make_base_optimizer
        >>> model = torch.nn.Linear(4, 2)
        >>> x, y = torch.randn(8, 4), torch.randn(8, 2)
        >>> opt = make_base_optimizer("heavy_ball", model.parameters(), lr=0.1)
        >>> for _ in range(2):
        ...     opt.zero_grad()
        ...     torch.nn.functional.mse_loss(model(x), y).backward()
        ...     opt.step()
        >>> type(opt).__name__, opt.param_groups[0]["momentum"]
        ('SGD', 0.9)
    """
    if name == "heavy_ball":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(
            params, lr=lr, betas=tuple(betas), eps=adam_eps, weight_decay=weight_decay, fused=fused
        )
    if name == "gd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"base must be one of {BASES}, got {name!r}")
