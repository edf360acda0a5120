"""FOSI in the training loop: the :class:`~curvopt.api.Algorithm` adapter and its config factory.

:mod:`curvopt.optim.fosi` holds the optimizer itself (:class:`~curvopt.optim.fosi.FOSI`, a
``torch.optim.Optimizer``). This module plugs it into the loop's protocol: :class:`FOSIAlgorithm`
runs forward/backward on an :class:`~curvopt.objective.Objective` and calls ``FOSI.step``;
:func:`build_fosi` is the factory named by ``conf/optimizer/fosi_*.yaml``; :func:`draw_ese_batch` picks the fixed
ESE batch from the training data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from curvopt.api import AlgorithmBase, Batch, DataBundle
from curvopt.objective import Objective, mean_loss
from curvopt.optim.checks import NONNEG, POSITIVE, check_hparams, check_materialised, optional
from curvopt.optim.fosi import FOSI, VARIANTS, make_base_optimizer

__all__ = ["FOSIAlgorithm", "ObjectiveLoss", "build_fosi", "draw_ese_batch"]


class FOSIAlgorithm(AlgorithmBase):
    """The loop's view of FOSI: forward/backward on the step's batch, then :meth:`FOSI.step`.

    Args:
        objective: The model and its loss kind; the step's loss is their mean loss on the batch.
        fosi: The optimizer, built on the objective model's trainable parameters.
        grad_clip_value: Clip gradients element-wise to this value before FOSI sees them (the FOSI
            paper's AE task chains ``optax.clip(1.0)`` before every optimizer); ``None``: no clipping.

    Example:
        The loop's protocol: ``step(batch)`` runs ``zero_grad``, the forward, ``backward`` and
        :meth:`FOSI.step <curvopt.optim.fosi.FOSI.step>`:

        >>> import torch
        >>> from curvopt.objective import Objective
        >>> from curvopt.optim import FOSIAlgorithm, fosi_heavy_ball
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> loss_fn = torch.nn.functional.cross_entropy
        >>> fosi = fosi_heavy_ball(model.parameters(), loss_fn, (x, y), lr=0.1, model=model, k=2, ese_period=2)
        >>> alg = FOSIAlgorithm(Objective(model, "cross_entropy"), fosi)
        >>> for _ in range(4):
        ...     info = alg.step((x, y))
        >>> info["ese_count"], info["fosi_active"]
        (1, 1)
    """

    def __init__(self, objective: Objective, fosi: FOSI, grad_clip_value: float | None = None) -> None:
        check_materialised("FOSIAlgorithm", objective.model.named_parameters())
        self.objective = objective
        self.fosi = fosi
        self.grad_clip_value = grad_clip_value

    def step(self, batch: Batch) -> dict[str, Any]:
        """One FOSI step on ``batch``.

        Args:
            batch: ``(x, y)`` of this step; FOSI also uses it for the ESE when its
                ``ese_batch_mode`` is ``current``.

        Returns:
            ``loss`` (the batch loss before the step) and FOSI's ``last_info`` (ESE count, scale,
            eigenvalue estimates, ...).
        """
        x, y = batch
        obj = self.objective
        self.fosi.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = mean_loss(obj.model(x), y, obj.loss_kind, obj.ignore_index)
            loss.backward()
        if self.grad_clip_value is not None:
            torch.nn.utils.clip_grad_value_(self.fosi._params, self.grad_clip_value)
        self.fosi.step(batch=batch)
        return {"loss": float(loss.detach()), **self.fosi.last_info}

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state for a checkpoint.

        Returns:
            ``{"fosi": FOSI.state_dict()}``.
        """
        return {"fosi": self.fosi.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the optimizer from :meth:`state_dict`'s output.

        Args:
            state: A dict as returned by :meth:`state_dict`.
        """
        self.fosi.load_state_dict(state["fosi"])


class ObjectiveLoss:
    """``loss_fn(outputs, targets)``: the objective's mean loss, as FOSI's ESE differentiates it.

    A module-level callable rather than a closure, so that the algorithm pickles.

    Args:
        kind: The loss kind (see :func:`curvopt.objective.mean_loss`).
        ignore_index: Cross-entropy target value that contributes nothing.
    """

    def __init__(self, kind: str, ignore_index: int = -100) -> None:
        self.kind = kind
        self.ignore_index = ignore_index

    def __call__(self, out: Tensor, y: Tensor) -> Tensor:
        """The mean loss of ``out`` against ``y``.

        Args:
            out: Model outputs.
            y: Targets.

        Returns:
            The scalar mean loss.
        """
        return mean_loss(out, y, self.kind, self.ignore_index)


def draw_ese_batch(data: DataBundle, size: int, seed: int = 0, source: str = "random") -> Batch:
    """The fixed ESE batch, drawn once from the training split.

    Args:
        data: The run's data; needs in-memory ``data.train``.
        size: Number of examples (capped at the training-set size).
        seed: Seed of the draw when ``source`` is ``random``.
        source: ``random`` (without replacement, seeded) or ``first`` (the first ``size``
            examples, the authors' LR/TL setup).

    Returns:
        ``(x, y)`` on the training data's device.

    Raises:
        ValueError: ``data.train`` is absent, or ``source`` is unknown.
    """
    if data.train is None:
        raise ValueError("a fixed ESE batch needs in-memory training data; use ese_batch=current")
    x, y = data.train
    count = min(int(size), int(x.shape[0]))
    if source == "first":
        idx = torch.arange(count)
    elif source == "random":
        idx = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(int(seed)))[:count]
    else:
        raise ValueError(f"ese_batch_source must be 'random' or 'first', got {source!r}")
    idx = idx.to(x.device)
    return x[idx], y[idx]


def build_fosi(
    objective: Objective,
    data: DataBundle,
    base: str = "heavy_ball",
    lr: float = 0.01,
    momentum: float = 0.9,
    betas: Sequence[float] = (0.9, 0.999),
    adam_eps: float = 1e-8,
    weight_decay: float = 0.0,
    variant: str = "default",
    ese_batch: str = "fixed",
    ese_batch_size: int = 256,
    ese_batch_source: str = "random",
    ese_seed: int = 0,
    grad_clip_value: float | None = None,
    clip_grad_value: float | None = None,
    **fosi_options: Any,
) -> FOSIAlgorithm:
    """Factory for ``conf/optimizer/fosi_*.yaml``: FOSI around the named base optimizer.

    Use ``clip_grad_value`` in configs: the loop's ``build_algorithm`` strips ``grad_clip_value``
    from every optimizer config (it belongs to the wrapped ``torch.optim`` path) before it calls a
    factory, as it does for K-FAC's option.

    Args:
        objective: The model (its trainable parameters are optimized) and loss kind.
        data: The run's data; the fixed ESE batch is drawn from ``data.train``.
        base: Base optimizer, one of :data:`~curvopt.optim.fosi.BASES` (see
            :func:`~curvopt.optim.fosi.make_base_optimizer`).
        lr: The base optimizer's learning rate.
        momentum: Heavy-ball momentum (``base='heavy_ball'``).
        betas: Adam's betas (``base='adam'``).
        adam_eps: Adam's epsilon.
        weight_decay: The base optimizer's weight decay (FOSI warns: the ESE does not see it).
        variant: A preset from :data:`~curvopt.optim.fosi.VARIANTS`; explicit non-null options
            win over it.
        ese_batch: ``fixed`` (one batch of ``ese_batch_size`` drawn from ``data.train`` with
            ``ese_seed``, used at every ESE: the authors' setup) or ``current`` (the step's batch).
        ese_batch_size: Size of the fixed ESE batch.
        ese_batch_source: ``random`` or ``first`` (see :func:`draw_ese_batch`).
        ese_seed: Seed of the fixed ESE batch.
        grad_clip_value: Alias of ``clip_grad_value``.
        clip_grad_value: Clip the gradient element-wise to this value before FOSI sees it (the
            paper's AE task); ``None``: no clipping.
        **fosi_options: The remaining :class:`~curvopt.optim.fosi.FOSI` options (``k``, ``l``,
            ``alpha``, ``ese_period``, ``ese_warmup``, ``lr_clip``, ...).

    Returns:
        The algorithm the loop drives.

    Raises:
        ValueError: The two clipping aliases disagree, ``variant`` is unknown, or the options
            set ``ese_batch_mode`` (use ``ese_batch``).

    Example:
        FOSI-Adam driven as the loop drives it, ``step(batch)``; the fixed ESE batch is drawn
        from ``data.train``:

        >>> import torch
        >>> from curvopt.api import DataBundle
        >>> from curvopt.objective import Objective
        >>> from curvopt.optim import build_fosi
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> alg = build_fosi(Objective(model, "cross_entropy"), DataBundle(train=(x, y)), base="adam",
        ...                  lr=1e-2, k=2, ese_period=2, ese_batch_size=32)
        >>> for i in range(4):
        ...     info = alg.step((x[16 * i : 16 * i + 16], y[16 * i : 16 * i + 16]))
        >>> info["ese_count"]
        1
    """
    if grad_clip_value is not None and clip_grad_value is not None and grad_clip_value != clip_grad_value:
        raise ValueError(f"grad_clip_value={grad_clip_value} and clip_grad_value={clip_grad_value} disagree")
    clip = clip_grad_value if clip_grad_value is not None else grad_clip_value
    check_hparams(
        "build_fosi", {"weight_decay": NONNEG, "clip_grad_value": optional(POSITIVE)},
        {"weight_decay": weight_decay, "clip_grad_value": clip},
    )  # fmt: skip
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    # a null variant key (alpha, lr_clip, newton_momentum) means "the variant's value, else the
    # class default"; other keys keep null (ese_period: null = a single ESE)
    variant_keys = {key for preset in VARIANTS.values() for key in preset}
    explicit = {k: v for k, v in fosi_options.items() if not (k in variant_keys and v is None)}
    options = {**VARIANTS[variant], **explicit}
    if "ese_batch_mode" in options:
        raise ValueError("use `ese_batch: fixed|current` in the config, not ese_batch_mode")
    base_opt = make_base_optimizer(
        base,
        [p for p in objective.model.parameters() if p.requires_grad],
        lr,
        momentum,
        betas,
        adam_eps,
        weight_decay,
    )
    fixed = draw_ese_batch(data, ese_batch_size, ese_seed, ese_batch_source) if ese_batch == "fixed" else None
    loss_fn = ObjectiveLoss(objective.loss_kind, objective.ignore_index)
    fosi = FOSI(base_opt, loss_fn, fixed, model=objective.model, ese_batch_mode=ese_batch, **options)
    return FOSIAlgorithm(objective, fosi, grad_clip_value=clip)
