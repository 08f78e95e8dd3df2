"""Training configuration: a YAML file plus ``section.key=value`` command-line overrides.

Architecture (``model``) is kept apart from training flags (``data``, ``optim``, ``train``, ``ema``,
``log``), as in k-diffusion: the model section names a preset and may override any architecture field;
the rest never reaches the model config. Unknown keys are errors, never silently ignored.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from .presets import config_keys

__all__ = ["Config", "ModelSection", "DataSection", "OptimSection", "TrainSection", "EMASection", "LogSection",
           "load_config", "apply_overrides", "config_to_dict"]  # fmt: skip


@dataclass
class ModelSection:
    preset: str = "MoH-DiT-Ti/4-75"
    overrides: dict[str, Any] = field(default_factory=dict)  # any MoHDiT config key, e.g. num_classes
    init_from: Optional[str] = None  # a transformer folder / pipeline folder to start from


@dataclass
class DataSection:
    name: str = "fashion-mnist"  # fashion-mnist | folder | latents
    path: Optional[str] = None  # folder of class folders, IDX folder, or pre-extracted latents (.npy)
    image_size: int = 28
    channels: int = 1
    split: str = "train"
    download: bool = False
    num_workers: int = 0
    random_flip: bool = True
    max_bad_fraction: float = 0.01
    subset_per_class: int = 0  # > 0: use only the first N images of every class (smoke runs, tests)
    vae: str = "none"  # none | hub id (stabilityai/sd-vae-ft-ema) | local folder


@dataclass
class OptimSection:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 0.0  # max global grad norm; 0 disables
    warmup_steps: int = 0  # linear LR warm-up


@dataclass
class TrainSection:
    output_dir: str = "runs/default"
    global_batch_size: int = 256
    grad_accum_steps: int = 1
    max_steps: int = 400_000
    time_limit_minutes: float = 0.0  # > 0: stop (and checkpoint) after this long
    seed: int = 0
    mixed_precision: str = "no"  # no | fp16 | bf16
    allow_tf32: bool = True
    gradient_checkpointing: bool = False
    compile: bool = False
    moh_loss_coeff: float = 0.01
    checkpoint_every: int = 50_000
    keep_last: int = 3
    resume: Optional[str] = None  # latest | PATH


@dataclass
class EMASection:
    decay: float = 0.9999
    warmup: bool = False  # diffusers' EMA warm-up (decay ramps up from 0); DiT uses a constant decay
    inv_gamma: float = 1.0
    power: float = 2.0 / 3.0
    update_every: int = 1


@dataclass
class LogSection:
    log_every: int = 100
    sample_every: int = 0  # > 0: save a grid of EMA samples every N steps (and at the end)
    sample_per_class: int = 4
    sample_max_classes: int = 10
    sample_cfg_scale: float = 4.0
    sample_steps: int = 250
    tensorboard: bool = True
    head_usage: bool = True


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    ema: EMASection = field(default_factory=EMASection)
    log: LogSection = field(default_factory=LogSection)

    def validate(self) -> None:
        unknown = sorted(set(self.model.overrides) - config_keys())
        if unknown:
            raise ValueError(f"model.overrides has unknown keys {unknown}; valid: {sorted(config_keys())}")
        if self.data.name not in ("fashion-mnist", "folder", "latents"):
            raise ValueError(f"data.name must be fashion-mnist, folder or latents, got {self.data.name!r}")
        if self.train.mixed_precision not in ("no", "fp16", "bf16"):
            raise ValueError(f"train.mixed_precision must be no, fp16 or bf16, got {self.train.mixed_precision!r}")
        for name in ("global_batch_size", "grad_accum_steps", "max_steps", "checkpoint_every", "keep_last"):
            if getattr(self.train, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self.train, name)}")
        if not 0.0 <= self.ema.decay <= 1.0:
            raise ValueError(f"ema.decay must be in [0, 1], got {self.ema.decay}")


def _from_dict(cls, data: dict[str, Any], where: str):
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown config keys {[f'{where}{k}' for k in unknown]}; valid: {[f'{where}{k}' for k in fields]}")
    kwargs = {}
    for name, value in data.items():
        default = getattr(cls(), name)
        if dataclasses.is_dataclass(default):
            kwargs[name] = _from_dict(type(default), value or {}, f"{where}{name}.")
        elif isinstance(default, tuple) and isinstance(value, list):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = _coerce(value, default, f"{where}{name}")
    return cls(**kwargs)


def _coerce(value: Any, default: Any, key: str) -> Any:
    """Match the type of the field's default (YAML reads ``3e-4`` as a string, ``1`` as an int)."""
    if value is None or default is None:
        return value
    try:
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            raise TypeError
        if isinstance(default, int):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if isinstance(default, str) and not isinstance(value, str):
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be a {type(default).__name__}, got {value!r}") from None
    return value


def config_to_dict(config: Config) -> dict[str, Any]:
    def convert(v):
        if isinstance(v, tuple):
            return list(v)
        if isinstance(v, dict):
            return {k: convert(x) for k, x in v.items()}
        return v

    return {k: convert(v) for k, v in dataclasses.asdict(config).items()}


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings (values parsed as YAML) to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value")
        key, value = item.split("=", 1)
        parts = key.strip().lstrip("-").split(".")
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"cannot set {key}: {part} is not a section")
        node[parts[-1]] = yaml.safe_load(value)
    return raw


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML config; a top-level ``base: other.yaml`` (relative to this file) is read first."""
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} not found")
    if path.resolve() in seen:
        raise ValueError(f"config files include each other in a loop: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a mapping of sections")
    base = raw.pop("base", None)
    if base is None:
        return raw
    return _merge(_read_yaml(path.parent / base, (*seen, path.resolve())), raw)


def load_config(path: Optional[Union[str, Path]] = None, overrides: Optional[list[str]] = None) -> Config:
    """Defaults, updated by the YAML file at ``path`` and then by ``overrides``; validated."""
    raw = _read_yaml(Path(path)) if path is not None else {}
    raw = apply_overrides(raw, overrides or [])
    config = _from_dict(Config, raw, "")
    config.validate()
    return config
