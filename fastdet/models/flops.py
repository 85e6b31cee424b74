"""Parameter and FLOP counts in the convention of the published PP-YOLOE table.

Convention (checked against PaddleDetection's model zoo, 80 classes, 640x640, batch 1):

- **Params** are those of the *deploy* model: every RepVGG block re-parameterised into
  one 3x3 conv with bias (``convert_to_deploy``), BatchNorm layers elsewhere kept.
  The training-form model has ~2-4 % more (the 1x1 branch and its BN), which does not
  match the table; the deploy form matches it to 0.1 % (s 7.926 M vs 7.93 published).
- **FLOPs** are 2 x multiply-accumulates of convolutions and matrix products of the same
  deploy model (``torch.utils.flop_counter``'s convention; biases, BN, activations,
  pooling and elementwise ops are not counted). s: 17.27 G vs 17.36 published (-0.5 %).

YOLOX's table (Megvii ``get_model_info``: thop's count x 2 at the test size) also counts
BatchNorm, as 2 ops per output element (x 2 = 4 FLOPs per element): pass
``norm_flops_per_element=4`` to reproduce it (YOLOX-s 26.80 G vs 26.8 published; without
the BatchNorm term 26.69 G, and nano 1.045 G vs 1.08, -3.2 %).

Both are counted on the meta device, so even x at 640 costs no real compute.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fastdet.models import build_model


def deploy_copy(model: nn.Module) -> nn.Module:
    """A copy with every multi-branch block (``fuse_first``, e.g. RepVGG) re-parameterised."""
    m = copy.deepcopy(model).eval()
    for mod in list(m.modules()):
        if getattr(mod, "fuse_first", False):
            mod.fuse()
    return m


def count_params(model: nn.Module, deploy: bool = True) -> int:
    """Parameters (trainable or not) of ``model``, or of its deploy form when ``deploy``."""
    m = deploy_copy(model) if deploy else model
    return sum(p.numel() for p in m.parameters())


def count_flops(model: nn.Module, img_size: int | tuple[int, int] = 640, deploy: bool = True,
                norm_flops_per_element: int = 0) -> int:
    """FLOPs (2 x MACs) of one eval forward on a ``[1, 3, H, W]`` input, run on the meta device,
    plus ``norm_flops_per_element`` per BatchNorm output element."""
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    m = deploy_copy(model) if deploy else copy.deepcopy(model).eval()
    m = m.to("meta")
    x = torch.empty(1, 3, h, w, device="meta")
    norm_elements = [0]

    def count_norm(mod: nn.Module, inputs, out) -> None:
        norm_elements[0] += out.numel()

    hooks = [mod.register_forward_hook(count_norm) for mod in m.modules() if isinstance(mod, nn.BatchNorm2d)]
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        m(x)
    for hk in hooks:
        hk.remove()
    return counter.get_total_flops() + norm_flops_per_element * norm_elements[0]


def profile(arch: str, size: str, num_classes: int = 80, img_size: int = 640) -> tuple[int, int]:
    """``(params, flops)`` of ``build_model(arch, size, num_classes)`` in the published convention."""
    with torch.device("meta"):
        model = build_model(arch, size, num_classes)
    return count_params(model), count_flops(model, img_size)
