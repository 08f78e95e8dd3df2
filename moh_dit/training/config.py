"""Training configuration: a YAML file plus ``section.key=value`` command-line overrides.

Architecture (``model``) is kept apart from training flags (``data``, ``optim``, ``train``, ``ema``,
``log``), as in k-diffusion: the model section names a preset and may override any architecture field;
the rest never reaches the model config. Unknown keys are errors, never silently ignored.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any

import yaml

from moh_dit.argtypes import is_number
from moh_dit.errors import ConfigError
from moh_dit.sampling.spec import LEGACY_CONFIG_KEYS
from moh_dit.training import config_sections
from moh_dit.training.config_checks import OtherMethodKeys, validate
from moh_dit.training.config_sections import *  # noqa: F403 (the sections, read from here as before the split)
from moh_dit.training.config_sections import Config
from moh_dit.training.objective import with_objective_defaults

__all__ = [*config_sections.__all__, "load_config", "apply_overrides", "config_to_dict", "validate"]

# keys of earlier versions, and what replaces them
RENAMED = {
    "log.tensorboard": "log.tensorboard was replaced by log.trackers (e.g. log.trackers=[tensorboard], or [] for none)"
}


# keys of moh-dit 0.2 that moved to another section: configs and run folders that use them still load
MOVED = {
    "log.sample_every": "preview.every",
    "log.sample_per_class": "preview.per_class",
    "log.sample_max_classes": "preview.max_classes",
    **{f"log.{old}": f"preview.{new}" for old, new in LEGACY_CONFIG_KEYS.items()},
}


def _move_old_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """Keys of :data:`MOVED` to where they live now (a warning names them); an old and a new key for the same
    value are an error."""
    moved = []
    for old, new in MOVED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        section = raw.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        target = raw.setdefault(new_section, {}) or {}
        raw[new_section] = target
        if not isinstance(target, dict):
            raise ConfigError(f"{new_section} must be a mapping, got {target!r}")
        if new_key in target:
            raise ConfigError(f"{old} and {new} are the same setting: give {new} only")
        target[new_key] = section.pop(old_key)
        moved.append(f"{old} -> {new}")
    if moved:
        logging.getLogger("moh_dit").warning("config keys of moh-dit 0.2 read as: %s", ", ".join(moved))
    return raw


def _from_dict(cls, data: dict[str, Any], where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{(where or 'config').rstrip('.')} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    renamed = [RENAMED[f"{where}{k}"] for k in unknown if f"{where}{k}" in RENAMED]
    if renamed:
        raise ConfigError("; ".join(renamed))
    if unknown:
        import difflib

        close = {k: difflib.get_close_matches(k, list(fields), n=1, cutoff=0.6) for k in unknown}
        said = ", ".join(
            f"{where}{k}" + (f" (did you mean {where}{close[k][0]}?)" if close[k] else "") for k in unknown
        )
        # the section's keys only where some key has no near match (a typo's nearest key says enough)
        listing = "" if all(close.values()) else f"; {where.rstrip('.') or 'the config'}'s keys: {', '.join(fields)}"
        raise ConfigError(f"unknown config keys {said}{listing}")
    kwargs = {}
    for name, value in data.items():
        default = getattr(cls(), name)
        if dataclasses.is_dataclass(default):
            kwargs[name] = _from_dict(type(default), {} if value is None else value, f"{where}{name}.")
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
        if isinstance(default, list) and all(isinstance(v, (int, float)) for v in default) and default:
            if not isinstance(value, list) or not all(is_number(v) for v in value):
                raise TypeError
            return [float(v) for v in value]  # a list of numbers (distill.guidance_times)
        if isinstance(default, list):
            value = [value] if isinstance(value, str) else value  # one tracker may be given without brackets
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise TypeError
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a {type(default).__name__}, got {value!r}") from None
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
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, value = item.split("=", 1)
        parts = key.strip().lstrip("-").split(".")
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"cannot set {key}: {part} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_problem(err)})") from None
    return raw


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML config; a top-level ``base: other.yaml`` (relative to this file) is read first."""
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    if path.resolve() in seen:
        raise ConfigError(f"config files include each other in a loop: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections")
    base = raw.pop("base", None)
    if base is None:
        return raw
    return _merge(_read_yaml(path.parent / base, (*seen, path.resolve())), raw)


def _yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(err, 'problem', None) or err}{where}"


def load_config(source: str | Path | dict | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, updated by ``source`` (a YAML file, or a dict of sections as the file would hold, which may
    name a ``base`` file) and then by ``section.key=value`` ``overrides``; validated once."""
    if isinstance(source, dict):
        raw = copy.deepcopy(source)
        base = raw.pop("base", None)
        raw = _merge(_read_yaml(Path(base)), raw) if base is not None else raw
    else:
        raw = _read_yaml(Path(source)) if source is not None else {}
    file_method = ((raw.get("distill") or {}).get("method")) if isinstance(raw, dict) else None
    raw = _move_old_keys(apply_overrides(raw, overrides or []))
    config = _from_dict(Config, raw, "")
    try:
        validate(config)
    except OtherMethodKeys as err:  # keys of the file's method, with another method chosen by an override
        raise ConfigError(err.explained(source, overrides or [], file_method)) from None
    return with_objective_defaults(config)  # after validation: the objective is known
