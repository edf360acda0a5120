"""Affine classification head ``z = W h + b`` on frozen features (FGN's Cars196 model).

It is a plain ``nn.Linear`` so FGN's ``implementation=auto`` recognises it and uses the closed-form
Gram (Appendix F.2); the paper's head is ``W ∈ R^{2048×196}``, ``b ∈ R^{196}`` (401,604
parameters). The paper does not state its initialisation ("the seed controls head
initialisation"); the default here is LeCun normal ``W ~ N(0, 1/D)``, ``b = 0`` (the Flax default,
consistent with a JAX implementation) [DECIDE; docs/decisions.md, FGN-5]; ``init=torch_default`` keeps
``nn.Linear``'s own uniform init, ``init=zeros`` starts from ``W = 0``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

INITS = ("lecun_normal", "torch_default", "zeros")


def linear_head(
    in_features: int = 2048, num_classes: int = 196, bias: bool = True, init: str = "lecun_normal"
) -> nn.Linear:
    """Build the head; parameters are drawn from the global torch RNG (the loop seeds it per run).

    Args:
        in_features: Feature dimension D.
        num_classes: Number of classes C.
        bias: Whether the head has a bias.
        init: ``"lecun_normal"`` (``W ~ N(0, 1/D)``, ``b = 0``), ``"torch_default"`` or
            ``"zeros"``.

    Returns:
        The ``nn.Linear(D, C)`` head.

    Raises:
        ValueError: On an unknown ``init``.
    """
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; choose one of {INITS}")
    head = nn.Linear(in_features, num_classes, bias=bias)
    with torch.no_grad():
        if init == "lecun_normal":
            head.weight.normal_(0.0, 1.0 / math.sqrt(in_features))
            if head.bias is not None:
                head.bias.zero_()
        elif init == "zeros":
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
    return head
