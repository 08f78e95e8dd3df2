"""Guidance rules: how a guided step mixes its two predictions. One class per rule, one entry each in :data:`RULES`.

For a prediction ``c`` and the one it is pushed away from ``u`` (the unconditional prediction, or a guide model's) at
scale ``w``:

- ``cfg``: ``u + w (c - u)`` (the default);
- ``apg`` (Sadat et al. 2024, arXiv:2410.02416): the difference ``c - u``, averaged with momentum and its norm clipped,
  split into its parts parallel and orthogonal to ``c``, the parallel part weighted by ``eta``; diffusers'
  ``normalized_guidance``;
- ``cfg-zero-star`` (Fan et al. 2025, arXiv:2503.18886): ``u`` first scaled by the projection ``<c, u> / |u|^2`` of each
  sample, and the first ``zero_init_steps`` sampler calls predict zero; diffusers' ``cfg_zero_star_scale``. A zero
  velocity keeps the sample where it is; a zero noise prediction is not a no-op (docs/sampling.md).

diffusers' guider classes hold the same formulas for its modular pipelines (a step counter, prepared batches, hooks);
the rules here call its functions on the two predictions and are held to its classes' outputs in
``tests/sampling/test_guidance.py``.

No torch at import: the table, the options and their checks are read by ``--help``, sampling specs and configs
before torch loads; a rule's :meth:`GuidanceRule.combine` runs on tensors. A new rule is a subclass here and an entry
in :data:`RULES` (docs/development.md#add-a-guidance-rule).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from moh_dit.argtypes import is_number
from moh_dit.errors import ConfigError

__all__ = ["GuidanceRule", "CFG", "APG", "CFGZeroStar", "RULES", "rule_class", "make_rule", "check_rule_options"]


class GuidanceRule:
    """A way to mix two predictions. The class holds the rule's name, its options with their defaults and their
    checks; an instance is made for one sampling run (:func:`make_rule`) and holds the run's state (APG's running
    average). ``combine(c, u, w, step, shifts)``: ``step`` counts the sampler's calls from 0; ``shifts`` are the diagonal
    rolls of the batch's copies when grid averaging runs (``moh_dit.sampling.guidance.grid_shifts``)."""

    name: ClassVar[str]
    title: ClassVar[str]  # in words, for logs and cards
    defaults: ClassVar[dict[str, float | None]] = {}
    non_negative: ClassVar[tuple[str, ...]] = ()  # options that must be >= 0
    whole: ClassVar[tuple[str, ...]] = ()  # options that count (whole numbers)
    may_be_off: ClassVar[tuple[str, ...]] = ()  # options that take ``None`` (off)

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = self.check(options)

    @classmethod
    def check(cls, options: Mapping[str, Any] | None) -> dict[str, float | None]:
        """The rule's options with its defaults filled in; an unknown option or a bad value is a
        :class:`ConfigError` naming what the rule takes."""
        given = dict(options or {})
        unknown = sorted(set(given) - set(cls.defaults))
        if unknown:
            raise ConfigError(
                f"guidance rule {cls.name} takes {', '.join(cls.defaults) or 'no options'}; got {unknown}"
            )
        for key, value in given.items():
            if value is None and key in cls.may_be_off:
                continue
            number = is_number(value) and math.isfinite(value)
            if not number or (key in cls.non_negative and value < 0) or (key in cls.whole and int(value) != value):
                raise ConfigError(
                    f"guidance rule {cls.name}: {key} must be a finite number{' >= 0' * (key in cls.non_negative)}, "
                    f"got {value!r}"
                )
        return {**cls.defaults, **{k: (v if v is None else float(v)) for k, v in given.items()}}

    @classmethod
    def describe(cls, options: Mapping[str, Any]) -> str:
        """``APG (eta 0, momentum -0.5, norm threshold 15)``; the default rule says nothing (``""``)."""
        shown = ", ".join(
            f"{k if k in cls.whole else k.replace('_', ' ')} {v:g}" if v is not None else f"{k} off"
            for k, v in options.items()
        )
        return f"{cls.title} ({shown})" if shown else cls.title

    def combine(self, cond: Any, uncond: Any, scale: float, step: int, shifts: list[int] | None = None) -> Any:
        raise NotImplementedError


class CFG(GuidanceRule):
    """Classifier-free guidance's linear rule, ``u + w (c - u)``: the default, which descriptions leave unsaid."""

    name, title = "cfg", "classifier-free guidance"

    @classmethod
    def describe(cls, options: Mapping[str, Any]) -> str:
        return ""

    def combine(self, cond: Any, uncond: Any, scale: float, step: int, shifts: list[int] | None = None) -> Any:
        return uncond + scale * (cond - uncond)


class APG(GuidanceRule):
    """Adaptive projected guidance (diffusers' ``normalized_guidance``), with its momentum buffer as the run's state.
    Defaults: the parallel part of the update dropped (eta 0) and a negative momentum, as its paper recommends;
    diffusers' norm threshold 15 (the norm of the whole update per sample)."""

    name, title = "apg", "APG"
    defaults = {"eta": 0.0, "momentum": -0.5, "norm_threshold": 15.0}
    non_negative = ("norm_threshold",)
    may_be_off = ("momentum",)

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        self._momentum: Any = None
        self._frames: list[int] | None = None

    def combine(self, cond: Any, uncond: Any, scale: float, step: int, shifts: list[int] | None = None) -> Any:
        from diffusers.guiders.adaptive_projected_guidance import MomentumBuffer, normalized_guidance

        if self._momentum is None and self.options["momentum"] is not None:
            self._momentum = MomentumBuffer(self.options["momentum"])
        if self._momentum is not None:
            self._momentum_in_frames(shifts)
        return normalized_guidance(
            cond, uncond, scale, self._momentum, eta=self.options["eta"], norm_threshold=self.options["norm_threshold"]
        )

    def _momentum_in_frames(self, shifts: list[int] | None) -> None:
        """APG's running average follows each sample when grid averaging starts or stops (the batch then holds one
        rolled copy of each sample per shift): the average is rolled back to the image, averaged over its copies and
        rolled into each new copy's frame, so every copy continues the history of its own sample (diffusers' buffer
        assumes a fixed batch)."""
        import torch

        old, new = self._frames or [0], shifts or [0]
        self._frames = shifts
        average = self._momentum.running_average
        if not isinstance(average, torch.Tensor) or old == new:
            return
        image = torch.stack([torch.roll(a, (-s, -s), dims=(2, 3)) for a, s in zip(average.chunk(len(old)), old)])
        image = image.mean(dim=0)
        self._momentum.running_average = torch.cat([torch.roll(image, (s, s), dims=(2, 3)) for s in new])


class CFGZeroStar(GuidanceRule):
    """CFG-Zero*: the optimised scale of ``u`` and zero predictions at the first calls (diffusers' default: one)."""

    name, title = "cfg-zero-star", "CFG-Zero*"
    defaults = {"zero_init_steps": 1}
    non_negative = whole = ("zero_init_steps",)

    def combine(self, cond: Any, uncond: Any, scale: float, step: int, shifts: list[int] | None = None) -> Any:
        import torch
        from diffusers.guiders.classifier_free_zero_star_guidance import cfg_zero_star_scale

        if step < self.options["zero_init_steps"]:
            return torch.zeros_like(cond)
        alpha = cfg_zero_star_scale(cond.flatten(1), uncond.flatten(1)).view(-1, *(1,) * (cond.ndim - 1))
        projected = uncond * alpha
        return projected + scale * (cond - projected)


RULES: dict[str, type[GuidanceRule]] = {rule.name: rule for rule in (CFG, APG, CFGZeroStar)}
DEFAULT_RULE = CFG.name


def rule_class(name: str) -> type[GuidanceRule]:
    """The class of rule ``name``; an unknown name is a :class:`ConfigError` listing the rules."""
    if name not in RULES:
        raise ConfigError(f"guidance_rule must be one of {', '.join(RULES)}, got {name!r}")
    return RULES[name]


def check_rule_options(name: str, options: Mapping[str, Any] | None) -> dict[str, float | None]:
    """Rule ``name``'s options with its defaults filled in (see :meth:`GuidanceRule.check`)."""
    return rule_class(name).check(options)


def make_rule(name: str = DEFAULT_RULE, options: Mapping[str, Any] | None = None) -> GuidanceRule:
    """A fresh rule for one sampling run (its state starts empty), its options checked and completed."""
    return rule_class(name)(options)


def options_help() -> str:
    """Every rule's options, for ``--rule-option``'s help: ``apg: eta, momentum, norm_threshold; ...``."""
    return "; ".join(f"{name}: {', '.join(rule.defaults)}" for name, rule in RULES.items() if rule.defaults)
