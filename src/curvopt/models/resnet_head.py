"""Frozen ImageNet ResNet-18 backbone + trained 10-way linear head (FOSI's TL task).

The authors (jax-resnet ``pretrained_resnet(18)``, i.e. torchvision's ImageNet weights) cut the
network before its global pool and 1000-way classifier, added a spatial mean and ``Dense(10)``,
and trained only the head (5,130 parameters) on CIFAR-10 resized to 128×128 by bilinear
interpolation, **without** input normalisation (pixel values 0–255).

The ResNet-18 architecture is written out here with torchvision's parameter names, so the standard
state dict ``resnet18-f37072fd.pth`` loads without torchvision (which is optional: nothing here
imports it). Weights are looked up, in order: the configured path (a file, or a folder holding
it); torch's hub cache (``$TORCH_HOME/hub/checkpoints``), where torchvision stores them; a download
through ``torch.hub`` when ``allow_download`` and online (:func:`curvopt.data.pretrained.resolve_weights`).
Missing weights stop the run before training (the dataset loader checks first) with what to
download and where to put it.

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

from curvopt.data.common import DataNotFoundError
from curvopt.data.pretrained import HOW_TO_GET, WEIGHTS_FILE, WEIGHTS_URL, resolve_weights

# the weights lookup lives in curvopt.data.pretrained (the CIFAR-10 loader checks the file before
# training and must not import this module); re-exported here, where it was defined before
__all__ = [
    "HOW_TO_GET",
    "WEIGHTS_FILE",
    "WEIGHTS_URL",
    "BasicBlock",
    "ResNet18Backbone",
    "ResNetHead",
    "resnet18_head",
    "resolve_weights",
]


class BasicBlock(nn.Module):
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
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


class ResNetHead(nn.Module):
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
                # Keep building (config checks instantiate every model); the dataset loader raises
                # the same error before training, and forward() refuses to run without weights.
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
        super().train(mode)
        if self.backbone_bn == "eval":
            self.backbone.eval()
        return self

    def forward(self, x: Tensor) -> Tensor:
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


def resnet18_head(
    num_classes: int = 10,
    weights: str | None = None,
    image_size: int = 128,
    backbone_bn: str = "train",
    input_scale: float = 1.0,
    allow_download: bool = False,
) -> ResNetHead:
    """Hydra builder (``conf/model/fosi_resnet18_head.yaml``). ``weights=None`` gives a randomly
    initialised backbone (tests only); a path that does not resolve defers the error to the run."""
    return ResNetHead(num_classes, weights, image_size, backbone_bn, input_scale, allow_download)
