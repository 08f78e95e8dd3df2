"""The parts of a :class:`~moh_dit.sampling.spec.SamplingSpec`, one concept each: the sampler (which scheduler walks
which grid, and how each step evaluates the network), the guidance (how strongly, where, on which channels, by which
rule), the guide of autoguidance (which weaker model), the lead model that takes the grid's first steps, and the
sampling cache. Each part checks its own values when it is
made (a :class:`ConfigError` naming the flat key a user writes: ``guidance_interval``, ``num_inference_steps``, ...) and
says itself in words. Light: no torch import."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moh_dit.argtypes import is_number, is_whole
from moh_dit.errors import ConfigError
from moh_dit.logs import plural
from moh_dit.objectives.noise import ddpm_sigma
from moh_dit.objectives.registry import ALL_SAMPLERS, DEFAULT_OBJECTIVE, OBJECTIVES
from moh_dit.sampling.caches import cache_class
from moh_dit.sampling.rules import DEFAULT_RULE, rule_class

__all__ = [
    "SamplerSpec",
    "GuidanceSpec",
    "GuideSpec",
    "LeadSpec",
    "CacheSpec",
    "SCHEDULERS",
    "TRAIN_TIMESTEPS",
    "FAST_SCHEDULER",
    "FAST_STEPS",
    "GRID_GUIDANCE",
    "MAX_SIGMA_REL",
]

# Sampling schedulers of every objective (moh_dit.objectives.registry); a spec is checked against the model's
# objective where it meets one.
SCHEDULERS = ALL_SAMPLERS
# The training schedule's length (DiT's 1000 steps): guidance intervals and grid averaging name its timesteps.
TRAIN_TIMESTEPS = 1000
# The fast protocol of the default objective (the sampler study's choice, benchmarks/results/v7/samplers_cpu.md)
FAST_SCHEDULER, FAST_STEPS = OBJECTIVES[DEFAULT_OBJECTIVE].protocols["fast"]
# DiT's visual samples use guidance 4: recognisable classes at some cost in variety (grids, previews, the demo)
GRID_GUIDANCE = 4.0
# the widest relative EMA a power function has (moh_dit.posthoc_ema.MAX_SIGMA_REL, sqrt(1/12))
MAX_SIGMA_REL = math.sqrt(1 / 12)


def _pairs(options: Any, what: str) -> dict | None:
    """A mapping (or the sorted pairs a spec keeps) as a dict; ``None`` stays ``None``."""
    if isinstance(options, (Mapping, tuple, list)):
        return dict(options)
    if options is not None:
        raise ConfigError(f"{what} must be a mapping of the {what.split('_')[0]}'s options, got {options!r}")
    return None


@dataclass(frozen=True)
class SamplerSpec:
    """Which sampler walks which grid, and how each step evaluates the network.

    - ``scheduler``: one of :data:`SCHEDULERS`, or ``None`` for the pipeline's current one;
    - ``num_steps``: 1 .. 1000;
    - ``time_shift``: flow samplers' grid ``s -> shift s / (1 + (shift - 1) s)`` (SD3's; > 1 spends more steps at high
      noise); 1 (none) for DDPM models;
    - ``grid_averaging``: at the steps with DDPM timestep <= this (a flow model: at the same noise levels), average the
      prediction over the patch grid's shifts (fainter patch seams); ``None``: nowhere.
    """

    scheduler: str | None = FAST_SCHEDULER
    num_steps: int = FAST_STEPS
    time_shift: float = 1.0
    grid_averaging: int | None = None

    def __post_init__(self) -> None:
        T = TRAIN_TIMESTEPS
        if self.scheduler is not None and self.scheduler not in SCHEDULERS:
            raise ConfigError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if not is_whole(self.num_steps) or not 1 <= self.num_steps <= T:
            raise ConfigError(f"num_inference_steps must be an integer between 1 and {T}, got {self.num_steps!r}")
        shift = self.time_shift
        if not is_number(shift) or not (math.isfinite(shift) and shift > 0):
            raise ConfigError(f"time_shift must be a finite number > 0 (1: none; SD3 uses 3), got {shift!r}")
        object.__setattr__(self, "time_shift", float(shift))
        last = self.grid_averaging
        if last is not None and (not is_whole(last) or not 0 <= last < T):
            raise ConfigError(
                f"grid_averaging must be a timestep between 0 and {T - 1} (the steps at or below it average the "
                f"prediction over shifted patch grids; e.g. 100), or null for none; got {last!r}"
            )

    def averaged_at(self, sigma: float, timestep: int | None = None) -> bool:
        """Whether the prediction at noise level ``sigma`` (DDPM ``timestep``, where there is one) is averaged over
        shifted patch grids."""
        if self.grid_averaging is None:
            return False
        if timestep is not None:
            return int(timestep) <= self.grid_averaging
        return sigma <= ddpm_sigma(self.grid_averaging)

    def describe(self) -> str:
        """``dpm-solver, 25 steps`` (and the time shift)."""
        shift = f", time shift {self.time_shift:g}" if self.time_shift != 1.0 else ""
        steps = plural(self.num_steps, "step")
        return f"{self.scheduler or 'the pipeline scheduler'}, {steps}{shift}"


@dataclass(frozen=True)
class GuidanceSpec:
    """How strongly, where, on which channels and by which rule the two predictions of a step are mixed.

    - ``scale``: a finite number (1 = no guidance);
    - ``interval``: ``(first, last)`` DDPM training timesteps of DiT's schedule, inclusive, guided; ``None`` guides every
      step (an interval over every timestep is ``None`` too). A flow model is guided at the same noise levels.
      Guidance inside an interval of noise levels only is Kynkaenniemi et al. 2024 (arXiv:2404.07724);
    - ``noise``: ``(low, high)`` noise levels sigma (noise std over signal std, the same for every objective; ``high``
      may be ``inf``) guided instead; at most one of the two is set;
    - ``channels``: guide only the first N channels (3 reproduces the DiT/MoH-DiT/SiT papers); ``None``: all;
    - ``rule`` and ``rule_options``: how the predictions mix (:data:`moh_dit.sampling.rules.RULES`), the options kept
      as sorted ``(option, value)`` pairs with the rule's defaults filled in (the spec stays hashable).
    """

    scale: float = GRID_GUIDANCE
    interval: tuple[int, int] | None = None
    noise: tuple[float, float] | None = None
    channels: int | None = None
    rule: str = DEFAULT_RULE
    rule_options: Any = None

    def __post_init__(self) -> None:
        T = TRAIN_TIMESTEPS
        if not is_number(self.scale) or not math.isfinite(self.scale):
            raise ConfigError(f"guidance_scale must be a finite number, got {self.scale!r}")
        object.__setattr__(self, "scale", float(self.scale))
        interval = self.interval
        if interval is not None:
            values = list(interval) if isinstance(interval, (list, tuple)) else None
            if (
                values is None
                or len(values) != 2
                or not all(map(is_whole, values))
                or not 0 <= values[0] <= values[1] < T
            ):
                raise ConfigError(
                    f"guidance_interval must be two timesteps [first, last] with 0 <= first <= last < {T} "
                    f"(e.g. [100, 600]), or null for guidance at every step; got {interval!r}"
                )
            # every timestep guided is the same pixels as no interval, so the same record
            object.__setattr__(self, "interval", None if values == [0, T - 1] else (values[0], values[1]))
        object.__setattr__(self, "noise", _noise_range(self.noise))
        if self.interval is not None and self.noise is not None:
            raise ConfigError(
                "guidance_interval (DDPM timesteps) and guidance_noise (noise levels) say the same thing: give one"
            )
        if self.channels is not None and (not is_whole(self.channels) or self.channels < 1):
            raise ConfigError(f"guidance_channels must be an integer >= 1, or null for all, got {self.channels!r}")
        options = rule_class(self.rule).check(_pairs(self.rule_options, "rule_options"))
        object.__setattr__(self, "rule_options", tuple(sorted(options.items())))

    @property
    def options(self) -> dict[str, float | None]:
        """The rule's options (its defaults filled in)."""
        return dict(self.rule_options)

    def noise_range(self) -> tuple[float, float] | None:
        """The guided noise levels: ``noise``, or the levels of a timestep interval's ends (an interval from timestep 0
        or to 999 is open at that end); ``None`` guides every step."""
        if self.noise is not None:
            return self.noise
        if self.interval is None:
            return None
        first, last = self.interval
        return (
            0.0 if first == 0 else ddpm_sigma(first),
            math.inf if last == TRAIN_TIMESTEPS - 1 else ddpm_sigma(last),
        )

    def guided_at(self, sigma: float, timestep: int | None = None) -> bool:
        """Whether guidance applies at noise level ``sigma``. ``timestep``: the DDPM timestep where the sampler walks
        DiT's schedule; an interval in timesteps is then applied to it exactly, as moh-dit 0.3 did."""
        if self.interval is not None and timestep is not None:
            return self.interval[0] <= int(timestep) <= self.interval[1]
        levels = self.noise_range()
        return levels is None or levels[0] <= sigma <= levels[1]

    def placement(self) -> str:
        """``at timesteps 100-500``, ``at noise levels 0.37-3.3`` or ``at every step``."""
        if self.interval:
            return "at timesteps {}-{}".format(*self.interval)
        if self.noise:
            return "at noise levels {:.3g}-{:.3g}".format(*self.noise)
        return "at every step"

    def describe(self, guide: GuideSpec | None = None) -> str:
        """``guidance 4 at every step`` (the rule when it is not CFG's; ``autoguidance ... by <guide>`` with a guide)."""
        rule = rule_class(self.rule).describe(self.options)
        kind = "autoguidance" if guide is not None else "guidance"
        channels = f" on the first {self.channels} channels" if self.channels else ""
        by = guide.describe() if guide is not None else ""
        return f"{f'{rule} ' if rule else ''}{kind} {self.scale:g}{by}{channels} {self.placement()}"


@dataclass(frozen=True)
class GuideSpec:
    """Autoguidance's weaker model, guided away from instead of the unconditional prediction: a run, checkpoint,
    pipeline or transformer folder (``model``), a run's checkpoint at ``step``, or an EMA of relative width
    ``sigma_rel`` rebuilt from the run's post-hoc snapshots."""

    model: str
    step: int | None = None
    sigma_rel: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"guide must be the path of a run, checkpoint or model folder, got {self.model!r}")
        if self.step is not None and (not is_whole(self.step) or self.step < 1):
            raise ConfigError(f"guide_step must be a training step >= 1, got {self.step!r}")
        width = self.sigma_rel
        if width is not None:
            if not is_number(width) or not 0 < width < MAX_SIGMA_REL:
                raise ConfigError(
                    f"guide_sigma_rel must be a relative EMA width in (0, {MAX_SIGMA_REL:.4f}), got {width!r}"
                )
            object.__setattr__(self, "sigma_rel", float(width))

    def record(self) -> dict[str, Any]:
        """As records store it: ``{"model", "step", "sigma_rel"}``."""
        return {"model": self.model, "step": self.step, "sigma_rel": self.sigma_rel}

    def describe(self) -> str:
        """`` by runs/x (step 2000, EMA sigma_rel 0.05)``."""
        which = [f"step {self.step}"] if self.step is not None else []
        which += [f"EMA sigma_rel {self.sigma_rel:g}"] if self.sigma_rel is not None else []
        return f" by {self.model}" + (f" ({', '.join(which)})" if which else "")


@dataclass(frozen=True)
class LeadSpec:
    """Another model that takes the grid's first ``steps`` steps before the main model takes over from where it
    stopped (a hand-off between experts of different noise levels: eDiff-I's ensemble of expert denoisers, SDXL's base
    and refiner; for a two-step distilled generator, the first jump of the student it was trained from). ``model``: a
    run, checkpoint, pipeline or transformer folder."""

    model: str
    steps: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"lead_model must be the path of a run, checkpoint or model folder, got {self.model!r}")
        if not is_whole(self.steps) or self.steps < 1:
            raise ConfigError(f"lead_steps must be a number of sampling steps >= 1, got {self.steps!r}")
        object.__setattr__(self, "steps", int(self.steps))

    def record(self) -> dict[str, Any]:
        """As records store it: ``{"model", "steps"}``."""
        return {"model": self.model, "steps": self.steps}

    def describe(self) -> str:
        """``the first step by runs/ect``."""
        return f"the first {plural(self.steps, 'step') if self.steps > 1 else 'step'} by {self.model}"


@dataclass(frozen=True)
class CacheSpec:
    """A sampling cache (:data:`moh_dit.sampling.caches.CACHES`) and its options, kept as sorted pairs with the cache's
    defaults filled in."""

    name: str
    options: Any = None

    def __post_init__(self) -> None:
        settings = cache_class(self.name).check(_pairs(self.options, "cache_options"))
        object.__setattr__(self, "options", tuple(sorted(settings.items())))

    @property
    def settings(self) -> dict[str, float]:
        return dict(self.options)

    def describe(self) -> str:
        return cache_class(self.name).describe(self.settings)


def _noise_range(value: Any) -> tuple[float, float] | None:
    """``guidance_noise`` checked: two noise levels ``0 <= low <= high`` (``high`` may be ``inf``, or ``None`` in a
    record: no upper end); ``[0, inf]`` is every step, so ``None``."""
    if value is None:
        return None
    values = list(value) if isinstance(value, (list, tuple)) else None
    if values is not None and len(values) == 2 and values[1] is None:
        values[1] = math.inf
    numbers = values is not None and len(values) == 2 and all(map(is_number, values))
    if not numbers or not (math.isfinite(values[0]) and 0 <= values[0] <= values[1]) or math.isnan(values[1]):
        raise ConfigError(
            f"guidance_noise must be two noise levels [low, high] with 0 <= low <= high (noise std over signal std; "
            f"high may be inf), e.g. [0.3, 5.4]; got {value!r}"
        )
    return None if values == [0, math.inf] else (float(values[0]), float(values[1]))
