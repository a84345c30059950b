"""Residual networks of He et al., "Deep Residual Learning for Image
Recognition" (CVPR 2016), written from the paper.

* :func:`cifar_resnet`: the CIFAR-10 networks of section 4.2: a 3x3
  convolution with 16 filters, three stages of ``n`` basic blocks with 16,
  32 and 64 filters (the first block of stages 2 and 3 halves the feature
  map with stride 2), global average pooling and a linear classifier:
  ``6n + 2`` weighted layers (ResNet-20, 32, 44, 56, 110). Shortcuts are
  identities; where a block halves the map and doubles the width, the
  shortcut subsamples and pads the new channels with zeros (option A), so
  every shortcut is parameter-free.
* :func:`imagenet_resnet`: the ImageNet networks of Table 1 with bottleneck
  blocks (1x1, 3x3, 1x1 convolutions, expansion 4): ResNet-50 has stages of
  3, 4, 6 and 3 blocks. Shortcuts that change shape are 1x1 convolutions
  with batch normalisation (option B). The stride of a downsampling block
  sits on its 3x3 convolution, as in most public implementations ("v1.5");
  the paper puts it on the first 1x1. ``width`` scales every stage (64 in
  the paper) for quick tests.

Every convolution is followed by batch normalisation; convolutions carry no
bias. K-FAC preconditions the convolutions and the classifier; batch
normalisation layers are left to the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

CIFAR_DEPTHS = (20, 32, 44, 56, 110)


def _conv_bn(
    c_in: int, c_out: int, kernel: int, stride: int = 1
) -> list[nn.Module]:
    return [
        nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
    ]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and an identity (option A) shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(c_in, c_out, 3, stride)
        self.conv2, self.bn2 = _conv_bn(c_out, c_out, 3)
        self.stride = stride
        self.pad = c_out - c_in

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        """``x``, subsampled and zero-padded to the block's output shape."""
        if self.stride > 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.pad:
            x = F.pad(x, (0, 0, 0, 0, 0, self.pad))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), with a projection if needed."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.conv1, self.bn1 = _conv_bn(c_in, width, 1)
        self.conv2, self.bn2 = _conv_bn(width, width, 3, stride)
        self.conv3, self.bn3 = _conv_bn(width, c_out, 1)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(*_conv_bn(c_in, c_out, 1, stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        out: torch.Tensor = F.relu(h + self.shortcut(x))
        return out


class ResNet(nn.Module):
    """A stem, stages of residual blocks, pooling and a classifier."""

    def __init__(
        self,
        stem: nn.Sequential,
        stages: nn.Sequential,
        features: int,
        classes: int,
    ) -> None:
        super().__init__()
        self.stem = stem
        self.stages = stages
        self.fc = nn.Linear(features, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(
                    m.weight, mode='fan_out', nonlinearity='relu'
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = self.stages(self.stem(x))
        out: torch.Tensor = self.fc(
            torch.flatten(F.adaptive_avg_pool2d(h, 1), 1)
        )
        return out


def cifar_resnet(depth: int = 20, classes: int = 10) -> ResNet:
    """ResNet-``depth`` for 3x32x32 images (``depth = 6n + 2``).

    Raises:
        ValueError: ``depth`` is not of the form ``6n + 2``.

    """
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f'depth must be 6n + 2 with n >= 1; got {depth}')
    n = (depth - 2) // 6
    blocks: list[nn.Module] = []
    c_in = 16
    for stage, c_out in enumerate((16, 32, 64)):
        for i in range(n):
            stride = 2 if stage > 0 and i == 0 else 1
            blocks.append(BasicBlock(c_in, c_out, stride))
            c_in = c_out
    stem = nn.Sequential(*_conv_bn(3, 16, 3), nn.ReLU())
    return ResNet(stem, nn.Sequential(*blocks), 64, classes)


def imagenet_resnet(
    layers: Sequence[int] = (3, 4, 6, 3),
    width: int = 64,
    classes: int = 1000,
) -> ResNet:
    """A bottleneck ResNet for 3x224x224 images; default ResNet-50."""
    stem = nn.Sequential(
        *_conv_bn(3, width, 7, 2),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    )
    blocks: list[nn.Module] = []
    c_in = width
    for stage, count in enumerate(layers):
        stage_width = width * 2**stage
        for i in range(count):
            stride = 2 if stage > 0 and i == 0 else 1
            blocks.append(Bottleneck(c_in, stage_width, stride))
            c_in = stage_width * Bottleneck.expansion
    return ResNet(stem, nn.Sequential(*blocks), c_in, classes)


def resnet50(classes: int = 1000, width: int = 64) -> ResNet:
    """ResNet-50 (``width`` 64 as in the paper; smaller for tests)."""
    return imagenet_resnet((3, 4, 6, 3), width, classes)
