"""Fully connected networks: the deep autoencoders of the SHF/Martens papers and plain MLPs.

Models are ``nn.Sequential`` of ``nn.Linear`` and activation modules so that the hand-written
Gauss-Newton paths (which walk the layers) and ``torch.func`` see the same parameters.
"""

from __future__ import annotations

import torch
from torch import nn

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "sigmoid": nn.Sigmoid,
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
}


def _activation(name: str | None) -> nn.Module | None:
    if name is None or name in ("none", "linear", "identity"):
        return None
    if name not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(_ACTIVATIONS)} or null")
    return _ACTIVATIONS[name]()


@torch.no_grad()
def sparse_init_(layer: nn.Linear, count: int, std: float, generator: torch.Generator | None = None) -> None:
    """Martens' sparse initialisation (SHF Eq. 9), in place.

    Each unit gets ``min(count, fan_in)`` non-zero incoming weights drawn from N(0, std²), at
    input positions chosen without replacement; biases are zero. Keeps every unit's input scale
    independent of the layer width.

    Args:
        layer: The layer to initialise.
        count: Non-zero incoming weights per unit.
        std: Standard deviation of the non-zero weights.
        generator: Random generator (the global one if ``None``).
    """
    out_features, in_features = layer.weight.shape
    k = min(count, in_features)
    weight = torch.zeros(out_features, in_features, dtype=layer.weight.dtype)
    scores = torch.rand(out_features, in_features, generator=generator)
    idx = scores.argsort(dim=1)[:, :k]  # a uniformly random k-subset per row
    values = torch.randn(out_features, k, generator=generator, dtype=layer.weight.dtype) * std
    weight.scatter_(1, idx, values)
    layer.weight.copy_(weight)
    if layer.bias is not None:
        layer.bias.zero_()


def mlp(
    sizes: list[int],
    activation: str = "relu",
    output_activation: str | None = None,
    init: str = "default",
    sparse_init_count: int = 15,
    sparse_init_std: float = 1.0,
) -> nn.Sequential:
    """A plain MLP ``sizes[0] → … → sizes[-1]`` with ``activation`` between layers.

    Args:
        sizes: Layer widths, input first.
        activation: Hidden activation: ``"relu"``, ``"sigmoid"``, ``"tanh"`` or none
            (``None``/``"none"``/``"linear"``/``"identity"``).
        output_activation: Activation after the last layer (``None``: none).
        init: ``"default"`` (``nn.Linear``'s) or ``"sparse"`` (:func:`sparse_init_`).
        sparse_init_count: Non-zero incoming weights per unit for ``init="sparse"``.
        sparse_init_std: Their standard deviation.

    Returns:
        An ``nn.Sequential`` of ``nn.Linear`` and activation modules.

    Raises:
        ValueError: On an unknown activation or init.
    """
    acts = [activation] * (len(sizes) - 2) + [output_activation]
    return _stack(sizes, acts, init, sparse_init_count, sparse_init_std)


def autoencoder(
    encoder_sizes: list[int],
    activation: str = "sigmoid",
    code_activation: str | None = "sigmoid",
    output_activation: str | None = "sigmoid",
    init: str = "default",
    sparse_init_count: int = 15,
    sparse_init_std: float = 1.0,
) -> nn.Sequential:
    """Mirrored deep autoencoder, e.g. 784-1000-500-250-30-250-500-1000-784.

    Args:
        encoder_sizes: Widths from the input to the code, e.g. ``[784, 1000, 500, 250, 30]``;
            the decoder mirrors them.
        activation: Activation of the other hidden layers.
        code_activation: The bottleneck's activation (logistic in SHF, linear (``None``) in
            Martens).
        output_activation: ``"sigmoid"`` for squared error on pixel intensities, ``None`` when
            the loss takes logits (Martens' cross-entropy).
        init: ``"default"`` or ``"sparse"`` (:func:`sparse_init_`).
        sparse_init_count: Non-zero incoming weights per unit for ``init="sparse"``.
        sparse_init_std: Their standard deviation.

    Returns:
        An ``nn.Sequential`` of ``nn.Linear`` and activation modules.

    Raises:
        ValueError: If ``encoder_sizes`` has fewer than two entries, or on an unknown
            activation or init.
    """
    if len(encoder_sizes) < 2:
        raise ValueError("encoder_sizes needs at least an input and a code size")
    sizes = list(encoder_sizes) + list(reversed(encoder_sizes[:-1]))
    n_enc = len(encoder_sizes) - 1
    acts: list[str | None] = []
    for i in range(len(sizes) - 1):
        if i == n_enc - 1:
            acts.append(code_activation)
        elif i == len(sizes) - 2:
            acts.append(output_activation)
        else:
            acts.append(activation)
    return _stack(sizes, acts, init, sparse_init_count, sparse_init_std)


def _stack(sizes: list[int], acts: list[str | None], init: str, count: int, std: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for (fan_in, fan_out), act in zip(zip(sizes[:-1], sizes[1:]), acts):
        linear = nn.Linear(fan_in, fan_out)
        if init == "sparse":
            sparse_init_(linear, count, std)
        elif init != "default":
            raise ValueError(f"unknown init {init!r}; choose 'default' or 'sparse'")
        layers.append(linear)
        module = _activation(act)
        if module is not None:
            layers.append(module)
    return nn.Sequential(*layers)
