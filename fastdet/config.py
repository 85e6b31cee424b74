"""Typed configuration: frozen dataclasses and command-line overrides.

A run is described by one :class:`Config` made of six sections: five shared ones
(model, data, optim, compile, run) and ``family``, the options of the model family
(its type is the family's :class:`FamilyOptions` subclass, given by the registry:
``fastdet.registry``). The presets (the published recipes per architecture and size)
and the demo overrides are declared by each family next to its model and resolved by
``fastdet.registry.get_preset``; this module knows no architecture. The command line
overrides any field with ``--set section.field=value`` (type-checked), family options
included (``--set family.static_assigner_epoch=30``), or through the dedicated flags of
``fastdet.train``. The resolved config is written as YAML into the run directory and
stored in every checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import json
import types
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional, Union

import yaml


class ConfigError(ValueError):
    """A user-facing configuration error; its message is one sentence."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "ppyoloe"
    size: str = "s"
    num_classes: int = 80
    # Keep BatchNorm running statistics fixed while training (fine-tuning, and the
    # DDP-vs-single-process equivalence test on the CPU, where SyncBatchNorm is unavailable).
    freeze_bn: bool = False
    # Under torchrun, normalise with the statistics of the whole batch over every rank
    # (fastdet.engine.sync_bn: traceable with --compile). On in the presets of the
    # families trained so (PaddleDetection norm_type: sync_bn: PP-YOLOE, PP-YOLO).
    sync_bn: bool = False
    # Under torchrun without sync_bn: average the BatchNorm running statistics over the
    # ranks before each evaluation and checkpoint (Megvii's all_reduce_norm; YOLOX).
    all_reduce_bn_stats: bool = False
    # A local state dict to start the backbone from (--backbone-weights; FCOS: a torchvision
    # ResNet-50's, its ImageNet start; nothing is downloaded). Loaded when a run starts fresh.
    backbone_weights: Optional[str] = None
    # Keep the backbone as the run starts it (--freeze-backbone: fine-tuning on a small set
    # from --ckpt or --backbone-weights; mmdetection's frozen_stages, ultralytics' freeze,
    # PaddleDetection's freeze_at + freeze_norm): its parameters take no gradient and no
    # optimizer state, its BatchNorm statistics stay fixed; the neck and head train.
    freeze_backbone: bool = False


@dataclass(frozen=True)
class DataConfig:
    # "demo" (generated on first use) or a COCO root holding annotations/ and {train,val}2017/.
    data: str = "demo"
    train_ann: Optional[str] = None
    val_ann: Optional[str] = None
    train_images: Optional[str] = None
    val_images: Optional[str] = None
    # "auto": DALI on CUDA when it is installed, the torch DataLoader otherwise.
    loader: str = "auto"
    batch_size: int = 8  # per process (images per GPU, as PaddleDetection counts)
    eval_batch_size: int = 8
    img_size: int = 640  # evaluation size; also the largest training size bucket if multiscale is off
    # Training size buckets: one is drawn per batch (PP-YOLOE BatchRandomResize).
    train_sizes: tuple[int, ...] = tuple(range(320, 769, 32))
    multiscale: bool = True
    size_period: int = 1  # steps between two size draws (YOLOX: 10; PP-YOLOE: every batch)
    max_boxes: int = 100  # M of the padded ground truth [B, M, 4]
    num_workers: int = 4
    # Off: the family's phases keep only their Resize and Normalize stages (the stages
    # themselves, and their probabilities, are the family's: ``family.*`` options).
    augment: bool = True
    keep_empty_train: bool = False  # train on images without annotations too
    # Image files checked when the annotations are read: "none", "open" (exists, header
    # readable, size matches the JSON) or "decode" (every pixel; cached under cache_dir).
    check_images: str = "open"
    channels_last: bool = False
    cache_dir: str = "~/.cache/fastdet"


@dataclass(frozen=True)
class OptimConfig:
    # lr = base_lr * global_batch / ref_batch (PP-YOLOE-s: 0.04 at 8x32).
    base_lr: float = 0.04
    ref_batch: int = 256
    # "sgd": momentum SGD with coupled L2 (the published recipes); "adamw": decoupled
    # weight decay, betas (momentum, beta2); for short from-scratch runs such as the demo.
    optimizer: str = "sgd"
    momentum: float = 0.9
    beta2: float = 0.999
    nesterov: bool = False
    weight_decay: float = 5e-4  # not applied to norm weights and biases
    epochs: int = 300
    # A name in fastdet.engine.optim.SCHEDULES:
    # "cosine": linear warm-up then cosine over `cosine_epochs` (PP-YOLOE);
    # "warmcos": linear warm-up then cosine to 0 at the end of training (YOLOX warmcos);
    # "quadratic_warmcos": quadratic warm-up from 0, cosine to min_lr_ratio, flat for the last
    #   no_aug_epochs (YOLOX yoloxwarmcos);
    # "piecewise": linear warm-up, then x gamma at each of `milestones` (epochs) (PP-YOLO, FCOS).
    schedule: str = "cosine"
    cosine_epochs: int = 360
    warmup_steps: int = 2300
    warmup_epochs: float = 0.0  # used instead of warmup_steps when > 0
    warmup_start_factor: float = 0.001
    min_lr_ratio: float = 0.0
    no_aug_epochs: int = 0
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    clip_grad_norm: float = 0.0  # max global norm of all trained gradients; 0 disables clipping
    ema: bool = True
    # A name in fastdet.ops.ema.EMA_FLAVOURS:
    # "threshold": PaddleDetection's decay min(d, (1 + n) / (10 + n)), started from the model;
    # "paddle": the same decay from zeros, divided by (1 - d^n) when read (PaddleDetection exactly);
    # "ramp": YOLOX's ModelEMA, decay = d * (1 - exp(-n / 2000)).
    ema_type: str = "threshold"
    ema_decay: float = 0.9998


@dataclass(frozen=True)
class CompileConfig:
    compile: bool = False
    cuda_graphs: bool = False
    # "auto": bf16 on GPUs that support it, fp32 on the CPU.
    amp: str = "auto"
    # TF32 in cuDNN convolutions and cuBLAS matmuls on CUDA (faster, 10-bit mantissa).
    tf32: bool = False
    # torch.compile backend: "inductor" (fused kernels); "aot_eager" traces the same
    # graphs (Dynamo + AOTAutograd, same guards and DDP splits) and runs them with eager
    # kernels, compiling in seconds: what the CPU tests of the compiled trainer use.
    backend: str = "inductor"
    # When --compile compiles: "background" (training starts at once on the step's eager
    # twin while worker processes compile every bucket into inductor's on-disk cache; each
    # bucket switches to its compiled, and with --cuda-graphs captured, step once its graph
    # is ready) or "blocking" (every bucket compiled before the first step).
    warmup: str = "background"
    # Compile worker processes per machine (0: sized to the host's cores; 2 cores: 1).
    workers: int = 0
    # The workers' niceness (0-19) beside training: higher gives the training ranks more of
    # shared cores (shorter eager steps), lower finishes the graphs sooner. On 2 cores at 5
    # a worker gets about a quarter of the CPU while a step runs.
    worker_nice: int = 5
    # inductor's on-disk caches (FX graph, AOTAutograd), shared by the ranks and relaunches
    # on a machine; "" is $TORCHINDUCTOR_CACHE_DIR, else ~/.cache/fastdet/inductor.
    cache_dir: str = ""
    # "static": one graph per image size; "dynamic": the images' H and W are symbolic
    # (mark_dynamic). Static stays the default: inductor still compiles each size of a
    # dynamic graph again, each compile 1.4-2.4x a static one, and its step was 2-3 %
    # slower (COMPILE.md section 9; bench/throughput.py --modes warmup measures it).
    shapes: str = "static"


@dataclass(frozen=True)
class RunConfig:
    device: str = "auto"
    output_dir: str = "runs/{arch}_{size}"
    seed: int = 0
    max_steps: int = 0  # 0: train the full schedule
    log_interval: int = 20
    eval_interval: int = 10  # epochs; the last epoch is always evaluated
    # Score evaluations in a background process while training goes on (off: wait for
    # each score before the next step; fastdet/engine/eval_hook.py).
    async_eval: bool = True
    ckpt_interval_steps: int = 0  # also write `latest` every N steps (0: per epoch only)
    # Also write `latest` when this many minutes of training have passed since the last
    # checkpoint (0: off): a preemption or crash loses at most this much work. The file it
    # replaces is kept as latest.prev.pth.
    ckpt_interval_minutes: float = 5.0
    resume: bool = False
    # Write into an output directory that holds another run (its logs started anew);
    # otherwise a new run there goes to the next numbered directory (fastdet/engine/rundir.py).
    exist_ok: bool = False
    # --resume auto (and every torchrun restart): resume from latest.pth when the output
    # directory holds one of the same config, else start the run.
    auto_resume: bool = False
    # Timeout of the collectives (torchrun): ranks wait this long for each other, e.g.
    # while rank 0 scores a COCO evaluation (NCCL's default, 10 min, is too short there).
    dist_timeout_minutes: float = 30.0
    ckpt: Optional[str] = None  # fine-tune from these weights
    # --ckpt from another family or size: load the tensors that fit (refused otherwise).
    ckpt_partial: bool = False
    nvtx: bool = False
    profile_steps: Optional[str] = None  # "A:B": cudaProfilerStart at step A, stop at B
    tensorboard: bool = True
    progress: bool = True  # a progress bar when stdout is a terminal
    # CUDA: raise on any host synchronisation inside a training step after warm-up
    # (torch.cuda.set_sync_debug_mode("error") around each step): a check, not for speed.
    sync_debug: bool = False


@dataclass(frozen=True)
class FamilyOptions:
    """The ``family`` section: a model family's own options.

    Each family subclasses it (a frozen dataclass, e.g. ``PPYOLOEOptions``: when the
    static assigner hands over, the augmentation probabilities, the NMS settings) and
    names the subclass in its recipe (``fastdet.models.recipe.Recipe.options``). The base
    has no fields: it is what a bare ``Config()`` holds until a preset fills it in.
    """


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    run: RunConfig = field(default_factory=RunConfig)
    family: FamilyOptions = field(default_factory=FamilyOptions)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def dump(self, path: str | Path) -> None:
        """Write the resolved config as YAML (``.yaml``/``.yml``) or JSON."""
        path = Path(path)
        d = _plain(self.to_dict())
        if path.suffix in (".yaml", ".yml"):
            path.write_text(yaml.safe_dump(d, sort_keys=False))
        else:
            path.write_text(json.dumps(d, indent=2))

    @classmethod
    def from_dict(cls, d: dict[str, Any], family: type[FamilyOptions] = FamilyOptions) -> "Config":
        """A config from its dict, with ``family`` the type of its ``family`` section.

        ``fastdet.registry.config_from_dict`` looks that type up from ``model.arch``. A dict
        written before the family section existed (family options such as
        ``model.static_assigner_epoch`` or ``data.flip_prob`` among the shared sections) is
        read with those fields moved into ``family``.
        """
        if not isinstance(d, dict):
            raise ConfigError(f"a config is a mapping of sections, got {type(d).__name__}")
        d = _migrate(d, family)
        sections = {}
        for f in fields(cls):
            sub_cls = family if f.name == "family" else f.default_factory  # type: ignore[misc]
            raw = d.get(f.name) or {}
            unknown = set(raw) - {sf.name for sf in fields(sub_cls)}
            if unknown:
                raise ConfigError(f"unknown config field {f.name}.{sorted(unknown)[0]}")
            hints = typing.get_type_hints(sub_cls)
            sections[f.name] = sub_cls(
                **{k: _coerce(v, hints[k], f"{f.name}.{k}") for k, v in raw.items()}
            )
        unknown_sections = set(d) - {f.name for f in fields(cls)}
        if unknown_sections:
            raise ConfigError(f"unknown config section {sorted(unknown_sections)[0]!r}: sections are "
                              + ", ".join(f.name for f in fields(cls)))
        return cls(**sections)

    @classmethod
    def load(cls, path: str | Path, family: type[FamilyOptions] = FamilyOptions) -> "Config":
        text = Path(path).read_text()
        return cls.from_dict(yaml.safe_load(text), family)


def _migrate(d: dict[str, Any], family: type[FamilyOptions]) -> dict[str, Any]:
    """A dict of an earlier layout in this one: ``compile.dynamic`` (a second switch for
    symbolic H, W) is ``compile.shapes``; ``optim.schedule`` "yoloxwarmcos" is
    "quadratic_warmcos" (schedules are named by their shape, not a family);
    ``family.nms_iou`` of a family without one (PP-YOLO's Matrix NMS, which never read it)
    goes; family options move out of the shared sections."""
    names = {f.name for f in fields(family)}
    comp = d.get("compile")
    if isinstance(comp, dict) and "dynamic" in comp:
        comp = dict(comp)
        if comp.pop("dynamic"):
            comp["shapes"] = "dynamic"
        d = {**d, "compile": comp}
    optim = d.get("optim")
    if isinstance(optim, dict) and optim.get("schedule") == "yoloxwarmcos":
        d = {**d, "optim": {**optim, "schedule": "quadratic_warmcos"}}
    retired = {"nms_iou"} - names if family is not FamilyOptions else set()
    fam = d.get("family")
    if isinstance(fam, dict) and retired & set(fam):
        d = {**d, "family": {k: v for k, v in fam.items() if k not in retired}}
    if "family" in d:
        return d
    out: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    moved: dict[str, Any] = {}
    for sec in ("model", "data"):
        raw = out.get(sec)
        if isinstance(raw, dict):
            for k in [k for k in raw if k in names | retired]:
                v = raw.pop(k)
                if k in names:
                    moved[k] = v
    out["family"] = moved
    return out


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


# --------------------------------------------------------------------------- overrides

def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Convert ``value`` (a string from the command line, or a YAML value) to ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _coerce(value, non_none[0], name)
    if origin is tuple:
        if isinstance(value, str):
            parts = [p for p in value.replace(" ", "").strip("()[]").split(",") if p]
        elif isinstance(value, (list, tuple)):
            parts = list(value)
        else:
            raise ConfigError(f"{name}: expected a comma-separated list, got {value!r}")
        return tuple(_coerce(p, args[0], name) for p in parts)
    if tp is bool:
        if isinstance(value, bool):
            return value
        s = str(value).lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
        if not math.isfinite(f) or f != int(f):  # int(inf) raises OverflowError, int(nan) ValueError
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return int(f)
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if tp is str:
        return str(value)
    raise ConfigError(f"{name}: unsupported type {tp}")


def field_names(cfg: Config) -> list[str]:
    out = []
    for sec in fields(cfg):
        for f in fields(getattr(cfg, sec.name)):
            out.append(f"{sec.name}.{f.name}")
    return out


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Return ``cfg`` with ``{"section.field": value}`` applied, each type-checked."""
    by_section: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if "." not in key:
            raise ConfigError(f"config key {key!r} must be section.field (e.g. optim.base_lr)")
        sec, name = key.split(".", 1)
        if not hasattr(cfg, sec) or not dataclasses.is_dataclass(getattr(cfg, sec)):
            raise ConfigError(
                f"unknown config section {sec!r} in {key!r}: sections are "
                + ", ".join(f.name for f in fields(cfg))
            )
        sub = getattr(cfg, sec)
        hints = typing.get_type_hints(type(sub))
        if name not in hints:
            close = [n for n in field_names(cfg) if n.startswith(sec + ".") and name[:3] in n]
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"unknown config field {key!r}{hint}")
        by_section.setdefault(sec, {})[name] = _coerce(value, hints[name], key)
    for sec, vals in by_section.items():
        cfg = replace(cfg, **{sec: replace(getattr(cfg, sec), **vals)})
    return cfg


def parse_postprocess_args(items: list[str]) -> dict[str, str]:
    """An inference command's ``--set family.<field>=value`` items -> ``{field: value}``
    (``registry.postprocess_overrides`` checks the fields); another section is refused: the
    model and the data are the checkpoint's there."""
    out = {}
    for key, value in parse_set_args(items).items():
        section, _, name = key.partition(".")
        if section != "family" or not name:
            raise ConfigError(f"--set {key}: only the post-processing (family.<field>) can change here; the model "
                              "and the data are the checkpoint's")
        out[name] = value
    return out


def parse_set_args(items: list[str]) -> dict[str, str]:
    """Parse ``["optim.base_lr=0.01", ...]`` into a dict."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.field=value")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out
