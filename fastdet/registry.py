"""The registry: where a config's ``model.arch`` is looked up, and what a run asks of its family.

The architecture named by ``cfg.model.arch`` is looked up here, once per question, in
``fastdet.models.ARCHITECTURES``; the answers come from the family's
:class:`~fastdet.models.recipe.Recipe` (declared next to its model):

- :func:`get_preset` / :data:`PRESETS`: the published recipe of an (arch, size);
  :func:`demo_overrides`: its settings for the built-in demo set;
- :func:`config_from_dict` / :func:`load_config`: a stored config, its ``family``
  section typed by the family (dicts of the previous layout are migrated);
- :func:`phase` / :func:`loss_variants`: what training uses at an epoch, and every
  distinct set of loss arguments a run will use (compiled at warm-up);
- :func:`predict_kwargs`, :func:`predict_fields`, :func:`postprocess_overrides`,
  :func:`build_detector`: post-processing (its keyword arguments, the ``family`` fields it
  reads, those changed at inference) and the model.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import yaml

from fastdet.config import Config, ConfigError, FamilyOptions, ModelConfig, apply_overrides
from fastdet.models import ARCHITECTURES, ArchFamily, Detector, build_model_from_config
from fastdet.models.recipe import Phase, Recipe, check_postprocess, without_augmentation


def family(arch: str) -> ArchFamily:
    """The registered family ``arch``; one-line :class:`ConfigError` if there is none."""
    if arch not in ARCHITECTURES:
        raise ConfigError(f"unknown --arch {arch!r}: available architectures are {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[arch]


def recipe(arch: str) -> Recipe:
    fam = family(arch)
    if fam.recipe is None:
        raise ConfigError(f"architecture {arch!r} declares no training recipe (ArchFamily.recipe)")
    return fam.recipe


def get_preset(arch: str, size: str) -> Config:
    """The published recipe of ``arch`` at ``size``: shared defaults, then the family's
    ``base`` and ``sizes[size]`` overrides, with the family's options section."""
    fam = family(arch)
    if size not in fam.sizes:
        raise ConfigError(f"unknown --size {size!r} for {arch}: available sizes are {', '.join(sorted(fam.sizes))}")
    r = recipe(arch)
    cfg = Config(model=ModelConfig(arch=arch, size=size), family=r.options())
    return apply_overrides(apply_overrides(cfg, r.base), r.sizes.get(size, {}))


def _all_presets() -> dict[str, Config]:
    return {f"{arch}_{size}": get_preset(arch, size)
            for arch, fam in ARCHITECTURES.items() if fam.recipe is not None for size in fam.sizes}


PRESETS: dict[str, Config] = _all_presets()


def demo_overrides(arch: str) -> dict[str, Any]:
    """``{"section.field": value}`` applied on top of a preset for ``--data demo``."""
    return dict(recipe(arch).demo)


def resolve(cfg: Config) -> Config:
    """``cfg`` with its ``family`` section of the family's type (filled with the family's
    defaults when it is the bare base, as in ``Config()``)."""
    opts = recipe(cfg.model.arch).options
    if type(cfg.family) is opts:
        return cfg
    if type(cfg.family) is FamilyOptions:
        return replace(cfg, family=opts())
    raise ConfigError(f"config section family holds {type(cfg.family).__name__} but model.arch "
                      f"{cfg.model.arch!r} takes {opts.__name__}")


def config_from_dict(d: Mapping[str, Any]) -> Config:
    """A config stored by :meth:`Config.to_dict` (a checkpoint's, a run's ``config.yaml``).

    The family named by ``model.arch`` gives the type of the ``family`` section; a dict
    written before that section existed is read with its family fields moved into it.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"a config is a mapping of sections, got {type(d).__name__}")
    arch = (d.get("model") or {}).get("arch", ModelConfig.arch)
    return resolve(Config.from_dict(dict(d), recipe(arch).options))


def load_config(path: str | Path) -> Config:
    """:func:`config_from_dict` of a YAML or JSON file."""
    return config_from_dict(yaml.safe_load(Path(path).read_text()))


def phase(cfg: Config, epoch: int) -> Phase:
    """What epoch ``epoch`` of ``cfg``'s run uses; ``data.augment`` off keeps only the
    phase's Resize and Normalize stages."""
    cfg = resolve(cfg)
    p = recipe(cfg.model.arch).phase(epoch, cfg.optim.epochs, cfg)
    if not cfg.data.augment:
        p = replace(p, stages=without_augmentation(p.stages))
    return p


def loss_variants(cfg: Config, first_epoch: int, last_epoch: int) -> list[dict[str, Any]]:
    """The distinct loss keyword arguments of epochs ``first_epoch..last_epoch``, in order."""
    out: list[dict[str, Any]] = []
    for e in range(first_epoch, last_epoch + 1):
        kw = phase(cfg, e).loss_kwargs
        if kw not in out:
            out.append(kw)
    return out


def predict_kwargs(cfg: Config) -> dict[str, Any]:
    """``Detector.predict`` keyword arguments (post-processing) of ``cfg``'s family."""
    cfg = resolve(cfg)
    return recipe(cfg.model.arch).predict(cfg.family)


class _Reads:
    """``options`` with a record of the attribute names read from it."""

    def __init__(self, options: FamilyOptions) -> None:
        self._options, self.names = options, []

    def __getattr__(self, name: str) -> Any:
        self.names.append(name)
        return getattr(self._options, name)


def predict_fields(cfg: Config) -> tuple[str, ...]:
    """The ``family`` fields the post-processing of ``cfg``'s family reads (what ``--set``
    may change at evaluation): those the recipe's ``predict`` looks up, in its order, so a
    family's list cannot drift from its code."""
    cfg = resolve(cfg)
    reads = _Reads(cfg.family)
    recipe(cfg.model.arch).predict(reads)
    return tuple(dict.fromkeys(reads.names))


def postprocess_overrides(cfg: Config, overrides: Mapping[str, Any]) -> Config:
    """``cfg`` with ``{field: value}`` applied to its ``family`` section's post-processing:
    only the fields the family's ``predict`` reads (:func:`predict_fields`; a training field
    is refused naming them), each coerced to its type and held to its range
    (``check_postprocess``). One :class:`ConfigError` line naming ``family.<field>``."""
    cfg = resolve(cfg)
    fields = predict_fields(cfg)
    for name in overrides:
        if name not in fields:
            raise ConfigError(f"family.{name}: only the post-processing can change here, and {cfg.model.arch}'s "
                              "reads " + ", ".join(f"family.{f}" for f in fields))
    cfg = apply_overrides(cfg, {f"family.{name}": v for name, v in overrides.items()})
    try:
        check_postprocess(cfg.family)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg


def build_detector(cfg: Config, num_classes: int | None = None) -> Detector:
    """The detector of ``cfg`` (``num_classes`` defaults to ``model.num_classes``)."""
    cfg = resolve(cfg)
    model_cfg = cfg.model if num_classes is None else replace(cfg.model, num_classes=num_classes)
    try:
        return build_model_from_config(model_cfg, cfg.family)
    except ValueError as e:
        raise ConfigError(str(e)) from None
