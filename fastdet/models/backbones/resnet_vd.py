"""ResNet-vd (He et al. 2019, "Bag of Tricks"), PP-YOLO's backbone
(PaddleDetection ppdet/modeling/backbones/resnet.py, ``variant: d``).

What makes it "vd", as Paddle builds it:

- the stem is three 3x3 ConvBN+ReLU (3->32 stride 2, 32->32, 32->64), then a 3x3 max-pool
  stride 2;
- a bottleneck strides on its 3x3 conv (``branch2b``), not on the first 1x1;
- a downsampling shortcut is AvgPool 2x2 stride 2 then a 1x1 ConvBN (no information is
  thrown away by a strided 1x1);
- the first block of *every* stage has a projection shortcut, even res2 of ResNet-18
  where 64 -> 64 channels would allow the identity (Paddle's ``Blocks``: ``shortcut=False
  if i == 0``); the parameter count depends on it.

DCNv2 (Zhu et al. 2019, modulated deformable convolution) replaces the 3x3 conv of
every block of the stages in ``dcn_stages`` (PP-YOLO R50: the last, res5). It is
``torchvision.ops.deform_conv2d`` with a mask; its offset/mask conv is zero-initialised,
so it starts as a plain 3x3 conv with mask 0.5 (Paddle ``DeformableConvV2``).

timm's ``resnet50d`` / ``resnet18d`` are the same topology, but timm is not a dependency
here and has no DCN stage; writing the ~150 lines keeps Paddle's layout and lets
``--backbone-weights`` load converted Paddle weights by one name map.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import register_flop_formula
from torchvision.ops import deform_conv2d

from fastdet.models.layers import make_act, paddle_conv_init_

# depth -> (block kind, blocks per stage)
DEPTHS: dict[int, tuple[str, tuple[int, ...]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
}


@register_flop_formula(torch.ops.torchvision.deform_conv2d)
def _deform_conv2d_flops(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """The FLOP counter's convention for a convolution (2 x MACs of the kernel), so that
    fastdet.models.flops counts DCN like the plain conv it replaces; the bilinear sampling
    is not counted (nor are Paddle's or the paper's tables)."""
    c_out, c_in_per_group, kh, kw = weight_shape
    b, _, h, w = out_shape
    return 2 * b * c_out * h * w * c_in_per_group * kh * kw


class DeformConv2d(nn.Module):
    """Modulated deformable 3x3 conv (DCNv2), no bias: Paddle ``DeformableConvV2`` with
    ``bias_attr=False`` as ResNet uses it.

    ``conv_offset`` predicts ``2*k*k`` offsets then ``k*k`` mask logits per output pixel;
    the offsets are (dy, dx) pairs per kernel tap, the layout of both Paddle's and
    torchvision's kernels.
    """

    def __init__(self, c_in: int, c_out: int, k: int = 3, stride: int = 1):
        super().__init__()
        self.stride, self.padding, self.k = stride, k // 2, k
        self.weight = nn.Parameter(torch.empty(c_out, c_in, k, k))
        self.conv_offset = nn.Conv2d(c_in, 3 * k * k, k, stride, k // 2, bias=True)
        nn.init.normal_(self.weight, 0.0, math.sqrt(2.0 / (c_in * k * k)))  # Paddle's conv default
        nn.init.zeros_(self.conv_offset.weight)
        nn.init.zeros_(self.conv_offset.bias)

    def forward(self, x: Tensor) -> Tensor:
        om = self.conv_offset(x)  # [B, 3*k*k, H', W']
        n = 2 * self.k * self.k
        offset, mask = om[:, :n], om[:, n:].sigmoid()
        return deform_conv2d(x, offset, self.weight, None, (self.stride, self.stride),
                             (self.padding, self.padding), mask=mask)


class ConvNorm(nn.Module):
    """Conv (no bias, or DCNv2) -> BatchNorm -> activation; Paddle resnet ``ConvNormLayer``."""

    def __init__(self, c_in: int, c_out: int, k: int, stride: int = 1, act: str | None = None, dcn: bool = False):
        super().__init__()
        if dcn:
            self.conv: nn.Module = DeformConv2d(c_in, c_out, k, stride)
        else:
            self.conv = nn.Conv2d(c_in, c_out, k, stride, (k - 1) // 2, bias=False)
            paddle_conv_init_(self.conv)
        self.bn = nn.BatchNorm2d(c_out)
        self.act = make_act(act)

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.bn(self.conv(x)))


def _shortcut(c_in: int, c_out: int, stride: int) -> nn.Module:
    """The vd projection: AvgPool 2x2 s2 + 1x1 ConvBN when downsampling, else a 1x1 ConvBN."""
    if stride == 2:
        return nn.Sequential(nn.AvgPool2d(2, 2, 0, ceil_mode=True, count_include_pad=False),
                             ConvNorm(c_in, c_out, 1))
    return ConvNorm(c_in, c_out, 1, stride)


class BasicBlockVd(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, c_out: int, stride: int, shortcut: bool, dcn: bool = False):
        super().__init__()
        self.branch2a = ConvNorm(c_in, c_out, 3, stride, act="relu")
        self.branch2b = ConvNorm(c_out, c_out, 3, 1, dcn=dcn)
        self.short = None if shortcut else _shortcut(c_in, c_out, stride)

    def forward(self, x: Tensor) -> Tensor:
        y = self.branch2b(self.branch2a(x))
        return torch.relu(y + (x if self.short is None else self.short(x)))


class BottleneckVd(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, c_out: int, stride: int, shortcut: bool, dcn: bool = False):
        super().__init__()
        self.branch2a = ConvNorm(c_in, c_out, 1, 1, act="relu")
        self.branch2b = ConvNorm(c_out, c_out, 3, stride, act="relu", dcn=dcn)  # vd: stride on the 3x3
        self.branch2c = ConvNorm(c_out, c_out * 4, 1, 1)
        self.short = None if shortcut else _shortcut(c_in, c_out * 4, stride)

    def forward(self, x: Tensor) -> Tensor:
        y = self.branch2c(self.branch2b(self.branch2a(x)))
        return torch.relu(y + (x if self.short is None else self.short(x)))


class ResNetVd(nn.Module):
    """ResNet-vd of ``depth`` 18/34/50/101.

    Args:
        return_idx: stages to return (0 = res2, stride 4 ... 3 = res5, stride 32).
        dcn_stages: stages whose 3x3 convs are DCNv2 (PP-YOLO R50: ``(3,)``).
    Returns (forward): the ``return_idx`` feature maps, finest first; ``out_channels``
    lists their widths (R50 ``(1, 2, 3)``: 512, 1024, 2048; R18 ``(2, 3)``: 256, 512).
    """

    def __init__(self, depth: int = 50, return_idx: Sequence[int] = (1, 2, 3), dcn_stages: Sequence[int] = ()):
        super().__init__()
        if depth not in DEPTHS:
            raise ValueError(f"ResNetVd: depth must be one of {sorted(DEPTHS)}, got {depth}")
        kind, counts = DEPTHS[depth]
        block = BottleneckVd if kind == "bottleneck" else BasicBlockVd
        self.return_idx = tuple(return_idx)
        self.stem = nn.Sequential(
            ConvNorm(3, 32, 3, 2, act="relu"),
            ConvNorm(32, 32, 3, 1, act="relu"),
            ConvNorm(32, 64, 3, 1, act="relu"),
            nn.MaxPool2d(3, 2, 1),
        )
        c_in = 64
        stages, widths = [], []
        for i, (n, c) in enumerate(zip(counts, (64, 128, 256, 512))):
            blocks = []
            for j in range(n):
                stride = 2 if j == 0 and i > 0 else 1
                blocks.append(block(c_in, c, stride, shortcut=j > 0, dcn=i in dcn_stages))
                c_in = c * block.expansion
            stages.append(nn.Sequential(*blocks))
            widths.append(c_in)
        self.stages = nn.ModuleList(stages[: max(self.return_idx) + 1])
        self.out_channels = [widths[i] for i in self.return_idx]

    def forward(self, x: Tensor) -> list[Tensor]:
        x = self.stem(x)
        outs = []
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i in self.return_idx:
                outs.append(x)
        return outs
