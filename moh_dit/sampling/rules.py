"""The guidance rules by name, their options and defaults, checked without torch (``--help``, sampling specs and
configs read them before torch loads); :mod:`moh_dit.sampling.guidance` computes them. A new rule is an entry here and
a branch of ``GuidanceRule.combine``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from moh_dit.errors import ConfigError

__all__ = ["RULE_OPTIONS", "RULES", "RULE_NAMES", "check_rule_options", "describe_rule"]

# every rule's options and their defaults
RULE_OPTIONS: dict[str, dict[str, float | None]] = {
    "cfg": {},
    # APG (Sadat et al. 2024): the parallel part of the update dropped (eta 0) and a negative momentum, as its paper
    # recommends; diffusers' norm threshold 15 (its default; the norm of the whole update per sample)
    "apg": {"eta": 0.0, "momentum": -0.5, "norm_threshold": 15.0},
    # CFG-Zero* (Fan et al. 2025): the first sampler call predicts zero, as diffusers' default
    "cfg-zero-star": {"zero_init_steps": 1},
}
RULES = tuple(RULE_OPTIONS)
RULE_NAMES = {"cfg": "classifier-free guidance", "apg": "APG", "cfg-zero-star": "CFG-Zero*"}
_NON_NEGATIVE = ("norm_threshold", "zero_init_steps")


def check_rule_options(rule: str, options: Mapping[str, Any] | None) -> dict[str, float]:
    """The rule's options with its defaults filled in; an unknown rule or option, or a bad value, is a
    :class:`ConfigError` naming what the rule takes."""
    if rule not in RULE_OPTIONS:
        raise ConfigError(f"guidance_rule must be one of {', '.join(RULES)}, got {rule!r}")
    known, given = RULE_OPTIONS[rule], dict(options or {})
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(f"guidance rule {rule} takes {', '.join(known) or 'no options'}; got {unknown}")
    for key, value in given.items():
        if key == "momentum" and value is None:
            continue  # APG without momentum
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or (key in _NON_NEGATIVE and value < 0) or (key == "zero_init_steps" and int(value) != value):
            raise ConfigError(
                f"guidance rule {rule}: {key} must be a finite number{' >= 0' * (key in _NON_NEGATIVE)}, got {value!r}"
            )
    return {**known, **{k: (v if v is None else float(v)) for k, v in given.items()}}


def describe_rule(rule: str, options: Mapping[str, Any]) -> str:
    """``APG (eta 0, momentum -0.5, norm threshold 15)``, ``CFG-Zero* (zero_init_steps 1)`` or ``""`` for CFG."""
    if rule == "cfg":
        return ""
    shown = ", ".join(
        f"{k.replace('_', ' ') if k != 'zero_init_steps' else k} {v:g}" if v is not None else f"{k} off"
        for k, v in options.items()
    )
    return f"{RULE_NAMES[rule]} ({shown})" if shown else RULE_NAMES[rule]
