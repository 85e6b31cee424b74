"""PaddleDetection 2.6's PP-YOLOE crn (``ppdet/modeling/backbones/cspresnet.py``,
``necks/custom_pan.py``, ``heads/ppyoloe_head.py``) transcribed into torch, line by line: the
same sublayers under the same names, added in the same order, and the same eval forward.

Its state dict is therefore a released ``.pdparams``'s names, order and shapes at any
(width, depth) (BatchNorm statistics renamed ``_mean`` / ``_variance``, no
``num_batches_tracked``, the fixed DFL projection ``yolo_head.proj_conv.weight`` stored),
and its output is Paddle's dense boxes and scores. tests/test_convert_paddle.py checks it
against what Paddle's own modules recorded (tools/record_paddle_fixtures.py): crn_s's key
manifest, and a narrow model's outputs. Only the recorded size (s) could be run under
Paddle; this stands in for Paddle at m, l and x, whose neck stages hold 2, 3 and 4 blocks.
Written from Paddle's source, not from fastdet's model, which it checks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# configs/ppyoloe/ppyoloe_crn_{s,m,l,x}_300e_coco.yml: (width_mult, depth_mult)
MULTS = {"s": (0.50, 0.33), "m": (0.75, 0.67), "l": (1.0, 1.0), "x": (1.25, 1.33)}


def swish(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


def paddle_hardsigmoid(x: Tensor) -> Tensor:
    """Paddle's F.hardsigmoid defaults: slope 0.1666667, offset 0.5."""
    return (x * 0.1666667 + 0.5).clamp(0, 1)


class ConvBNLayer(nn.Module):
    def __init__(self, ch_in: int, ch_out: int, filter_size: int = 3, stride: int = 1, padding: int = 0,
                 act=None):
        super().__init__()
        self.conv = nn.Conv2d(ch_in, ch_out, filter_size, stride, padding, bias=False)
        self.bn = nn.BatchNorm2d(ch_out)  # Paddle's BatchNorm2D: epsilon 1e-5, as torch's
        self.act = act or (lambda x: x)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class RepVggBlock(nn.Module):
    def __init__(self, ch_in: int, ch_out: int, act):
        super().__init__()
        self.conv1 = ConvBNLayer(ch_in, ch_out, 3, stride=1, padding=1, act=None)
        self.conv2 = ConvBNLayer(ch_in, ch_out, 1, stride=1, padding=0, act=None)
        self.act = act

    def forward(self, x):
        return self.act(self.conv1(x) + self.conv2(x))


class BasicBlock(nn.Module):
    def __init__(self, ch_in: int, ch_out: int, act, shortcut: bool = True):
        super().__init__()
        assert ch_in == ch_out
        self.conv1 = ConvBNLayer(ch_in, ch_out, 3, stride=1, padding=1, act=act)
        self.conv2 = RepVggBlock(ch_out, ch_out, act=act)
        self.shortcut = shortcut

    def forward(self, x):
        y = self.conv2(self.conv1(x))
        return x + y if self.shortcut else y


class EffectiveSELayer(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.fc = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        return x * paddle_hardsigmoid(self.fc(x.mean((2, 3), keepdim=True)))


class CSPResStage(nn.Module):
    def __init__(self, ch_in: int, ch_out: int, n: int, stride: int, act):
        super().__init__()
        ch_mid = (ch_in + ch_out) // 2
        self.conv_down = ConvBNLayer(ch_in, ch_mid, 3, stride=2, padding=1, act=act) if stride == 2 else None
        self.conv1 = ConvBNLayer(ch_mid, ch_mid // 2, 1, act=act)
        self.conv2 = ConvBNLayer(ch_mid, ch_mid // 2, 1, act=act)
        self.blocks = nn.Sequential(*[BasicBlock(ch_mid // 2, ch_mid // 2, act=act, shortcut=True) for _ in range(n)])
        self.attn = EffectiveSELayer(ch_mid)
        self.conv3 = ConvBNLayer(ch_mid, ch_out, 1, act=act)

    def forward(self, x):
        if self.conv_down is not None:
            x = self.conv_down(x)
        y = torch.cat([self.conv1(x), self.blocks(self.conv2(x))], 1)
        return self.conv3(self.attn(y))


class CSPResNet(nn.Module):
    """layers [3, 6, 6, 3], channels [64, 128, 256, 512, 1024], return_idx [1, 2, 3],
    use_large_stem, act swish (configs/ppyoloe/_base_/ppyoloe_crn.yml)."""

    def __init__(self, width_mult: float, depth_mult: float, layers=(3, 6, 6, 3), channels=(64, 128, 256, 512, 1024)):
        super().__init__()
        channels = [max(round(c * width_mult), 1) for c in channels]
        layers = [max(round(n * depth_mult), 1) for n in layers]
        act = swish
        self.stem = nn.Sequential()
        self.stem.add_module("conv1", ConvBNLayer(3, channels[0] // 2, 3, stride=2, padding=1, act=act))
        self.stem.add_module("conv2", ConvBNLayer(channels[0] // 2, channels[0] // 2, 3, stride=1, padding=1, act=act))
        self.stem.add_module("conv3", ConvBNLayer(channels[0] // 2, channels[0], 3, stride=1, padding=1, act=act))
        self.stages = nn.Sequential(*[CSPResStage(channels[i], channels[i + 1], layers[i], 2, act=act)
                                      for i in range(len(channels) - 1)])
        self.out_channels = channels[2:]  # return_idx [1, 2, 3]

    def forward(self, x):
        outs = []
        x = self.stem(x)
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i in (1, 2, 3):
                outs.append(x)
        return outs


class SPP(nn.Module):
    def __init__(self, ch_in: int, ch_out: int, k: int, pool_size, act):
        super().__init__()
        self.pool = [nn.MaxPool2d(s, 1, s // 2) for s in pool_size]  # no weights: not sublayers here
        self.conv = ConvBNLayer(ch_in, ch_out, k, padding=k // 2, act=act)

    def forward(self, x):
        return self.conv(torch.cat([x] + [p(x) for p in self.pool], 1))


class CSPStage(nn.Module):
    def __init__(self, ch_in: int, ch_out: int, n: int, act, spp: bool):
        super().__init__()
        ch_mid = int(ch_out // 2)
        self.conv1 = ConvBNLayer(ch_in, ch_mid, 1, act=act)
        self.conv2 = ConvBNLayer(ch_in, ch_mid, 1, act=act)
        self.convs = nn.Sequential()
        for i in range(n):  # Paddle's loop: block i, then the SPP after block (n - 1) // 2
            self.convs.add_module(str(i), BasicBlock(ch_mid, ch_mid, act=act, shortcut=False))
            if i == (n - 1) // 2 and spp:
                self.convs.add_module("spp", SPP(ch_mid * 4, ch_mid, 1, [5, 9, 13], act=act))
        self.conv3 = ConvBNLayer(ch_mid * 2, ch_out, 1, act=act)

    def forward(self, x):
        return self.conv3(torch.cat([self.conv1(x), self.convs(self.conv2(x))], 1))


class CustomCSPPAN(nn.Module):
    """out_channels [768, 384, 192], stage_num 1, block_num 3, act swish, spp true."""

    def __init__(self, in_channels, width_mult: float, depth_mult: float, out_channels=(768, 384, 192)):
        super().__init__()
        out_channels = [max(round(c * width_mult), 1) for c in out_channels]
        block_num = max(round(3 * depth_mult), 1)
        act = swish
        self.num_blocks = len(in_channels)
        self.out_channels = out_channels
        in_channels = in_channels[::-1]
        fpn_stages, fpn_routes = [], []
        ch_pre = 0  # the level above's width: its route, halved, joins this level's input
        for i, (ch_in, ch_out) in enumerate(zip(in_channels, out_channels)):
            if i > 0:
                ch_in += ch_pre // 2
            stage = nn.Sequential()
            stage.add_module("0", CSPStage(ch_in, ch_out, block_num, act=act, spp=(i == 0)))
            fpn_stages.append(stage)
            if i < self.num_blocks - 1:
                fpn_routes.append(ConvBNLayer(ch_out, ch_out // 2, 1, stride=1, padding=0, act=act))
            ch_pre = ch_out
        self.fpn_stages = nn.ModuleList(fpn_stages)
        self.fpn_routes = nn.ModuleList(fpn_routes)
        pan_stages, pan_routes = [], []
        for i in reversed(range(self.num_blocks - 1)):
            pan_routes.append(ConvBNLayer(out_channels[i + 1], out_channels[i + 1], 3, stride=2, padding=1, act=act))
            stage = nn.Sequential()
            stage.add_module("0", CSPStage(out_channels[i] + out_channels[i + 1], out_channels[i], block_num,
                                           act=act, spp=False))
            pan_stages.append(stage)
        self.pan_stages = nn.ModuleList(pan_stages[::-1])
        self.pan_routes = nn.ModuleList(pan_routes[::-1])

    def forward(self, blocks):
        fpn_feats, route = [], None
        for i, block in enumerate(blocks[::-1]):
            if i > 0:
                block = torch.cat([route, block], 1)
            route = self.fpn_stages[i](block)
            fpn_feats.append(route)
            if i < self.num_blocks - 1:
                route = F.interpolate(self.fpn_routes[i](route), scale_factor=2.0, mode="nearest")
        pan_feats = [fpn_feats[-1]]
        route = fpn_feats[-1]
        for i in reversed(range(self.num_blocks - 1)):
            route = self.pan_stages[i](torch.cat([self.pan_routes[i](route), fpn_feats[i]], 1))
            pan_feats.append(route)
        return pan_feats[::-1]  # strides 32, 16, 8


class ESEAttn(nn.Module):
    def __init__(self, feat_channels: int, act):
        super().__init__()
        self.fc = nn.Conv2d(feat_channels, feat_channels, 1)
        self.conv = ConvBNLayer(feat_channels, feat_channels, 1, act=act)

    def forward(self, feat, avg_feat):
        return self.conv(feat * torch.sigmoid(self.fc(avg_feat)))


class PPYOLOEHead(nn.Module):
    """fpn_strides [32, 16, 8], grid_cell_offset 0.5, reg_max 16; ``forward`` is
    ``forward_eval`` then ``post_process`` with ``exclude_post_process`` (input pixels)."""

    def __init__(self, in_channels, num_classes: int = 80, reg_max: int = 16, fpn_strides=(32, 16, 8)):
        super().__init__()
        self.num_classes, self.reg_channels, self.fpn_strides = num_classes, reg_max + 1, fpn_strides
        self.stem_cls = nn.ModuleList(ESEAttn(c, swish) for c in in_channels)
        self.stem_reg = nn.ModuleList(ESEAttn(c, swish) for c in in_channels)
        self.pred_cls = nn.ModuleList(nn.Conv2d(c, num_classes, 3, padding=1) for c in in_channels)
        self.pred_reg = nn.ModuleList(nn.Conv2d(c, 4 * self.reg_channels, 3, padding=1) for c in in_channels)
        self.proj_conv = nn.Conv2d(self.reg_channels, 1, 1, bias=False)
        with torch.no_grad():
            self.proj_conv.weight.copy_(torch.linspace(0, reg_max, self.reg_channels).reshape(1, -1, 1, 1))

    def forward(self, feats):
        points, strides, scores, dists = [], [], [], []
        for i, feat in enumerate(feats):
            _, _, h, w = feat.shape
            sy, sx = torch.meshgrid(torch.arange(h) + 0.5, torch.arange(w) + 0.5, indexing="ij")
            points.append(torch.stack([sx, sy], -1).reshape(-1, 2).to(feat.dtype))
            strides.append(torch.full((h * w, 1), self.fpn_strides[i], dtype=feat.dtype))
            avg = F.adaptive_avg_pool2d(feat, (1, 1))
            cls_logit = self.pred_cls[i](self.stem_cls[i](feat, avg) + feat)
            reg = self.pred_reg[i](self.stem_reg[i](feat, avg))
            reg = reg.reshape(-1, 4, self.reg_channels, h * w).permute(0, 2, 3, 1)  # [B, 17, L, 4]
            dists.append(self.proj_conv(F.softmax(reg, 1)).squeeze(1))  # [B, L, 4]
            scores.append(torch.sigmoid(cls_logit).reshape(-1, self.num_classes, h * w))
        dist, pts, stride = torch.cat(dists, 1), torch.cat(points), torch.cat(strides)
        boxes = torch.cat([pts - dist[..., :2], pts + dist[..., 2:]], -1) * stride  # batch_distance2bbox
        return boxes, torch.cat(scores, -1).transpose(1, 2)  # [B, A, 4] xyxy px, [B, A, 80]


class PPYOLOE(nn.Module):
    """PaddleDetection's YOLOv3 architecture wrapper: ``backbone``, ``neck``, ``yolo_head``."""

    def __init__(self, width_mult: float, depth_mult: float, num_classes: int = 80):
        super().__init__()
        self.backbone = CSPResNet(width_mult, depth_mult)
        self.neck = CustomCSPPAN(self.backbone.out_channels, width_mult, depth_mult)
        self.yolo_head = PPYOLOEHead(self.neck.out_channels, num_classes)

    def forward(self, x):
        return self.yolo_head(self.neck(self.backbone(x)))


def paddle_name(torch_name: str) -> str:
    return torch_name.replace(".running_mean", "._mean").replace(".running_var", "._variance")


def paddle_state(model: nn.Module) -> dict[str, Tensor]:
    """The model's state as Paddle names it, in Paddle's order (what ``paddle.save`` writes)."""
    return {paddle_name(k): v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}


def load_paddle_state(model: nn.Module, state: dict[str, Tensor]) -> nn.Module:
    own = {paddle_name(k): k for k in model.state_dict() if not k.endswith("num_batches_tracked")}
    assert set(own) == set(state)
    model.load_state_dict({own[k]: torch.as_tensor(v) for k, v in state.items()}, strict=False)
    return model.eval()
