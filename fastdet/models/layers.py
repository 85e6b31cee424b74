"""Building blocks shared by the detectors: conv-BN-activation, RepVGG, effective SE, SPP.

Initialisation follows PaddlePaddle's defaults, which the published PP-YOLOE models were
trained with: convolution weights ~ N(0, sqrt(2 / fan_in)) (Paddle ``Conv2D``'s default),
biases 0, BatchNorm weight 1 / bias 0, momentum 0.1 in torch terms (Paddle 0.9), eps 1e-5.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def paddle_conv_init_(conv: nn.Conv2d) -> None:
    """Paddle's default ``Conv2D`` init: N(0, sqrt(2 / (k*k*in/groups))), zero bias."""
    fan_in = conv.in_channels // conv.groups * math.prod(conv.kernel_size)
    nn.init.normal_(conv.weight, 0.0, math.sqrt(2.0 / fan_in))
    if conv.bias is not None:
        nn.init.zeros_(conv.bias)


def make_act(act: str | None) -> nn.Module:
    if act is None:
        return nn.Identity()
    acts = {"swish": nn.SiLU, "silu": nn.SiLU, "relu": nn.ReLU, "hardsigmoid": nn.Hardsigmoid,
            "sigmoid": nn.Sigmoid, "leaky": lambda: nn.LeakyReLU(0.1)}
    if act not in acts:
        raise ValueError(f"unknown activation {act!r}: expected one of {', '.join(sorted(acts))}")
    return acts[act]()


def fold_bn(weight: Tensor, bias: Tensor | None, bn: nn.BatchNorm2d) -> tuple[Tensor, Tensor]:
    """Kernel and bias of ``bn(conv(x))`` as one convolution (eval-mode statistics)."""
    std = (bn.running_var + bn.eps).sqrt()
    t = bn.weight / std  # [O]
    b = torch.zeros_like(bn.running_mean) if bias is None else bias
    return weight * t.reshape(-1, 1, 1, 1), bn.bias + (b - bn.running_mean) * t


class ConvBNAct(nn.Module):
    """Conv (no bias) -> BatchNorm -> activation; Paddle ``ConvBNLayer``."""

    def __init__(self, c_in: int, c_out: int, k: int = 3, stride: int = 1, groups: int = 1,
                 act: str | None = "swish", padding: int | None = None):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, k, stride, k // 2 if padding is None else padding,
                              groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        self.act = make_act(act)
        paddle_conv_init_(self.conv)

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.bn(self.conv(x)))

    @torch.no_grad()
    def fuse(self) -> None:
        """Fold BatchNorm into the convolution (inference only; identical eval outputs)."""
        if isinstance(self.bn, nn.Identity):
            return
        w, b = fold_bn(self.conv.weight, self.conv.bias, self.bn)
        conv = nn.Conv2d(self.conv.in_channels, self.conv.out_channels, self.conv.kernel_size,
                         self.conv.stride, self.conv.padding, groups=self.conv.groups, bias=True)
        conv.to(device=w.device, dtype=w.dtype)
        conv.weight.copy_(w)
        conv.bias.copy_(b)
        self.conv = conv
        self.bn = nn.Identity()


class RepVGGBlock(nn.Module):
    """``act(BN(conv3x3(x)) + alpha * BN(conv1x1(x)))``, fusable into one 3x3 conv (Ding et al. 2021).

    Paddle ``RepVggBlock`` (stride 1, no identity branch). ``alpha`` is a learnt scalar
    (PP-YOLOE+ ``use_alpha``); the plain PP-YOLOE models have none.
    """

    fuse_first = True  # fuse() folds its own ConvBNAct children (see Detector.fuse)

    def __init__(self, c_in: int, c_out: int, act: str | None = "swish", alpha: bool = False):
        super().__init__()
        self.conv1 = ConvBNAct(c_in, c_out, 3, act=None)
        self.conv2 = ConvBNAct(c_in, c_out, 1, act=None)
        self.alpha = nn.Parameter(torch.ones(1)) if alpha else None
        self.act = make_act(act)
        self.conv: nn.Conv2d | None = None  # set by fuse()

    def forward(self, x: Tensor) -> Tensor:
        if self.conv is not None:
            return self.act(self.conv(x))
        y2 = self.conv2(x)
        if self.alpha is not None:
            y2 = self.alpha * y2
        return self.act(self.conv1(x) + y2)

    @torch.no_grad()
    def equivalent_kernel_bias(self) -> tuple[Tensor, Tensor]:
        k3, b3 = fold_bn(self.conv1.conv.weight, None, self.conv1.bn)
        k1, b1 = fold_bn(self.conv2.conv.weight, None, self.conv2.bn)
        k1 = F.pad(k1, [1, 1, 1, 1])  # 1x1 -> centre of a 3x3
        a = 1.0 if self.alpha is None else self.alpha
        return k3 + a * k1, b3 + a * b1

    @torch.no_grad()
    def fuse(self) -> None:
        """Replace both branches by one 3x3 conv with bias (inference only)."""
        if self.conv is not None:
            return
        k, b = self.equivalent_kernel_bias()
        conv = nn.Conv2d(k.shape[1], k.shape[0], 3, 1, 1, bias=True).to(device=k.device, dtype=k.dtype)
        conv.weight.copy_(k)
        conv.bias.copy_(b)
        self.conv = conv
        del self.conv1, self.conv2
        self.alpha = None


class BasicBlock(nn.Module):
    """ConvBNAct 3x3 -> RepVGG block, with an optional residual; Paddle cspresnet ``BasicBlock``."""

    def __init__(self, c_in: int, c_out: int, act: str = "swish", shortcut: bool = True, alpha: bool = False):
        super().__init__()
        if shortcut and c_in != c_out:
            raise ValueError(f"BasicBlock with shortcut needs c_in == c_out, got {c_in} and {c_out}")
        self.conv1 = ConvBNAct(c_in, c_out, 3, act=act)
        self.conv2 = RepVGGBlock(c_out, c_out, act=act, alpha=alpha)
        self.shortcut = shortcut

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv2(self.conv1(x))
        return x + y if self.shortcut else y


class EffectiveSE(nn.Module):
    """Effective squeeze-excitation (CenterMask, Lee & Park 2020): ``x * hardsigmoid(fc(mean(x)))``."""

    def __init__(self, channels: int):
        super().__init__()
        self.fc = nn.Conv2d(channels, channels, 1, bias=True)
        self.act = nn.Hardsigmoid()
        paddle_conv_init_(self.fc)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.act(self.fc(x.mean((2, 3), keepdim=True)))


class SPP(nn.Module):
    """Concat of ``x`` and stride-1 max-pools of ``x``, then a ConvBNAct; Paddle custom_pan ``SPP``."""

    def __init__(self, c_in: int, c_out: int, k: int = 1, pool_sizes: Sequence[int] = (5, 9, 13), act: str = "swish"):
        super().__init__()
        self.pools = nn.ModuleList(nn.MaxPool2d(s, 1, s // 2) for s in pool_sizes)
        self.conv = ConvBNAct(c_in, c_out, k, act=act)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(torch.cat([x] + [p(x) for p in self.pools], dim=1))
