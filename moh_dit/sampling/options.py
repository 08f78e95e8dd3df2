"""The choices the command lines offer and their defaults, in one place (and light: no torch import, so
``--help`` answers at once). The code that acts on a choice (``make_scheduler``, ``load_pipeline``)
validates against the same names."""

from __future__ import annotations

from typing import Any, Optional

from moh_dit.errors import ConfigError

__all__ = [
    "SCHEDULERS",
    "DTYPES",
    "LABEL_MODES",
    "GRID_GUIDANCE",
    "EVAL_GUIDANCE",
    "EVAL_STEPS",
    "PROTOCOLS",
    "FAST_SCHEDULER",
    "FAST_STEPS",
    "check_guidance_interval",
    "check_grid_averaging",
    "GRID_AVERAGING_OFF",
    "describe_guidance",
    "describe_placement",
    "guidance_tag",
]

# Sampling schedulers for DiT's training schedule (moh_dit.sampling.schedulers.make_scheduler): DiT's DDPM with the
# learned variance, and fast solvers that use the noise prediction only.
SCHEDULERS = ("ddpm", "ddim", "dpm-solver", "dpm-solver-sde", "unipc")

# Transformer dtypes for sampling (the VAE stays in fp32).
DTYPES = ("fp32", "bf16", "fp16")

# How N-sample generation labels image i: uniformly at random from (seed, i), as the papers' 50K
# evaluations do, or class-balanced (i mod K), which lowers the variance of small-sample metrics.
LABEL_MODES = ("uniform", "balanced")

# Guidance defaults differ on purpose. Grids are for looking at: DiT's visual samples use scale 4.0, which
# trades diversity for clearly recognisable classes; it is the trainer's preview default, and sample.py's and
# the demo's for a model that does not record its own (a run records its preview guidance, scale and
# interval, with its exported pipeline). Evaluations reproduce the papers' FID protocol, which uses 1.5 (DiT)
# at every step; the MoH paper reports 1.25 as well. Pass --cfg-scale / --guidance-interval to choose.
GRID_GUIDANCE = 4.0
EVAL_GUIDANCE = 1.5

# DiT's evaluation protocol: 250 DDPM steps.
EVAL_STEPS = 250

# Sampling protocols (scheduler, steps). "dit" is DiT's: DDPM with the learned variance over 250 steps, the
# setting of every paper number; evaluate_fid.py uses it by default. "fast" is the sampler study's choice
# (benchmarks.samplers.choose: of the settings of at most 25 model evaluations whose KID is within 5% of the
# best of them, the one with the fewest) on the embedded default's model sampled as it records (guidance 4
# at timesteps 100-500, grids averaged below 100): DPM-Solver++ 25 steps, KID 3.23 against 3.79 at 20 steps
# and 7.81 for DDPM-250 (benchmarks/results/v7/samplers_cpu.md; on the older v2 model at guidance 2 at every
# step, 20 and 25 steps had tied). sample.py, the demo and the trainer's preview grids use it by default.
PROTOCOLS = {"dit": ("ddpm", EVAL_STEPS), "fast": ("dpm-solver", 25)}
FAST_SCHEDULER, FAST_STEPS = PROTOCOLS["fast"]


def check_guidance_interval(interval: Any, num_train_timesteps: int = 1000) -> Optional[tuple[int, int]]:
    """``None``, or ``(first, last)`` training timesteps (inclusive, ``0 <= first <= last < T``) as a tuple
    of ints; anything else is a :class:`ConfigError` naming the expected form. An interval that covers every
    timestep is ``None`` (the same pixels, so the same record).

    Guidance inside an interval of noise levels only is Kynkaenniemi et al. 2024 (arXiv:2404.07724):
    guidance at high noise narrows each class's variety, at low noise it sharpens artefacts (docs/sampling.md).
    """
    if interval is None:
        return None
    values = list(interval) if isinstance(interval, (list, tuple)) else None
    if (
        values is None
        or len(values) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        or not 0 <= values[0] <= values[1] < num_train_timesteps
    ):
        raise ConfigError(
            f"guidance_interval must be two timesteps [first, last] with 0 <= first <= last < "
            f"{num_train_timesteps} (e.g. [100, 600]), or null for guidance at every step; got {interval!r}"
        )
    return None if values == [0, num_train_timesteps - 1] else (values[0], values[1])


# ``--grid-averaging off``: no averaging even where the model records some (a command-line value only)
GRID_AVERAGING_OFF = "off"


def check_grid_averaging(last: Any, num_train_timesteps: int = 1000) -> Optional[int]:
    """``None`` (off), or the last training timestep ``0 <= last < T`` at which the denoiser's prediction is
    averaged over shifted patch grids (``MoHDiTPipeline(grid_averaging=...)``); anything else is a
    :class:`ConfigError` naming the expected form."""
    if last is None:
        return None
    if isinstance(last, bool) or not isinstance(last, int) or not 0 <= last < num_train_timesteps:
        raise ConfigError(
            f"grid_averaging must be a timestep between 0 and {num_train_timesteps - 1} (the steps at or below it "
            f"average the prediction over shifted patch grids; e.g. 100), or null for none; got {last!r}"
        )
    return int(last)


def describe_guidance(scale: Any, interval: Optional[Any], grid_averaging: Optional[int] = None) -> str:
    """``guidance 4 at timesteps 100-500`` or ``guidance 4 at every step``, and where the patch grid is
    averaged (``, patch grids averaged at timesteps 0-100``), for logs, pages and cards."""
    return f"guidance {float(scale):g} {describe_placement(interval, grid_averaging)}"


def describe_placement(interval: Optional[Any], grid_averaging: Optional[int] = None) -> str:
    """Where guidance applies and the patch grid is averaged, without the scale: ``at timesteps 100-500,
    patch grids averaged at timesteps 0-100`` or ``at every step``."""
    where = "at timesteps {}-{}".format(*interval) if interval else "at every step"
    return where + (f", patch grids averaged at timesteps 0-{grid_averaging}" if grid_averaging is not None else "")


def guidance_tag(interval: Optional[Any], grid_averaging: Optional[int] = None) -> str:
    """The part of a sample folder's name that says where guidance applies and the patch grid is averaged:
    ``-t100-500-avg100``, ``-t100-500``, ``-avg100`` or ``""`` (every step guided, nothing averaged)."""
    tag = "-t{}-{}".format(*interval) if interval else ""
    return tag + (f"-avg{grid_averaging}" if grid_averaging is not None else "")
