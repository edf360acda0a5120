"""Argument checks shared by the optimizers: hyper-parameters and parameter dtypes, refused by name."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor


def check_finite_nonneg(owner: str, name: str, value: Any) -> None:
    """Check a hyperparameter is a finite number >= 0 (NaN, inf, negatives and bools are refused).

    Args:
        owner: Optimizer name for the message.
        name: Hyperparameter name for the message.
        value: The value to check.

    Raises:
        ValueError: If the check fails.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value >= 0)
    ):
        raise ValueError(f"{owner}: {name} must be a finite non-negative number, got {value!r}")


def check_real_floating(owner: str, params: Mapping[str, Tensor]) -> None:
    """Refuse complex or integer parameters with a clear error (the curvature products are real).

    Args:
        owner: The method's name, for the message.
        params: Named parameters.

    Raises:
        TypeError: A parameter is not a real floating-point tensor.
    """
    for name, p in params.items():
        if p.is_complex() or not p.is_floating_point():
            raise TypeError(
                f"{owner} needs real floating-point parameters; {name} is {p.dtype} (complex is not supported)"
            )
