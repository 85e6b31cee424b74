"""CSPResNet, the PP-YOLOE backbone (PaddleDetection ppdet/modeling/backbones/cspresnet.py).

Stem (large: three 3x3 ConvBNAct, the first stride 2), then four CSPResStages, each
a stride-2 ConvBNAct down to ``(c_in + c_out) // 2`` channels, two 1x1 branches of half
that width, one through ``n`` residual BasicBlocks (3x3 ConvBNAct + RepVGG), concat,
effective SE, 1x1 ConvBNAct to ``c_out``. Outputs are stages ``return_idx`` (strides 8,
16, 32 for ``(1, 2, 3)``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from fastdet.models.layers import BasicBlock, ConvBNAct, EffectiveSE


class CSPResStage(nn.Module):
    def __init__(self, c_in: int, c_out: int, n: int, stride: int, act: str = "swish", alpha: bool = False):
        super().__init__()
        c_mid = (c_in + c_out) // 2
        self.conv_down = ConvBNAct(c_in, c_mid, 3, stride=2, act=act) if stride == 2 else None
        if stride != 2 and c_in != c_mid:
            raise ValueError(f"CSPResStage with stride {stride} needs c_in == (c_in + c_out) // 2")
        self.conv1 = ConvBNAct(c_mid, c_mid // 2, 1, act=act)
        self.conv2 = ConvBNAct(c_mid, c_mid // 2, 1, act=act)
        self.blocks = nn.Sequential(
            *[BasicBlock(c_mid // 2, c_mid // 2, act=act, shortcut=True, alpha=alpha) for _ in range(n)]
        )
        self.attn = EffectiveSE(c_mid)
        self.conv3 = ConvBNAct(c_mid, c_out, 1, act=act)

    def forward(self, x: Tensor) -> Tensor:
        if self.conv_down is not None:
            x = self.conv_down(x)
        y = torch.cat([self.conv1(x), self.blocks(self.conv2(x))], dim=1)
        return self.conv3(self.attn(y))


def scale_channels(channels: Sequence[int], width_mult: float) -> list[int]:
    """Paddle's ``max(round(c * width_mult), 1)`` (Python's round: half to even)."""
    return [max(round(c * width_mult), 1) for c in channels]


def scale_depths(layers: Sequence[int], depth_mult: float) -> list[int]:
    return [max(round(n * depth_mult), 1) for n in layers]


class CSPResNet(nn.Module):
    """CSPResNet with the published multipliers (s 0.33/0.50, m 0.67/0.75, l 1/1, x 1.33/1.25).

    Args:
        layers / channels: the l-size stage depths and widths (stem width first).
        width_mult, depth_mult: scale channels and block counts as Paddle does.
        return_idx: which stages to return; ``out_channels`` lists their widths.
        use_alpha: learnt scale on the RepVGG 1x1 branch (PP-YOLOE+).
    """

    def __init__(
        self,
        layers: Sequence[int] = (3, 6, 6, 3),
        channels: Sequence[int] = (64, 128, 256, 512, 1024),
        width_mult: float = 1.0,
        depth_mult: float = 1.0,
        return_idx: Sequence[int] = (1, 2, 3),
        act: str = "swish",
        use_large_stem: bool = True,
        use_alpha: bool = False,
    ):
        super().__init__()
        ch = scale_channels(channels, width_mult)
        depths = scale_depths(layers, depth_mult)
        if use_large_stem:
            self.stem = nn.Sequential(
                ConvBNAct(3, ch[0] // 2, 3, stride=2, act=act),
                ConvBNAct(ch[0] // 2, ch[0] // 2, 3, act=act),
                ConvBNAct(ch[0] // 2, ch[0], 3, act=act),
            )
        else:
            self.stem = nn.Sequential(
                ConvBNAct(3, ch[0] // 2, 3, stride=2, act=act),
                ConvBNAct(ch[0] // 2, ch[0], 3, act=act),
            )
        self.stages = nn.ModuleList(
            CSPResStage(ch[i], ch[i + 1], depths[i], 2, act=act, alpha=use_alpha) for i in range(len(ch) - 1)
        )
        self.return_idx = tuple(return_idx)
        self.out_channels = [ch[i + 1] for i in self.return_idx]

    def forward(self, x: Tensor) -> list[Tensor]:
        x = self.stem(x)
        outs = []
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i in self.return_idx:
                outs.append(x)
        return outs
