"""How to sample, as one value: :class:`SamplingSpec`, made of four parts (:mod:`moh_dit.sampling.spec_parts`): the
sampler, the guidance, the guide of autoguidance, the lead model of a hand-off and the sampling cache.

A spec checks itself when it is made, and it describes, tags and records itself, so the pipeline, N-sample generation,
the trainer's previews, the demo, the model card and every manifest take or store the same value. Records, training
configs and command lines name its values by flat keys (``guidance_scale``, ``num_inference_steps``, ...): the table
:data:`FIELDS` says which part holds each, and the config sections that hold a spec are made from :data:`CONFIG_KEYS`
(``moh_dit.training.config_sections``). Light (no torch import), so that ``--help`` answers at once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.objectives.registry import DEFAULT_OBJECTIVE, OBJECTIVES, resolve_protocol
from moh_dit.sampling.caches import check_cache_options
from moh_dit.sampling.rules import DEFAULT_RULE
from moh_dit.sampling.spec_parts import (
    FAST_SCHEDULER,
    FAST_STEPS,
    GRID_GUIDANCE,
    SCHEDULERS,
    TRAIN_TIMESTEPS,
    CacheSpec,
    GuidanceSpec,
    GuideSpec,
    LeadSpec,
    SamplerSpec,
)

__all__ = [
    "SamplingSpec",
    "SamplerSpec",
    "GuidanceSpec",
    "GuideSpec",
    "LeadSpec",
    "CacheSpec",
    "FIELDS",
    "SCHEDULERS",
    "DTYPES",
    "LABEL_MODES",
    "GRID_GUIDANCE",
    "EVAL_GUIDANCE",
    "EVAL_STEPS",
    "PROTOCOLS",
    "FAST_SCHEDULER",
    "FAST_STEPS",
    "GRID_AVERAGING_OFF",
    "TRAIN_TIMESTEPS",
    "CONFIG_KEYS",
    "LEGACY_CONFIG_KEYS",
]

# Transformer dtypes for sampling (the VAE stays in fp32).
DTYPES = ("fp32", "bf16", "fp16")

# How N-sample generation labels image i: uniformly at random from (seed, i), as the papers' 50K
# evaluations do, or class-balanced (i mod K), which lowers the variance of small-sample metrics.
LABEL_MODES = ("uniform", "balanced")

# Guidance defaults differ on purpose. Grids are for looking at (GRID_GUIDANCE, DiT's visual samples' 4); evaluations
# reproduce the papers' FID protocol, which uses 1.5 (DiT) at every step; the MoH paper reports 1.25 as well.
EVAL_GUIDANCE = 1.5

# DiT's evaluation protocol: 250 DDPM steps.
EVAL_STEPS = 250

# Sampling protocols (scheduler, steps) of DiT's DDPM. "dit" is DiT's: DDPM with the learned variance over 250 steps,
# the setting of every paper number; "fast" is the sampler study's choice (of the settings of at most 25 model
# evaluations whose KID is within 5% of the best of them, the one with the fewest) on the embedded default's model:
# DPM-Solver++ 25 steps, KID 3.23 against 3.79 at 20 steps and 7.81 for DDPM-250 (benchmarks/results/v7/samplers_cpu.md).
# Other objectives have their own (moh_dit.objectives.registry).
PROTOCOLS = OBJECTIVES[DEFAULT_OBJECTIVE].protocols

# The flat name of every value (records, configs, command lines): which part holds it, under which name.
FIELDS: dict[str, tuple[str, str]] = {
    "scheduler": ("sampler", "scheduler"),
    "num_inference_steps": ("sampler", "num_steps"),
    "time_shift": ("sampler", "time_shift"),
    "grid_averaging": ("sampler", "grid_averaging"),
    "guidance_scale": ("guidance", "scale"),
    "guidance_interval": ("guidance", "interval"),
    "guidance_noise": ("guidance", "noise"),
    "guidance_channels": ("guidance", "channels"),
    "guidance_rule": ("guidance", "rule"),
    "rule_options": ("guidance", "rule_options"),
    "guide": ("guide", "model"),
    "guide_step": ("guide", "step"),
    "guide_sigma_rel": ("guide", "sigma_rel"),
    "cache": ("cache", "name"),
    "cache_options": ("cache", "options"),
    "lead_model": ("lead", "model"),
    "lead_steps": ("lead", "steps"),
}
# a part's name field, and the fields that belong to it: a change of the name without them resets them
_OWNED = {
    "guidance_rule": ("rule_options",),
    "guide": ("guide_step", "guide_sigma_rel"),
    "cache": ("cache_options",),
    "lead_model": ("lead_steps",),
}

# The keys of a training config's sections that hold a spec (``preview``, whose spec the exported pipeline records, and
# ``log.eval_sampling``), the field each fills, and what it means (the sections are made from this table).
CONFIG_KEYS: dict[str, tuple[str, str]] = {
    "scheduler": (
        "scheduler",
        "ddpm | ddim | dpm-solver | ... (moh_dit.sampling.spec.SCHEDULERS); null: the fast protocol's sampler where the "
        "model's objective and path offer it (DPM-Solver++; Euler on a flow model's GVP path)",
    ),
    "num_steps": ("num_inference_steps", "sampling steps (the fast protocol's 25)"),
    "guidance_scale": ("guidance_scale", "classifier-free guidance scale (1: none)"),
    "guidance_interval": ("guidance_interval", "[first, last] guided DDPM timesteps (flow: their noise levels)"),
    "guidance_channels": ("guidance_channels", "guide only the first N channels (3: DiT's code); null: all"),
    "grid_averaging": ("grid_averaging", "average over shifted patch grids at timesteps <= this; null: none"),
    "guidance_noise": ("guidance_noise", "or [low, high] guided noise levels; null (both): every step"),
    "time_shift": ("time_shift", "flow samplers: shift the grid toward high noise (SD3's 3); 1: none"),
    "guidance_rule": ("guidance_rule", "cfg | apg | cfg-zero-star (docs/sampling.md#guidance-rules)"),
    "rule_options": ("rule_options", "the rule's options, e.g. {eta: 0.0}"),
    "guide": ("guide", "autoguidance: a weaker model's run, checkpoint or pipeline folder"),
    "guide_step": ("guide_step", "the guide run's checkpoint at this step"),
    "guide_sigma_rel": ("guide_sigma_rel", "an EMA of this width rebuilt from the guide run's post-hoc snapshots"),
    "cache": ("cache", "a sampling cache: first-block | magcache | taylorseer (docs/sampling.md#caches)"),
    "cache_options": ("cache_options", "the cache's options, e.g. {threshold: 0.1}"),
}
# Where moh-dit 0.2 kept them: in the ``log`` section, as ``log.sample_<...>`` (run folders of 0.2 still load).
LEGACY_CONFIG_KEYS = {
    "sample_scheduler": "scheduler",
    "sample_steps": "num_steps",
    "sample_cfg_scale": "guidance_scale",
    "sample_guidance_interval": "guidance_interval",
    "sample_grid_averaging": "grid_averaging",
}

# ``--grid-averaging off``: no averaging even where the model records some (a command-line value only)
GRID_AVERAGING_OFF = "off"


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample: the :class:`SamplerSpec` (scheduler, steps, time shift, grid averaging), the
    :class:`GuidanceSpec` (scale, where it applies, channels, rule), the :class:`GuideSpec` of autoguidance (``None``:
    classifier-free guidance), the :class:`CacheSpec` (``None``: no cache) and the :class:`LeadSpec` (``None``: the
    model takes every step). Made from parts, or from flat keys by :meth:`create` (as records, configs and command lines
    name them); ``replace`` takes either."""

    sampler: SamplerSpec = field(default_factory=SamplerSpec)
    guidance: GuidanceSpec = field(default_factory=GuidanceSpec)
    guide: GuideSpec | None = None
    cache: CacheSpec | None = None
    lead: LeadSpec | None = None

    def __post_init__(self) -> None:
        lead = self.lead
        if lead is None:
            return
        if lead.steps >= self.sampler.num_steps:
            raise ConfigError(
                f"lead_steps must be below num_inference_steps ({self.sampler.num_steps}): the main model takes the "
                f"steps after the lead's, got {lead.steps}"
            )
        if self.guide is not None or self.cache is not None:
            other = "autoguidance's guide" if self.guide is not None else "a sampling cache"
            raise ConfigError(f"a lead model (lead_model) does not combine with {other}: give one of them")

    @classmethod
    def create(
        cls,
        scheduler: str | None = FAST_SCHEDULER,
        num_inference_steps: int = FAST_STEPS,
        guidance_scale: float = GRID_GUIDANCE,
        guidance_interval: Any = None,
        guidance_channels: int | None = None,
        grid_averaging: int | None = None,
        guidance_noise: Any = None,
        time_shift: float = 1.0,
        guidance_rule: str = DEFAULT_RULE,
        rule_options: Any = None,
        guide: str | None = None,
        guide_step: int | None = None,
        guide_sigma_rel: float | None = None,
        cache: str | None = None,
        cache_options: Any = None,
        lead_model: str | None = None,
        lead_steps: int | None = None,
    ) -> SamplingSpec:
        """A spec from its flat keys (the order of moh-dit 0.5's fields), each checked."""
        if guide is None and (guide_step is not None or guide_sigma_rel is not None):
            raise ConfigError(
                "--guide-step and --guide-sigma-rel (guide_step, guide_sigma_rel in a config) choose the guide's "
                "weights: give --guide-model (guide) too"
            )
        if cache is None:
            check_cache_options(None, cache_options)  # options without a cache are an error
        if lead_model is None and lead_steps is not None:
            raise ConfigError("--lead-steps (lead_steps) says how many steps the lead takes: give --lead-model too")
        return cls(
            SamplerSpec(scheduler, num_inference_steps, time_shift, grid_averaging),
            GuidanceSpec(
                guidance_scale, guidance_interval, guidance_noise, guidance_channels, guidance_rule, rule_options
            ),
            GuideSpec(guide, guide_step, guide_sigma_rel) if guide is not None else None,
            CacheSpec(cache, cache_options) if cache is not None else None,
            LeadSpec(lead_model, 1 if lead_steps is None else lead_steps) if lead_model is not None else None,
        )

    def fields(self) -> dict[str, Any]:
        """The flat keys and their values (:data:`FIELDS`; a missing guide or cache: ``None``)."""
        return {
            flat: getattr(part, attr) if (part := getattr(self, name)) is not None else None
            for flat, (name, attr) in FIELDS.items()
        }

    def replace(self, **changes: Any) -> SamplingSpec:
        """A copy with ``changes``: whole parts (``guidance=GuidanceSpec(...)``) or flat keys (``guidance_scale=3``),
        checked again. A new rule, guide or cache without its options takes its defaults."""
        # "guide" and "cache" are a part's name and a flat key: a part when given one (a GuideSpec, a CacheSpec)
        kinds = {
            "sampler": SamplerSpec,
            "guidance": GuidanceSpec,
            "guide": GuideSpec,
            "cache": CacheSpec,
            "lead": LeadSpec,
        }
        parts = {k: changes.pop(k) for k, kind in kinds.items() if isinstance(changes.get(k), kind)}
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise TypeError(f"SamplingSpec has no field {unknown[0]!r}; flat keys: {', '.join(FIELDS)}")
        spec = dataclasses.replace(self, **parts) if parts else self
        if not changes:
            return spec
        flat = spec.fields()
        for name, owned in _OWNED.items():
            if name in changes and changes[name] != flat[name]:
                flat.update(dict.fromkeys(owned))
        return SamplingSpec.create(**(flat | changes))

    # ------------------------------------------------------------------------------------------------
    # Named protocols, where guidance and averaging apply
    # ------------------------------------------------------------------------------------------------
    @classmethod
    def protocol(cls, name: str, objective: str = DEFAULT_OBJECTIVE, **changes: Any) -> SamplingSpec:
        """The scheduler and steps of a named protocol for a model of ``objective`` (``paper``, and the objective's
        own: ``dit``/``fast`` for DDPM, ``sit-sde``/``sit-ode``/``fast`` for flow), plus ``changes`` (flat keys)."""
        scheduler, steps = resolve_protocol(name, objective)
        return cls.create(**{"scheduler": scheduler, "num_inference_steps": steps, **changes})

    def guided_at(self, sigma: float, timestep: int | None = None) -> bool:
        """Whether guidance applies at noise level ``sigma`` (see :meth:`GuidanceSpec.guided_at`)."""
        return self.guidance.guided_at(sigma, timestep)

    def averaged_at(self, sigma: float, timestep: int | None = None) -> bool:
        """Whether the prediction at noise level ``sigma`` is averaged over shifted patch grids."""
        return self.sampler.averaged_at(sigma, timestep)

    # ------------------------------------------------------------------------------------------------
    # Words, tags and records
    # ------------------------------------------------------------------------------------------------
    def placement(self) -> str:
        """Where guidance applies and the patch grid is averaged: ``at timesteps 100-500, patch grids averaged at
        timesteps 0-100``, ``at noise levels 0.37-3.3`` or ``at every step``."""
        where = self.guidance.placement()
        if self.sampler.grid_averaging is not None:
            where += f", patch grids averaged at timesteps 0-{self.sampler.grid_averaging}"
        return where

    def describe_guidance(self) -> str:
        """``guidance 4 at timesteps 100-500`` (and where grids are averaged; the rule, and the guide of
        autoguidance, when they are not classifier-free guidance's), for logs, pages and cards."""
        words = self.guidance.describe(self.guide)
        averaged = self.sampler.grid_averaging
        return words + (f", patch grids averaged at timesteps 0-{averaged}" if averaged is not None else "")

    def describe(self) -> str:
        """Everything in words: ``dpm-solver, 25 steps, guidance 4 at timesteps 100-500``."""
        cache = f", {self.cache.describe()}" if self.cache is not None else ""
        lead = f", {self.lead.describe()}" if self.lead is not None else ""
        return f"{self.sampler.describe()}, {self.describe_guidance()}{cache}{lead}"

    def tag(self) -> str:
        """The part of a sample folder's name that says where guidance applies, the patch grid is averaged and the
        grid is shifted: ``-t100-500-avg100``, ``-n0.37-3.3``, ``-shift3`` or ``""`` (every step guided, nothing
        averaged, no shift); a rule, guide or cache adds its name and a digest of its settings."""
        guidance, sampler = self.guidance, self.sampler
        tag = "-t{}-{}".format(*guidance.interval) if guidance.interval else ""
        tag += "-n{:g}-{:g}".format(*guidance.noise) if guidance.noise else ""
        tag += f"-avg{sampler.grid_averaging}" if sampler.grid_averaging is not None else ""
        tag += f"-shift{sampler.time_shift:g}" if sampler.time_shift != 1.0 else ""
        if guidance.rule != DEFAULT_RULE:
            tag += f"-{guidance.rule}-{_digest(guidance.rule_options)}"
        tag += f"-guide-{_digest(self.guide.record())}" if self.guide is not None else ""
        tag += f"-lead{self.lead.steps}-{_digest(self.lead.record())}" if self.lead is not None else ""
        return tag + (f"-{self.cache.name}-{_digest(self.cache.options)}" if self.cache is not None else "")

    def record(self) -> dict[str, Any]:
        """The spec as manifests store it (a pipeline's ``sampling``): flat keys; ``guidance_channels``,
        ``guidance_noise``, ``time_shift``, a rule, guide, cache or lead only when set, so that a record is the same as the
        records written before they existed."""
        sampler, guidance = self.sampler, self.guidance
        record = {
            "guidance_scale": guidance.scale,
            "guidance_interval": list(guidance.interval) if guidance.interval else None,
            "scheduler": sampler.scheduler,
            "num_inference_steps": sampler.num_steps,
            "grid_averaging": sampler.grid_averaging,
        }
        if guidance.channels is not None:
            record["guidance_channels"] = guidance.channels
        if guidance.noise is not None:
            low, high = guidance.noise
            record["guidance_noise"] = [low, None if math.isinf(high) else high]  # JSON has no infinity
        if sampler.time_shift != 1.0:
            record["time_shift"] = sampler.time_shift
        if guidance.rule != DEFAULT_RULE:
            record["guidance_rule"], record["rule_options"] = guidance.rule, guidance.options
        if self.guide is not None:
            record["guide"] = self.guide.record()
        if self.cache is not None:
            record["cache"], record["cache_options"] = self.cache.name, self.cache.settings
        if self.lead is not None:
            record["lead"] = self.lead.record()
        return record

    @classmethod
    def from_record(cls, record: dict | None) -> SamplingSpec | None:
        """A recorded spec (from a manifest or a run's config), or ``None`` for none; a damaged record is an
        :class:`ArtifactError`."""
        if not record:
            return None
        try:
            guide, lead = record.get("guide") or {}, record.get("lead") or {}
            fields = {k: v for k, v in record.items() if k not in ("guide", "lead")}
            if guide:
                fields.update(
                    guide=guide["model"], guide_step=guide.get("step"), guide_sigma_rel=guide.get("sigma_rel")
                )
            if lead:
                fields.update(lead_model=lead["model"], lead_steps=lead["steps"])
            return cls.create(**fields)
        except (TypeError, KeyError, ConfigError) as err:
            raise ArtifactError(f"the model's recorded sampling {record!r} is not valid ({err})") from None

    @classmethod
    def from_config(cls, section: Mapping[str, Any], prefix: str = "preview.") -> SamplingSpec:
        """The spec of a training config section (:data:`CONFIG_KEYS`); an error names the key (``prefix`` + key)."""
        values = {name: section[key] for key, (name, _) in CONFIG_KEYS.items() if key in section}
        try:
            return cls.create(**values)
        except ConfigError as err:
            message = str(err)
            for key, (name, _) in CONFIG_KEYS.items():
                if message.startswith(name + " "):
                    message = prefix + key + message[len(name) :]
            raise ConfigError(message) from None


def _digest(value: Any) -> str:
    """Eight hex digits of a value's JSON: a short, stable name part for settings that do not fit in a name."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]
