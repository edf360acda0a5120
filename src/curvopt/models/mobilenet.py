"""MobileNetV1 as in haiku's ``hk.nets.MobileNetV1`` (FOSI's AC task on AudioSet log-mel images).

Conv 3×3 s2 VALID (32, no bias) → BN → ReLU, 13 depthwise-separable blocks (depthwise 3×3 SAME,
stride s → BN → ReLU → 1×1 conv → BN → ReLU; channels 64,128,128,256,256,512×6,1024,1024; strides
1,2,1,2,1,2,1,1,1,1,1,2,1), global spatial mean, Linear(1024 → classes). Convolutions have no
bias; BN has haiku's decay 0.999 (torch momentum 0.001) and eps 1e-5. TensorFlow's SAME padding
(extra pixel at the end for even inputs) is reproduced with explicit padding, so every feature map
has the authors' size and alignment.

Input layout (the authors' code, not the paper; docs/decisions.md, FOSI-K): the authors fed an NCHW
``(B, 3, 96, 64)`` tensor (an RGB JPEG of a 96-frame × 64-band log-mel patch) to an NHWC network,
which therefore saw 64 mel bands as channels, the 3 colour planes as height and the 96 frames as
width. ``input_layout='faithful'`` (default) reproduces that with ``x.permute(0, 3, 1, 2)``;
``'natural'`` treats the input as the image it is (3 channels, 96×64). uint8 inputs are scaled to
[0, 1] (``ToTensor``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CHANNELS = (64, 128, 128, 256, 256, 512, 512, 512, 512, 512, 512, 1024, 1024)
STRIDES = (1, 2, 1, 2, 1, 2, 1, 1, 1, 1, 1, 2, 1)


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow SAME padding for one spatial dimension.

    Args:
        size: Input size along the dimension.
        kernel: Kernel size.
        stride: Stride.

    Returns:
        ``(before, after)`` padding (the extra pixel, if any, goes after).
    """
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class SameConv2d(nn.Conv2d):
    """``nn.Conv2d`` with TensorFlow SAME padding computed from the input size.

    Takes ``nn.Conv2d``'s constructor arguments (its ``padding`` is ignored in the forward).
    """

    def forward(self, x: Tensor) -> Tensor:
        """Pad as TensorFlow's SAME, then convolve.

        Args:
            x: ``(B, C, H, W)`` input.

        Returns:
            The convolution output.
        """
        ph = same_padding(x.shape[-2], self.kernel_size[0], self.stride[0])
        pw = same_padding(x.shape[-1], self.kernel_size[1], self.stride[1])
        if any(ph + pw):
            x = F.pad(x, (pw[0], pw[1], ph[0], ph[1]))
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=1e-5, momentum=0.001)


class DepthwiseSeparable(nn.Module):
    """Depthwise 3×3 (SAME) → BN → ReLU → pointwise 1×1 → BN → ReLU, without conv biases.

    Args:
        in_ch: Input channels.
        out_ch: Output channels.
        stride: Stride of the depthwise convolution.
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.depthwise = SameConv2d(in_ch, in_ch, 3, stride=stride, groups=in_ch, bias=False)
        self.bn1 = _bn(in_ch)
        self.pointwise = nn.Conv2d(in_ch, out_ch, 1, bias=False)
        self.bn2 = _bn(out_ch)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block.

        Args:
            x: ``(B, in_ch, H, W)``.

        Returns:
            ``(B, out_ch, H', W')``.
        """
        x = torch.relu(self.bn1(self.depthwise(x)))
        return torch.relu(self.bn2(self.pointwise(x)))


def _haiku_init_(module: nn.Module) -> None:
    # haiku Conv2D / Linear default: truncated normal (±2σ), σ = 1/√fan_in; zero bias.
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            fan_in = (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
        elif isinstance(m, nn.Linear):
            fan_in = m.in_features
        else:
            continue
        std = 1.0 / math.sqrt(fan_in)
        nn.init.trunc_normal_(m.weight, std=std, a=-2 * std, b=2 * std)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


class MobileNetV1(nn.Module):
    """haiku's MobileNetV1 (module docstring), with haiku's initialisation.

    Args:
        num_classes: Output classes (AudioSet: 527).
        in_channels: Input channels of the stem; default 64 for ``"faithful"`` (mel bands read
            as channels), 3 for ``"natural"``.
        input_layout: ``"faithful"`` (the authors' NCHW-read-as-NHWC input) or ``"natural"``.
        channels: Output channels of the depthwise-separable blocks (a tuple, or a list from a config).
        strides: Strides of the blocks (same length as ``channels``).

    Raises:
        ValueError: On an unknown ``input_layout``.
    """

    def __init__(
        self,
        num_classes: int = 527,
        in_channels: int | None = None,
        input_layout: str = "faithful",
        channels: Sequence[int] = CHANNELS,
        strides: Sequence[int] = STRIDES,
    ) -> None:
        super().__init__()
        if input_layout not in ("faithful", "natural"):
            raise ValueError(f"input_layout must be 'faithful' or 'natural', got {input_layout!r}")
        self.input_layout = input_layout
        if in_channels is None:
            in_channels = 64 if input_layout == "faithful" else 3
        self.stem = nn.Conv2d(in_channels, 32, 3, stride=2, padding=0, bias=False)  # VALID
        self.stem_bn = _bn(32)
        blocks, prev = [], 32
        for ch, s in zip(channels, strides, strict=True):
            blocks.append(DepthwiseSeparable(prev, ch, s))
            prev = ch
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(prev, num_classes)
        _haiku_init_(self)

    def forward(self, x: Tensor) -> Tensor:
        """Class logits.

        Args:
            x: ``(B, 3, 96, 64)`` encoded patches (uint8 inputs are scaled to [0, 1]), or any
                input matching ``in_channels`` for ``"natural"``.

        Returns:
            ``(B, num_classes)`` logits.
        """
        if not x.dtype.is_floating_point:
            x = x.to(self.fc.weight.dtype) / 255.0
        if self.input_layout == "faithful":
            x = x.permute(0, 3, 1, 2)  # NCHW (B, 3, 96, 64) read as NHWC -> (B, 64, 3, 96)
        x = torch.relu(self.stem_bn(self.stem(x)))
        x = self.blocks(x)
        return self.fc(x.mean(dim=(2, 3)))


# The Hydra target of conf/model/fosi_mobilenet.yaml and of the records that name it: the class itself.
mobilenet_v1 = MobileNetV1
