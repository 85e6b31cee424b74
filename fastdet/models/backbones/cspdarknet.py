"""CSPDarknet (YOLOX's backbone) and the blocks YOLOX builds everything from.

Follows Megvii's YOLOX (yolox/models/network_blocks.py, darknet.py): a Focus stem
(space-to-depth then a 3x3 conv), four stages of a stride-2 conv and a CSP layer, SPP
before the last CSP layer. Depthwise mode (YOLOX-nano) replaces the 3x3 convs of the
stages and bottlenecks by a depthwise 3x3 + pointwise 1x1 pair; the stem stays dense.

Initialisation is PyTorch's default (Megvii never re-initialises convolutions); the
YOLOX builder then sets every BatchNorm to eps 1e-3 and momentum 0.03.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fastdet.models.layers import ConvBNAct


def base_conv(c_in: int, c_out: int, k: int, stride: int = 1, groups: int = 1, act: str = "silu") -> ConvBNAct:
    """Megvii ``BaseConv``: conv (no bias, pad (k - 1) / 2) -> BN -> act, PyTorch's default init."""
    m = ConvBNAct(c_in, c_out, k, stride, groups=groups, act=act, padding=(k - 1) // 2)
    m.conv.reset_parameters()  # ConvBNAct applies Paddle's init; YOLOX keeps torch's
    return m


class DWConv(nn.Module):
    """Depthwise k x k BaseConv (groups = c_in) followed by a pointwise 1x1 BaseConv."""

    def __init__(self, c_in: int, c_out: int, k: int, stride: int = 1, act: str = "silu"):
        super().__init__()
        self.dconv = base_conv(c_in, c_in, k, stride, groups=c_in, act=act)
        self.pconv = base_conv(c_in, c_out, 1, 1, act=act)

    def forward(self, x: Tensor) -> Tensor:
        return self.pconv(self.dconv(x))


def conv(c_in: int, c_out: int, k: int, stride: int = 1, depthwise: bool = False, act: str = "silu") -> nn.Module:
    """``DWConv`` in depthwise mode, else a ``BaseConv`` (Megvii's ``Conv = DWConv if depthwise else BaseConv``)."""
    return DWConv(c_in, c_out, k, stride, act) if depthwise else base_conv(c_in, c_out, k, stride, act=act)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (expansion 1.0 inside a CSP layer), with a residual when ``shortcut`` and c_in == c_out."""

    def __init__(self, c_in: int, c_out: int, shortcut: bool = True, depthwise: bool = False, act: str = "silu"):
        super().__init__()
        self.conv1 = base_conv(c_in, c_out, 1, act=act)
        self.conv2 = conv(c_out, c_out, 3, 1, depthwise, act)
        self.use_add = shortcut and c_in == c_out

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv2(self.conv1(x))
        return x + y if self.use_add else y


class CSPLayer(nn.Module):
    """YOLOv5's C3: ``conv3(cat(m(conv1(x)), conv2(x)))`` with ``c_out // 2`` hidden channels."""

    def __init__(self, c_in: int, c_out: int, n: int = 1, shortcut: bool = True, depthwise: bool = False,
                 act: str = "silu"):
        super().__init__()
        hidden = int(c_out * 0.5)
        self.conv1 = base_conv(c_in, hidden, 1, act=act)
        self.conv2 = base_conv(c_in, hidden, 1, act=act)
        self.conv3 = base_conv(2 * hidden, c_out, 1, act=act)
        self.m = nn.Sequential(*(Bottleneck(hidden, hidden, shortcut, depthwise, act) for _ in range(n)))

    def forward(self, x: Tensor) -> Tensor:
        return self.conv3(torch.cat([self.m(self.conv1(x)), self.conv2(x)], dim=1))


class Focus(nn.Module):
    """Space-to-depth ([B, 3, H, W] -> [B, 12, H/2, W/2]; slices TL, BL, TR, BR) then a BaseConv."""

    def __init__(self, c_in: int, c_out: int, k: int = 3, act: str = "silu"):
        super().__init__()
        self.conv = base_conv(4 * c_in, c_out, k, 1, act=act)

    def forward(self, x: Tensor) -> Tensor:
        tl, tr = x[..., ::2, ::2], x[..., ::2, 1::2]
        bl, br = x[..., 1::2, ::2], x[..., 1::2, 1::2]
        return self.conv(torch.cat([tl, bl, tr, br], dim=1))


class SPPBottleneck(nn.Module):
    """1x1 to c_in / 2, concat with stride-1 max-pools 5/9/13 of it, 1x1 to c_out."""

    def __init__(self, c_in: int, c_out: int, kernel_sizes: tuple[int, ...] = (5, 9, 13), act: str = "silu"):
        super().__init__()
        hidden = c_in // 2
        self.conv1 = base_conv(c_in, hidden, 1, act=act)
        self.m = nn.ModuleList(nn.MaxPool2d(k, 1, k // 2) for k in kernel_sizes)
        self.conv2 = base_conv(hidden * (len(kernel_sizes) + 1), c_out, 1, act=act)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        return self.conv2(torch.cat([x] + [m(x) for m in self.m], dim=1))


class CSPDarknet(nn.Module):
    """Focus stem and dark2..dark5; returns dark3, dark4, dark5 (strides 8, 16, 32), finest first.

    Widths are ``int(64 * width)`` x (1, 2, 4, 8, 16); CSP depths ``max(round(3 * depth), 1)`` x (1, 3, 3, 1).
    """

    def __init__(self, depth: float, width: float, depthwise: bool = False, act: str = "silu"):
        super().__init__()
        c = int(width * 64)
        n = max(round(depth * 3), 1)
        self.stem = Focus(3, c, k=3, act=act)
        self.dark2 = nn.Sequential(conv(c, c * 2, 3, 2, depthwise, act), CSPLayer(c * 2, c * 2, n, True, depthwise, act))
        self.dark3 = nn.Sequential(conv(c * 2, c * 4, 3, 2, depthwise, act),
                                   CSPLayer(c * 4, c * 4, n * 3, True, depthwise, act))
        self.dark4 = nn.Sequential(conv(c * 4, c * 8, 3, 2, depthwise, act),
                                   CSPLayer(c * 8, c * 8, n * 3, True, depthwise, act))
        self.dark5 = nn.Sequential(conv(c * 8, c * 16, 3, 2, depthwise, act), SPPBottleneck(c * 16, c * 16, act=act),
                                   CSPLayer(c * 16, c * 16, n, False, depthwise, act))
        self.out_channels = [c * 4, c * 8, c * 16]

    def forward(self, x: Tensor) -> list[Tensor]:
        x = self.dark2(self.stem(x))
        c3 = self.dark3(x)
        c4 = self.dark4(c3)
        c5 = self.dark5(c4)
        return [c3, c4, c5]
