"""How to sample, as one value: :class:`SamplingSpec`.

A spec holds the scheduler, the number of steps, the guidance (scale, interval, channels) and the grid
averaging. It checks itself when it is made, and it describes, tags and records itself, so the pipeline,
N-sample generation, the trainer's previews, the demo, the model card and every manifest take or store
the same value; a new sampling option is a change to this file (and, for its flag, to
:mod:`moh_dit.sampling.options`, which builds a spec from a command line). Light (no torch import), so that
``--help`` answers at once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.objectives.noise import ddpm_sigma
from moh_dit.objectives.registry import (
    ALL_SAMPLERS,
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    resolve_protocol,
)
from moh_dit.sampling.caches import check_cache_options, describe_cache
from moh_dit.sampling.rules import check_rule_options, describe_rule

__all__ = [
    "SamplingSpec",
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

# Sampling schedulers of every objective (moh_dit.objectives.registry): DiT's DDPM with the learned variance and
# fast solvers of its noise prediction; flow matching's Euler, Heun, DPM-Solver++ and UniPC in flow mode, and SiT's
# SDE. A spec is checked against the model's objective where it meets one.
SCHEDULERS = ALL_SAMPLERS

# Transformer dtypes for sampling (the VAE stays in fp32).
DTYPES = ("fp32", "bf16", "fp16")

# How N-sample generation labels image i: uniformly at random from (seed, i), as the papers' 50K
# evaluations do, or class-balanced (i mod K), which lowers the variance of small-sample metrics.
LABEL_MODES = ("uniform", "balanced")

# The training schedule's length (DiT's 1000 steps): guidance intervals and grid averaging name its timesteps.
TRAIN_TIMESTEPS = 1000

# Guidance defaults differ on purpose. Grids are for looking at: DiT's visual samples use scale 4.0, which
# trades diversity for clearly recognisable classes; it is the trainer's preview default, and sample.py's and
# the demo's for a model that does not record its own (a run records its preview spec with its exported
# pipeline). Evaluations reproduce the papers' FID protocol, which uses 1.5 (DiT) at every step; the MoH
# paper reports 1.25 as well. Pass --cfg-scale / --guidance-interval to choose.
GRID_GUIDANCE = 4.0
EVAL_GUIDANCE = 1.5

# DiT's evaluation protocol: 250 DDPM steps.
EVAL_STEPS = 250

# Sampling protocols (scheduler, steps) of DiT's DDPM. "dit" is DiT's: DDPM with the learned variance over 250
# steps, the setting of every paper number; evaluate_fid.py uses the objective's paper protocol by default. "fast"
# is the sampler study's choice (benchmarks.samplers.choose: of the settings of at most 25 model evaluations whose
# KID is within 5% of the best of them, the one with the fewest) on the embedded default's model sampled as it
# records (guidance 4 at timesteps 100-500, grids averaged below 100): DPM-Solver++ 25 steps, KID 3.23 against 3.79
# at 20 steps and 7.81 for DDPM-250 (benchmarks/results/v7/samplers_cpu.md). sample.py, the demo and the trainer's
# preview grids use it by default. Flow models have their own (moh_dit.objectives.registry: sit-sde, sit-ode, fast).
PROTOCOLS = OBJECTIVES[DEFAULT_OBJECTIVE].protocols
FAST_SCHEDULER, FAST_STEPS = PROTOCOLS["fast"]

# The keys of a training config's sections that hold a spec (moh_dit.training.config: ``preview``, whose spec
# the exported pipeline records, and ``log.eval_sampling``), and the fields they fill.
CONFIG_KEYS = {
    "scheduler": "scheduler",
    "num_steps": "num_inference_steps",
    "guidance_scale": "guidance_scale",
    "guidance_interval": "guidance_interval",
    "guidance_noise": "guidance_noise",
    "guidance_channels": "guidance_channels",
    "grid_averaging": "grid_averaging",
    "time_shift": "time_shift",
    "guidance_rule": "guidance_rule",
    "rule_options": "rule_options",
    "guide": "guide",
    "guide_step": "guide_step",
    "guide_sigma_rel": "guide_sigma_rel",
    "cache": "cache",
    "cache_options": "cache_options",
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


# the widest relative EMA a power function has (moh_dit.training.posthoc_ema.MAX_SIGMA_REL, sqrt(1/12); not imported:
# the spec stays below the training layer)
MAX_SIGMA_REL = math.sqrt(1 / 12)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample: scheduler, steps, guidance scale, where guidance applies, guided channels, grid averaging and
    the time shift of flow samplers.

    Every field is checked when the spec is made (:class:`ConfigError` naming the expected form); the scheduler is
    checked against a model's objective where the spec meets one:

    - ``scheduler``: one of :data:`SCHEDULERS`, or ``None`` for the pipeline's current one;
    - ``num_inference_steps``: 1 .. 1000;
    - ``guidance_scale``: a finite number (1 = no guidance);
    - ``guidance_interval``: ``(first, last)`` DDPM training timesteps of DiT's schedule, inclusive, guided; ``None``
      guides every step (an interval over every timestep is ``None`` too). A flow model is guided at the same noise
      levels. Guidance inside an interval of noise levels only is Kynkaenniemi et al. 2024 (arXiv:2404.07724): at
      high noise it narrows each class's variety, at low noise it sharpens artefacts (docs/sampling.md);
    - ``guidance_noise``: ``(low, high)`` noise levels sigma (noise std over signal std, the same quantity for
      every objective; ``high`` may be ``inf``) guided instead; at most one of the two is set;
    - ``guidance_channels``: guide only the first N channels (3 reproduces the DiT/MoH-DiT/SiT papers); ``None``: all;
    - ``grid_averaging``: at the steps with DDPM timestep <= this (a flow model: at the same noise levels), average
      the prediction over the patch grid's shifts (fainter patch seams); ``None``: nowhere;
    - ``time_shift``: flow samplers' grid ``s -> shift s / (1 + (shift - 1) s)`` (SD3's; > 1 spends more steps at
      high noise); 1 (none) for DDPM models;
    - ``guidance_rule`` and ``rule_options``: how the two predictions mix (:data:`moh_dit.sampling.rules.RULES`:
      ``cfg``, ``apg``, ``cfg-zero-star``; the options a mapping of the rule's, its defaults filled in);
    - ``guide``, ``guide_step``, ``guide_sigma_rel``: autoguidance: the weaker model guided away from (a run, a
      checkpoint, pipeline or transformer folder; the run's checkpoint at ``guide_step``; an EMA of that relative
      width rebuilt from its post-hoc snapshots) instead of the unconditional prediction; ``None``: classifier-free.
    """

    scheduler: str | None = FAST_SCHEDULER
    num_inference_steps: int = FAST_STEPS
    guidance_scale: float = GRID_GUIDANCE
    guidance_interval: tuple[int, int] | None = None
    guidance_channels: int | None = None
    grid_averaging: int | None = None
    guidance_noise: tuple[float, float] | None = None
    time_shift: float = 1.0
    guidance_rule: str = "cfg"
    rule_options: Any = None  # kept as a sorted tuple of (option, value) pairs: the spec stays hashable
    guide: str | None = None
    guide_step: int | None = None
    guide_sigma_rel: float | None = None
    cache: str | None = None
    cache_options: Any = None  # a sorted tuple of (option, value) pairs, as rule_options

    def __post_init__(self) -> None:
        T = TRAIN_TIMESTEPS
        if self.scheduler is not None and self.scheduler not in SCHEDULERS:
            raise ConfigError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if not _is_int(self.num_inference_steps) or not 1 <= self.num_inference_steps <= T:
            raise ConfigError(
                f"num_inference_steps must be an integer between 1 and {T}, got {self.num_inference_steps!r}"
            )
        scale = self.guidance_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ConfigError(f"guidance_scale must be a finite number, got {scale!r}")
        object.__setattr__(self, "guidance_scale", float(scale))
        interval = self.guidance_interval
        if interval is not None:
            values = list(interval) if isinstance(interval, (list, tuple)) else None
            if (
                values is None
                or len(values) != 2
                or not all(map(_is_int, values))
                or not 0 <= values[0] <= values[1] < T
            ):
                raise ConfigError(
                    f"guidance_interval must be two timesteps [first, last] with 0 <= first <= last < {T} "
                    f"(e.g. [100, 600]), or null for guidance at every step; got {interval!r}"
                )
            # every timestep guided is the same pixels as no interval, so the same record
            object.__setattr__(self, "guidance_interval", None if values == [0, T - 1] else (values[0], values[1]))
        object.__setattr__(self, "guidance_noise", _noise_range(self.guidance_noise))
        if self.guidance_interval is not None and self.guidance_noise is not None:
            raise ConfigError(
                "guidance_interval (DDPM timesteps) and guidance_noise (noise levels) say the same thing: give one"
            )
        channels = self.guidance_channels
        if channels is not None and (not _is_int(channels) or channels < 1):
            raise ConfigError(f"guidance_channels must be an integer >= 1, or null for all, got {channels!r}")
        last = self.grid_averaging
        if last is not None and (not _is_int(last) or not 0 <= last < T):
            raise ConfigError(
                f"grid_averaging must be a timestep between 0 and {T - 1} (the steps at or below it average the "
                f"prediction over shifted patch grids; e.g. 100), or null for none; got {last!r}"
            )
        shift = self.time_shift
        if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not (math.isfinite(shift) and shift > 0):
            raise ConfigError(f"time_shift must be a finite number > 0 (1: none; SD3 uses 3), got {shift!r}")
        object.__setattr__(self, "time_shift", float(shift))
        options = self.rule_options
        options = dict(options) if isinstance(options, (Mapping, tuple, list)) else options
        if options is not None and not isinstance(options, dict):
            raise ConfigError(f"rule_options must be a mapping of the rule's options, got {self.rule_options!r}")
        object.__setattr__(
            self, "rule_options", tuple(sorted(check_rule_options(self.guidance_rule, options).items()))
        )
        self._check_guide()
        options = self.cache_options
        options = dict(options) if isinstance(options, (Mapping, tuple, list)) else options
        if options is not None and not isinstance(options, dict):
            raise ConfigError(f"cache_options must be a mapping of the cache's options, got {self.cache_options!r}")
        object.__setattr__(self, "cache_options", tuple(sorted(check_cache_options(self.cache, options).items())))

    def _check_guide(self) -> None:
        guide, step, width = self.guide, self.guide_step, self.guide_sigma_rel
        if guide is not None and (not isinstance(guide, str) or not guide):
            raise ConfigError(f"guide must be the path of a run, checkpoint or model folder, got {guide!r}")
        if guide is None and (step is not None or width is not None):
            raise ConfigError("guide_step and guide_sigma_rel choose the guide's weights: give guide too")
        if step is not None and (not _is_int(step) or step < 1):
            raise ConfigError(f"guide_step must be a training step >= 1, got {step!r}")
        if width is not None:
            if isinstance(width, bool) or not isinstance(width, (int, float)) or not 0 < width < MAX_SIGMA_REL:
                raise ConfigError(
                    f"guide_sigma_rel must be a relative EMA width in (0, {MAX_SIGMA_REL:.4f}), got {width!r}"
                )
            object.__setattr__(self, "guide_sigma_rel", float(width))

    @property
    def rule(self) -> dict[str, float]:
        """The rule's options (its defaults filled in)."""
        return dict(self.rule_options)

    @property
    def cache_settings(self) -> dict[str, float]:
        """The cache's options (its defaults filled in; ``{}`` without a cache)."""
        return dict(self.cache_options)

    def guide_record(self) -> dict[str, Any] | None:
        """The guide as records store it: ``{"model", "step", "sigma_rel"}`` (``None``: classifier-free)."""
        if self.guide is None:
            return None
        return {"model": self.guide, "step": self.guide_step, "sigma_rel": self.guide_sigma_rel}

    # ------------------------------------------------------------------------------------------------
    # Named protocols, changes
    # ------------------------------------------------------------------------------------------------
    @classmethod
    def protocol(cls, name: str, objective: str = DEFAULT_OBJECTIVE, **changes: Any) -> SamplingSpec:
        """The scheduler and steps of a named protocol for a model of ``objective`` (``paper``, and the objective's
        own: ``dit``/``fast`` for DDPM, ``sit-sde``/``sit-ode``/``fast`` for flow), plus ``changes``."""
        scheduler, steps = resolve_protocol(name, objective)
        return cls(**{"scheduler": scheduler, "num_inference_steps": steps, **changes})

    def replace(self, **changes: Any) -> SamplingSpec:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def noise_range(self) -> tuple[float, float] | None:
        """The guided noise levels: ``guidance_noise``, or the levels of a timestep interval's ends (an interval from
        timestep 0 or to 999 is open at that end); ``None`` guides every step."""
        if self.guidance_noise is not None:
            return self.guidance_noise
        if self.guidance_interval is None:
            return None
        first, last = self.guidance_interval
        return (
            0.0 if first == 0 else ddpm_sigma(first),
            math.inf if last == TRAIN_TIMESTEPS - 1 else ddpm_sigma(last),
        )

    def guided_at(self, sigma: float, timestep: int | None = None) -> bool:
        """Whether guidance applies at noise level ``sigma``. ``timestep``: the DDPM timestep where the sampler walks
        DiT's schedule; an interval in timesteps is then applied to it exactly, as moh-dit 0.3 did."""
        if self.guidance_interval is not None and timestep is not None:
            return self.guidance_interval[0] <= int(timestep) <= self.guidance_interval[1]
        levels = self.noise_range()
        return levels is None or levels[0] <= sigma <= levels[1]

    def averaged_at(self, sigma: float, timestep: int | None = None) -> bool:
        """Whether the prediction at noise level ``sigma`` (DDPM ``timestep``, where there is one) is averaged over
        shifted patch grids."""
        if self.grid_averaging is None:
            return False
        if timestep is not None:
            return int(timestep) <= self.grid_averaging
        return sigma <= ddpm_sigma(self.grid_averaging)

    # ------------------------------------------------------------------------------------------------
    # Words, tags and records
    # ------------------------------------------------------------------------------------------------
    def placement(self) -> str:
        """Where guidance applies and the patch grid is averaged: ``at timesteps 100-500, patch grids averaged at
        timesteps 0-100``, ``at noise levels 0.37-3.3`` or ``at every step``."""
        if self.guidance_interval:
            where = "at timesteps {}-{}".format(*self.guidance_interval)
        elif self.guidance_noise:
            where = "at noise levels {:.3g}-{:.3g}".format(*self.guidance_noise)
        else:
            where = "at every step"
        if self.grid_averaging is not None:
            where += f", patch grids averaged at timesteps 0-{self.grid_averaging}"
        return where

    def describe_guidance(self) -> str:
        """``guidance 4 at timesteps 100-500`` (and where grids are averaged; the rule, and the guide of
        autoguidance, when they are not classifier-free guidance's), for logs, pages and cards."""
        channels = f" on the first {self.guidance_channels} channels" if self.guidance_channels else ""
        rule = describe_rule(self.guidance_rule, self.rule)
        kind = "autoguidance" if self.guide is not None else "guidance"
        by = ""
        if self.guide is not None:
            which = [f"step {self.guide_step}"] if self.guide_step is not None else []
            which += [f"EMA sigma_rel {self.guide_sigma_rel:g}"] if self.guide_sigma_rel is not None else []
            by = f" by {self.guide}" + (f" ({', '.join(which)})" if which else "")
        return f"{f'{rule} ' if rule else ''}{kind} {self.guidance_scale:g}{by}{channels} {self.placement()}"

    def describe(self) -> str:
        """Everything in words: ``dpm-solver, 25 steps, guidance 4 at timesteps 100-500``."""
        shift = f", time shift {self.time_shift:g}" if self.time_shift != 1.0 else ""
        scheduler = self.scheduler or "the pipeline scheduler"
        cache = f", {describe_cache(self.cache, self.cache_settings)}" if self.cache else ""
        return f"{scheduler}, {self.num_inference_steps} steps{shift}, {self.describe_guidance()}{cache}"

    def tag(self) -> str:
        """The part of a sample folder's name that says where guidance applies, the patch grid is averaged and the
        grid is shifted: ``-t100-500-avg100``, ``-n0.37-3.3``, ``-shift3`` or ``""`` (every step guided, nothing
        averaged, no shift)."""
        tag = "-t{}-{}".format(*self.guidance_interval) if self.guidance_interval else ""
        tag += "-n{:g}-{:g}".format(*self.guidance_noise) if self.guidance_noise else ""
        tag += f"-avg{self.grid_averaging}" if self.grid_averaging is not None else ""
        tag += f"-shift{self.time_shift:g}" if self.time_shift != 1.0 else ""
        if self.guidance_rule != "cfg":  # the rule and a digest of its options
            tag += f"-{self.guidance_rule}-{_digest(self.rule_options)}"
        tag += f"-guide-{_digest(self.guide_record())}" if self.guide is not None else ""
        return tag + (f"-{self.cache}-{_digest(self.cache_options)}" if self.cache is not None else "")

    def record(self) -> dict[str, Any]:
        """The spec as manifests store it (a pipeline's ``sampling``). ``guidance_channels``, ``guidance_noise`` and
        ``time_shift`` only when set, so a record is the same as the records written before they were fields."""
        record = {
            "guidance_scale": self.guidance_scale,
            "guidance_interval": list(self.guidance_interval) if self.guidance_interval else None,
            "scheduler": self.scheduler,
            "num_inference_steps": self.num_inference_steps,
            "grid_averaging": self.grid_averaging,
        }
        if self.guidance_channels is not None:
            record["guidance_channels"] = self.guidance_channels
        if self.guidance_noise is not None:
            low, high = self.guidance_noise
            record["guidance_noise"] = [low, None if math.isinf(high) else high]  # JSON has no infinity
        if self.time_shift != 1.0:
            record["time_shift"] = self.time_shift
        if self.guidance_rule != "cfg":
            record["guidance_rule"], record["rule_options"] = self.guidance_rule, self.rule
        if self.guide is not None:
            record["guide"] = self.guide_record()
        if self.cache is not None:
            record["cache"], record["cache_options"] = self.cache, self.cache_settings
        return record

    @classmethod
    def from_record(cls, record: dict | None) -> SamplingSpec | None:
        """A recorded spec (from a manifest or a run's config), or ``None`` for none; a damaged record is an
        :class:`ArtifactError`."""
        if not record:
            return None
        try:
            guide = record.get("guide") or {}
            fields = {k: v for k, v in record.items() if k != "guide"}
            if guide:
                fields.update(
                    guide=guide["model"], guide_step=guide.get("step"), guide_sigma_rel=guide.get("sigma_rel")
                )
            return cls(**fields)
        except (TypeError, KeyError, ConfigError) as err:
            raise ArtifactError(f"the model's recorded sampling {record!r} is not valid ({err})") from None

    @classmethod
    def from_config(cls, section: Mapping[str, Any], prefix: str = "preview.") -> SamplingSpec:
        """The spec of a training config section (:data:`CONFIG_KEYS`); an error names the key (``prefix`` + key)."""
        values = {name: section[key] for key, name in CONFIG_KEYS.items() if key in section}
        try:
            return cls(**values)
        except ConfigError as err:
            message = str(err)
            for key, name in CONFIG_KEYS.items():
                if message.startswith(name + " "):
                    message = prefix + key + message[len(name) :]
            raise ConfigError(message) from None


def _noise_range(value: Any) -> tuple[float, float] | None:
    """``guidance_noise`` checked: two noise levels ``0 <= low <= high`` (``high`` may be ``inf``, or ``None`` in a
    record: no upper end); ``[0, inf]`` is every step, so ``None``."""
    if value is None:
        return None
    values = list(value) if isinstance(value, (list, tuple)) else None
    if values is not None and len(values) == 2 and values[1] is None:
        values[1] = math.inf
    numbers = values is not None and len(values) == 2
    numbers = numbers and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if not numbers or not (math.isfinite(values[0]) and 0 <= values[0] <= values[1]) or math.isnan(values[1]):
        raise ConfigError(
            f"guidance_noise must be two noise levels [low, high] with 0 <= low <= high (noise std over signal std; "
            f"high may be inf), e.g. [0.3, 5.4]; got {value!r}"
        )
    return None if values == [0, math.inf] else (float(values[0]), float(values[1]))


def _digest(value: Any) -> str:
    """Eight hex digits of a value's JSON: a short, stable name part for settings that do not fit in a name."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]
