"""FOSI's option values and their checks: the allowed names, the presets, the momentum forms.

What :class:`~curvopt.optim.fosi.FOSI` checks before anything is built (:func:`_check_options`),
the cap of the base-step scale (:func:`_resolve_lr_clip`) and the linear form of the Newton
velocity's update (:func:`_momentum_coefficients`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from curvopt.curvature.hvp import HVP_MODES
from curvopt.curvature.lanczos import REORTH_MODES
from curvopt.optim.checks import NONNEG, check_hparams

log = logging.getLogger("curvopt.optim.fosi")  # one logger for the package, as before the split

NEWTON_MOMENTUM = ("auto", "none", "heavy_ball", "ema", "nesterov")
ESE_SCHEDULES = ("paper", "released")
ESE_BATCH_MODES = ("fixed", "current")
FAILURE_MODES = ("base", "keep", "raise")
BASES = ("heavy_ball", "adam", "gd")
# Named variants: option presets. "quadratic" is the update rule of the authors' quadratic
# experiments (paper §4.3, B.2; docs/decisions.md FOSI-E, FOSI-F): EMA momentum on the Newton
# part with α = 1 and unclipped lr scaling.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "quadratic": {"newton_momentum": "ema", "alpha": 1.0, "lr_clip": math.inf},
}
_ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW)
LR_REF_KEY = "fosi_lr_ref"  # per group: the lr at which the Newton part has its full size α


def _momentum_coefficients(form: str, beta: float, dampening: float = 0.0) -> tuple[float, float]:
    """(a_g, a_v) of the linear velocity update v̄ ← a_g·g₁ + a_v·v̄ for each momentum form."""
    if form == "none":
        return 1.0, 0.0
    if form == "heavy_ball":
        return 1.0 - dampening, beta
    if form == "ema":
        return 1.0 - beta, beta
    if form == "nesterov":  # the authors' fosi_nesterov: (1+β)g₁ + β²v̄
        return 1.0 + beta, beta * beta
    raise ValueError(f"newton_momentum must be one of {NEWTON_MOMENTUM}, got {form!r}")


def _flat(t: Tensor) -> Tensor:
    if not t.is_contiguous():
        raise ValueError("FOSI needs contiguous parameters and gradients")
    return t.view(-1)


def _check_options(
    base: Optimizer,
    ese_batch: Any,
    *,
    k: int,
    l: int,  # noqa: E741
    alpha: float,
    eps: float,
    ese_period: int | None,
    ese_warmup: int | None,
    ese_schedule: str,
    ese_batch_mode: str,
    newton_momentum: str,
    on_ese_failure: str,
    reorth: str,
    hvp_mode: str,
) -> None:
    """Reject FOSI options outside their allowed values before anything is built (see :class:`FOSI`).

    (:class:`FOSI` itself refuses a FOSI as its base.)
    """
    if not isinstance(base, Optimizer):
        raise TypeError(f"base must be a torch.optim.Optimizer, got {type(base).__name__}")
    for name, value, allowed in (
        ("newton_momentum", newton_momentum, NEWTON_MOMENTUM),
        ("ese_schedule", ese_schedule, ESE_SCHEDULES),
        ("ese_batch_mode", ese_batch_mode, ESE_BATCH_MODES),
        ("on_ese_failure", on_ese_failure, FAILURE_MODES),
        ("reorth", reorth, REORTH_MODES),
        ("hvp_mode", hvp_mode, HVP_MODES),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if k < 0 or l < 0 or k + l == 0:
        raise ValueError(f"need k ≥ 0, ℓ ≥ 0 and k + ℓ ≥ 1, got k={k}, ℓ={l}")
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be a finite non-negative number, got {alpha}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps (the floor on |λ̂|) must be a finite positive number, got {eps}")
    if ese_period is not None and (
        isinstance(ese_period, bool) or int(ese_period) != ese_period or ese_period <= 0
    ):
        raise ValueError(
            f"ese_period must be a positive number of steps (or None for a single ESE), got {ese_period}"
        )
    if ese_warmup is not None and ese_warmup < 0:
        raise ValueError(f"ese_warmup must be >= 0 steps (or None: = ese_period), got {ese_warmup}")
    for group in base.param_groups:  # a tensor lr by value too (one read on a device, here only)
        check_hparams("FOSI", {"lr": NONNEG}, {"lr": group.get("lr")})
        if group.get("maximize", False):
            raise ValueError(
                "FOSI: the base optimizer has maximize=True, which FOSI's Newton part would not honour; "
                "minimise the negated loss instead"
            )
    if ese_schedule == "released" and ese_period is None:
        raise ValueError("ese_schedule='released' needs a finite ese_period")
    if ese_batch_mode == "fixed" and ese_batch is None:
        raise ValueError("ese_batch_mode='fixed' needs an ese_batch")


def _resolve_lr_clip(base: Optimizer, lr_clip: float | None) -> float:
    """c, the cap of ``s = clip(|λ̂₁|/|λ̂_k|, 1, c)``: 3 by default, and 1 for Adam/AdamW.

    Adam's learning rate is never scaled (c = 1, as in the paper); another cap given for
    Adam/AdamW is overridden, with a warning.
    """
    is_adam = isinstance(base, _ADAM_FAMILY)
    if lr_clip is None:
        lr_clip = 1.0 if is_adam else 3.0
    if not lr_clip >= 1.0:  # NaN fails too
        raise ValueError(f"lr_clip (c) must be ≥ 1, got {lr_clip}")
    if is_adam and lr_clip != 1.0:
        log.warning(
            "FOSI: lr_clip=%s ignored for %s: Adam's learning rate is never scaled (c = 1)",
            lr_clip,
            type(base).__name__,
        )
        lr_clip = 1.0
    return float(lr_clip)


def _warn_if_weight_decay(base: Optimizer) -> None:
    """Coupled weight decay in the base changes the function optimised, which the ESE never sees."""
    if any(float(g.get("weight_decay", 0.0) or 0.0) != 0.0 for g in base.param_groups):
        log.warning(
            "FOSI: the base optimizer has weight_decay; put weight decay into the loss "
            "instead, or the ESE sees a different function than the one optimised "
            "(docs/decisions.md FOSI-S)"
        )
