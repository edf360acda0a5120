"""Frozen ImageNet ResNet-18 backbone + trained 10-way linear head (FOSI's TL task).

The authors (jax-resnet ``pretrained_resnet(18)``, i.e. torchvision's ImageNet weights) cut the
network before its global pool and 1000-way classifier, added a spatial mean and ``Dense(10)``,
and trained only the head (5,130 parameters) on CIFAR-10 resized to 128×128 by bilinear
interpolation, **without** input normalisation (pixel values 0–255).

The ResNet-18 architecture is written out here with torchvision's parameter names, so the standard
state dict ``resnet18-f37072fd.pth`` loads without torchvision (which is optional: nothing here
imports it). Weights are looked up, in order: the configured path (a file, or a folder holding
it); torch's hub cache (``$TORCH_HOME/hub/checkpoints``), where torchvision stores them; a download
through ``torch.hub`` when ``allow_download`` and online (:func:`curvopt.models.pretrained.resolve_weights`).
Missing weights stop the run before training (the loop's one forward through the model, before
its first step, raises them) with what to download and where to put it.

BatchNorm (docs/decisions.md FOSI-L). Default ``backbone_bn='train'`` is the authors' behaviour:
in training the frozen backbone normalises with batch statistics and updates its running averages
(torch momentum 0.1 = flax 0.9); evaluation (``model.eval()``) uses the running averages.
``'eval'`` freezes the backbone in inference mode (ImageNet statistics) — cheaper to reason about,
but a different problem. The input stays uint8 until the model (a quarter of the memory of float
images); the resize happens in ``forward`` so 50k×3×128×128 floats never exist.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curvopt.errors import DataNotFoundError
from curvopt.models.pretrained import resolve_weights

__all__ = ["BasicBlock", "ResNet18Backbone", "ResNetHead", "resnet18_head"]


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block, with its parameter names.

    Two 3×3 convolutions with BatchNorm, ReLU between them and after the residual sum; the
    shortcut is the identity, or a strided 1×1 convolution with BatchNorm (``downsample``) when
    the stride or the channel count changes.

    Args:
        in_ch: Input channels.
        out_ch: Output channels.
        stride: Stride of the first convolution (and of the shortcut).
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample = (
            nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))
            if stride != 1 or in_ch != out_ch
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block.

        Args:
            x: ``[B, in_ch, H, W]``.

        Returns:
            ``[B, out_ch, ⌈H/stride⌉, ⌈W/stride⌉]``.
        """
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = self.downsample(x) if self.downsample is not None else x
        return torch.relu(out + identity)


class ResNet18Backbone(nn.Module):
    """torchvision's ResNet-18 up to (not including) the global pool; same parameter names."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        chans = [64, 128, 256, 512]
        prev = 64
        for i, ch in enumerate(chans):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(prev, ch, stride), BasicBlock(ch, ch, 1)))
            prev = ch

    def forward(self, x: Tensor) -> Tensor:
        """The feature map before the global pool.

        Args:
            x: Images ``[B, 3, H, W]``.

        Returns:
            ``[B, 512, ⌈H/32⌉, ⌈W/32⌉]`` (4×4 at 128 px).
        """
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


class ResNetHead(nn.Module):
    """Frozen ResNet-18 backbone, spatial mean and a trained linear head (see the module docstring).

    Only the head's parameters (``512·num_classes + num_classes``) require gradients. The head is
    initialised as flax's ``Dense``: truncated-normal LeCun weights, zero bias.

    Args:
        num_classes: Number of classes (the head's outputs).
        weights: The ImageNet state dict of the backbone (a ``.pth`` file or a folder holding
            ``resnet18-f37072fd.pth``; see :func:`curvopt.models.pretrained.resolve_weights`);
            its ``fc.*`` entries are dropped. ``None``: a randomly initialised backbone (tests
            only). A path that does not resolve is not an error here: it is recorded in
            :attr:`missing_weights` and :meth:`forward` raises it.
        image_size: Side in pixels the inputs are resized to (bilinear, no antialiasing) when
            they have another size; 128 is the paper's.
        backbone_bn: ``train``: the backbone's BatchNorm follows the module's mode (batch
            statistics in training, the authors' behaviour); ``eval``: always inference mode
            (docs/decisions.md FOSI-L).
        input_scale: Factor applied to the inputs after conversion to float; 1.0 keeps the
            authors' 0–255 pixel scale.
        allow_download: Let the weights lookup download them through ``torch.hub``.

    Attributes:
        backbone: The :class:`ResNet18Backbone` (parameters frozen).
        head: The trained ``nn.Linear(512, num_classes)``.
        missing_weights: The lookup's error message when ``weights`` did not resolve, else
            ``None``.
        weights_source: The weights file loaded, or ``None``.

    Raises:
        ValueError: ``backbone_bn`` is neither ``train`` nor ``eval``.
    """

    def __init__(
        self,
        num_classes: int = 10,
        weights: str | None = None,
        image_size: int = 128,
        backbone_bn: str = "train",
        input_scale: float = 1.0,
        allow_download: bool = False,
    ) -> None:
        super().__init__()
        if backbone_bn not in ("train", "eval"):
            raise ValueError(f"backbone_bn must be 'train' or 'eval', got {backbone_bn!r}")
        self.image_size, self.backbone_bn, self.input_scale = image_size, backbone_bn, input_scale
        self.backbone = ResNet18Backbone()
        self.head = nn.Linear(512, num_classes)
        std = math.sqrt(1.0 / 512) / 0.87962566103423978  # flax Dense: LeCun normal, zero bias
        nn.init.trunc_normal_(self.head.weight, std=std, a=-2 * std, b=2 * std)
        nn.init.zeros_(self.head.bias)
        self.missing_weights: str | None = None
        self.weights_source: str | None = None
        if weights is not None:
            try:
                path = resolve_weights(weights, allow_download)
            except DataNotFoundError as err:
                # Keep building (config checks instantiate every model); forward() refuses to run
                # without weights, so the loop's model check stops the run before training.
                self.missing_weights = str(err)
            else:
                state = torch.load(path, map_location="cpu", weights_only=True)
                state = {k: v for k, v in state.items() if not k.startswith("fc.")}
                self.backbone.load_state_dict(state)
                self.weights_source = str(path)
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        self.train()

    def train(self, mode: bool = True) -> ResNetHead:
        """Set training mode, keeping the backbone in eval mode when ``backbone_bn='eval'``.

        Args:
            mode: ``True`` for training mode, ``False`` for evaluation mode.

        Returns:
            ``self``.
        """
        super().train(mode)
        if self.backbone_bn == "eval":
            self.backbone.eval()
        return self

    def forward(self, x: Tensor) -> Tensor:
        """Class logits of a batch of images.

        Args:
            x: Images ``[B, 3, H, W]`` of any dtype (the TL loader gives uint8 0–255); converted
                to the head's dtype, scaled by ``input_scale`` and resized to ``image_size``.

        Returns:
            Logits ``[B, num_classes]``.

        Raises:
            DataNotFoundError: The pretrained weights were configured but not found.
        """
        if self.missing_weights is not None:
            raise DataNotFoundError(self.missing_weights)
        x = x.to(self.head.weight.dtype) * self.input_scale
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            # tf.image.resize(bilinear, antialias=False) uses half-pixel centres, as align_corners=False
            x = F.interpolate(
                x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )
        features = self.backbone(x).mean(dim=(2, 3))
        return self.head(features)


# The Hydra target of conf/model/fosi_resnet18_head.yaml and of the records that name it: the class itself.
resnet18_head = ResNetHead
