"""Learning-rate schedules as ``LambdaLR`` builders for an optimizer config's ``scheduler:`` key.

``build.py`` pops ``scheduler`` from the optimizer config and instantiates it with
``optimizer=<the optimizer>``, so a config reads::

    scheduler:
      _target_: curvopt.training.schedules.warmup_cosine
      total_steps: ${trainer.max_steps}
      warmup_fraction: 0.1
      min_lr_ratio: 0.1

The LLaMA-on-C4 protocol of the RACS/Alice paper (docs/decisions.md, RACS-6) is GaLore's scheduler:
linear warmup from 0 over the first 10 % of the updates, then a cosine from the peak down to
0.1 × peak at the last update. The multiplier is applied to every parameter group (LambdaLR keeps
each group's own base lr), so per-group learning rates keep their ratio throughout.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine_factor(
    step: int,
    total_steps: int,
    warmup_steps: int,
    min_lr_ratio: float = 0.1,
) -> float:
    """The multiplier of the peak lr used for update ``step + 1`` (LambdaLR's ``last_epoch``).

    ``step`` counts completed updates: 0 before the first one. Warmup is linear from 0
    (``step / warmup_steps``, GaLore's convention, so the first update has lr 0 when there is a
    warmup), then ``min_lr_ratio + (1 − min_lr_ratio)·½(1 + cos(π·progress))`` with ``progress``
    running from 0 at the end of warmup to 1 at ``total_steps``; past the end it stays at
    ``min_lr_ratio``.

    Args:
        step: Completed updates (LambdaLR's ``last_epoch``).
        total_steps: Number of updates of the run (> 0).
        warmup_steps: Length of the linear warmup, in ``[0, total_steps]``.
        min_lr_ratio: Final multiplier of the cosine.

    Returns:
        The lr multiplier.

    Raises:
        ValueError: If ``total_steps`` or ``warmup_steps`` is out of range.
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}")
    if step < warmup_steps:
        return step / warmup_steps
    if total_steps == warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_fraction: float = 0.1,
    warmup_steps: int | None = None,
    min_lr_ratio: float = 0.1,
) -> LambdaLR:
    """Linear warmup then cosine decay to ``min_lr_ratio × peak`` (GaLore / RACS-Alice protocol).

    Args:
        optimizer: The optimizer whose groups' base lrs are scaled.
        total_steps: Number of updates of the run.
        warmup_fraction: Warmup length as a fraction of ``total_steps`` (the paper: 10 %).
        warmup_steps: Explicit warmup length; wins over ``warmup_fraction`` when given
            (GaLore's scripts pass an explicit count).
        min_lr_ratio: Final multiplier of the cosine.

    Returns:
        The ``LambdaLR`` scheduler (:func:`warmup_cosine_factor`).
    """
    if warmup_steps is None:
        warmup_steps = int(round(warmup_fraction * total_steps))
    total, warm = int(total_steps), int(warmup_steps)

    def factor(step: int) -> float:
        return warmup_cosine_factor(step, total, warm, min_lr_ratio)

    return LambdaLR(optimizer, factor)


def constant(optimizer: torch.optim.Optimizer) -> LambdaLR:
    """No schedule (a LambdaLR that always returns 1), for configs that need a `scheduler:`.

    Args:
        optimizer: The optimizer.

    Returns:
        A ``LambdaLR`` with a constant multiplier of 1.
    """
    return LambdaLR(optimizer, lambda step: 1.0)
