"""ResNet-50 from torchvision as a detection backbone: C3, C4, C5 (strides 8, 16, 32).

torchvision's ``resnet50`` is ResNet v1.5 (stride on the bottleneck's 3x3 conv), which is
PaddleDetection's variant 'b' that FCOS R50-FPN uses, and its module names are those of
every torchvision ImageNet checkpoint, so a local ``resnet50`` state dict loads as is
(:func:`load_backbone_weights`).

Two forms:

- ``pretrained_form=True`` (the published recipes, which start from ImageNet weights):
  every BatchNorm is torchvision's ``FrozenBatchNorm2d`` (statistics and affine fixed,
  Paddle ``freeze_norm``) and the stem and the first ``freeze_at + 1`` stages are frozen
  (Paddle ``freeze_at``: 0 freezes the stem and res2, as torchvision's
  ``trainable_layers=3`` does).
- ``pretrained_form=False`` (training from scratch, e.g. the demo): frozen statistics and
  frozen stages only make sense for weights that were trained elsewhere. From a random
  init, FrozenBatchNorm is the identity (mean 0, var 1), which leaves a 50-layer network
  without normalisation, and frozen stages would keep random filters forever; so this
  form uses trainable ``BatchNorm2d`` and freezes nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch import Tensor, nn
from torchvision.models.resnet import Bottleneck, ResNet
from torchvision.ops import FrozenBatchNorm2d

from fastdet.runtime.checkpoint import backbone_state, load_torch_file

log = logging.getLogger(__name__)

# depth -> blocks per stage (res2..res5)
DEPTHS = {50: (3, 4, 6, 3)}


class ResNetBackbone(ResNet):
    """torchvision ResNet without its classifier; ``forward`` returns [C3, C4, C5].

    Args:
        depth: 50.
        pretrained_form: frozen BatchNorm and frozen early stages (see the module doc).
        freeze_at: with ``pretrained_form``, freeze the stem and stages 0..freeze_at
            (0 = res2, as FCOS; -1 freezes nothing).
    """

    out_channels = (512, 1024, 2048)
    strides = (8, 16, 32)

    def __init__(self, depth: int = 50, pretrained_form: bool = True, freeze_at: int = 0):
        if depth not in DEPTHS:
            raise ValueError(f"ResNetBackbone: depth must be one of {sorted(DEPTHS)}, got {depth}")
        norm = FrozenBatchNorm2d if pretrained_form else nn.BatchNorm2d
        super().__init__(Bottleneck, list(DEPTHS[depth]), norm_layer=norm)
        del self.fc, self.avgpool  # detection needs the feature maps only
        self.pretrained_form = pretrained_form
        if pretrained_form and freeze_at >= 0:
            stages = [nn.ModuleList([self.conv1, self.bn1])] + [self.layer1, self.layer2, self.layer3, self.layer4]
            for m in stages[: freeze_at + 2]:
                m.requires_grad_(False)

    def forward(self, x: Tensor) -> list[Tensor]:  # type: ignore[override]
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        c2 = self.layer1(x)
        c3 = self.layer2(c2)
        c4 = self.layer3(c3)
        c5 = self.layer4(c4)
        return [c3, c4, c5]


def load_backbone_weights(backbone: nn.Module, path: str | Path) -> tuple[list[str], list[str]]:
    """Load a torchvision-format ResNet state dict (e.g. ``torchvision.models.resnet50``'s,
    saved with ``torch.save(model.state_dict(), path)``) into ``backbone``.

    Keys the backbone lacks (the classifier ``fc.*``) and backbone tensors the file lacks
    are each named in one log line; a shape mismatch or an unreadable file raises a
    ``ValueError`` with one sentence. Returns ``(missing, unexpected)``.
    """
    path = Path(path)
    try:
        state = load_torch_file(path)
    except (OSError, ValueError) as e:  # missing, damaged, or needs code to unpickle: one line from the reader
        raise ValueError(f"--backbone-weights {path}: cannot read a state dict ({e})") from e
    state = backbone_state(state, path)[0]  # a {"state_dict": ...} wrapper, a fastdet checkpoint's backbone
    if not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"--backbone-weights {path}: expected a dict of tensors (a torchvision state_dict)")
    own = backbone.state_dict()
    for k, v in state.items():
        if k in own and own[k].shape != v.shape:
            raise ValueError(f"--backbone-weights {path}: {k} has shape {tuple(v.shape)}, the backbone expects "
                             f"{tuple(own[k].shape)} (is it a ResNet-50 state dict?)")
    result = backbone.load_state_dict(state, strict=False)
    # FrozenBatchNorm2d has no num_batches_tracked, and drops it itself while loading.
    missing = list(result.missing_keys)
    unexpected = [k for k in result.unexpected_keys if not k.endswith("num_batches_tracked")]
    loaded = len(own) - len(missing)
    log.info("backbone weights: %d tensors loaded from %s", loaded, path)
    if missing:
        log.warning("backbone weights: missing in %s (left at their init): %s", path, ", ".join(missing))
    if unexpected:
        log.warning("backbone weights: unexpected in %s (ignored): %s", path, ", ".join(unexpected))
    return missing, unexpected
