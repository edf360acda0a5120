"""Convolutional autoencoder for CIFAR-10 (FOSI's AE task; Lippe, UvA DL tutorial 9, JAX version).

Encoder: Conv 32 s2 → Conv 32 → Conv 64 s2 → Conv 64 → Conv 64 s2 → flatten (1024) → Dense 128;
decoder: Dense 1024 → 4×4×64 → ConvT 64 s2 → Conv 64 → ConvT 32 s2 → Conv 32 → ConvT 3 s2 → tanh.
All kernels 3×3, GELU (flax's default tanh approximation) between layers; 468,227 parameters.

Padding follows the usual PyTorch equivalent (``Conv2d(padding=1)``, ``ConvTranspose2d(padding=1,
output_padding=1)``); flax's SAME padding of the stride-2 layers sits one pixel differently, which
changes nothing about the function class. Initialisation follows flax (LeCun normal, truncated at
±2σ and rescaled to variance 1/fan_in; zero biases), since it sets the early curvature FOSI sees.
"""

from __future__ import annotations

import math

from torch import Tensor, nn


def _lecun_normal_(weight: Tensor, fan_in: int) -> None:
    # flax.linen.initializers.lecun_normal: variance_scaling(1, 'fan_in', 'truncated_normal');
    # jax divides the std by .87962566 so the truncated distribution has variance 1/fan_in.
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978
    nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)


def init_flax_(module: nn.Module) -> None:
    """LeCun-normal weights and zero biases for every Linear / Conv / ConvTranspose in ``module``.

    As flax: truncated at ±2σ and rescaled to variance ``1/fan_in`` (in place).

    Args:
        module: The module whose submodules are initialised.
    """
    for m in module.modules():
        if isinstance(m, nn.Linear):
            _lecun_normal_(m.weight, m.in_features)
        elif isinstance(m, nn.ConvTranspose2d):
            # flax's kernel is (kh, kw, in, out) with fan_in = kh·kw·in, as for a plain conv
            _lecun_normal_(m.weight, m.in_channels * m.kernel_size[0] * m.kernel_size[1])
        elif isinstance(m, nn.Conv2d):
            _lecun_normal_(m.weight, m.in_channels * m.kernel_size[0] * m.kernel_size[1])
        else:
            continue
        if m.bias is not None:
            nn.init.zeros_(m.bias)


class ConvAutoencoder(nn.Module):
    """The convolutional autoencoder of the module docstring (32×32 inputs).

    Args:
        c_hid: Channels of the first stage (the second has ``2·c_hid``).
        latent_dim: Size of the code.
        in_channels: Image channels.
        init: ``"flax"`` (:func:`init_flax_`) or ``"torch"`` (PyTorch's defaults).

    Raises:
        ValueError: On an unknown ``init``.
    """

    def __init__(
        self, c_hid: int = 32, latent_dim: int = 128, in_channels: int = 3, init: str = "flax"
    ) -> None:
        super().__init__()
        c2 = 2 * c_hid

        def gelu() -> nn.Module:
            return nn.GELU(approximate="tanh")

        self.encoder = nn.Sequential(
            nn.Conv2d(in_channels, c_hid, 3, stride=2, padding=1),  # 32 -> 16
            gelu(),
            nn.Conv2d(c_hid, c_hid, 3, padding=1),
            gelu(),
            nn.Conv2d(c_hid, c2, 3, stride=2, padding=1),  # 16 -> 8
            gelu(),
            nn.Conv2d(c2, c2, 3, padding=1),
            gelu(),
            nn.Conv2d(c2, c2, 3, stride=2, padding=1),  # 8 -> 4
            gelu(),
            nn.Flatten(),
            nn.Linear(c2 * 16, latent_dim),
        )
        self.decoder_input = nn.Sequential(nn.Linear(latent_dim, c2 * 16), gelu())
        self.c2 = c2
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(c2, c2, 3, stride=2, padding=1, output_padding=1),  # 4 -> 8
            gelu(),
            nn.Conv2d(c2, c2, 3, padding=1),
            gelu(),
            nn.ConvTranspose2d(c2, c_hid, 3, stride=2, padding=1, output_padding=1),  # 8 -> 16
            gelu(),
            nn.Conv2d(c_hid, c_hid, 3, padding=1),
            gelu(),
            nn.ConvTranspose2d(c_hid, in_channels, 3, stride=2, padding=1, output_padding=1),  # 16 -> 32
            nn.Tanh(),
        )
        if init == "flax":
            init_flax_(self)
        elif init != "torch":
            raise ValueError(f"init must be 'flax' or 'torch', got {init!r}")

    def forward(self, x: Tensor) -> Tensor:
        """Reconstruct a batch of images.

        Args:
            x: ``(B, in_channels, 32, 32)`` images.

        Returns:
            The reconstructions, same shape, in ``(−1, 1)`` (tanh).
        """
        z = self.encoder(x)
        h = self.decoder_input(z).view(x.shape[0], self.c2, 4, 4)
        return self.decoder(h)


# The Hydra target of conf/model/fosi_conv_ae.yaml and of the records that name it: the class itself.
conv_autoencoder = ConvAutoencoder
