"""How to sample, as one value: :class:`SamplingSpec`.

A spec holds the scheduler, the number of steps, the guidance (scale, interval, channels) and the grid
averaging. It checks itself when it is made, and it describes, tags and records itself, so the pipeline,
N-sample generation, the trainer's previews, the demo, the model card and every manifest take or store
the same value; a new sampling option is a change to this file. It also adds its own command-line options
and is built from them. Light (no torch import), so that ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moh_dit.argtypes import finite_float, non_negative_int, positive_int
from moh_dit.errors import ArtifactError, ConfigError

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

# Sampling schedulers for DiT's training schedule (moh_dit.sampling.schedulers.make_scheduler): DiT's DDPM with
# the learned variance, and fast solvers that use the noise prediction only.
SCHEDULERS = ("ddpm", "ddim", "dpm-solver", "dpm-solver-sde", "unipc")

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

# Sampling protocols (scheduler, steps). "dit" is DiT's: DDPM with the learned variance over 250 steps, the
# setting of every paper number; evaluate_fid.py uses it by default. "fast" is the sampler study's choice
# (benchmarks.samplers.choose: of the settings of at most 25 model evaluations whose KID is within 5% of the
# best of them, the one with the fewest) on the embedded default's model sampled as it records (guidance 4
# at timesteps 100-500, grids averaged below 100): DPM-Solver++ 25 steps, KID 3.23 against 3.79 at 20 steps
# and 7.81 for DDPM-250 (benchmarks/results/v7/samplers_cpu.md). sample.py, the demo and the trainer's
# preview grids use it by default.
PROTOCOLS = {"dit": ("ddpm", EVAL_STEPS), "fast": ("dpm-solver", 25)}
FAST_SCHEDULER, FAST_STEPS = PROTOCOLS["fast"]

# The keys of a training config's sections that hold a spec (moh_dit.training.config: ``preview``, whose spec
# the exported pipeline records, and ``log.eval_sampling``), and the fields they fill.
CONFIG_KEYS = {
    "scheduler": "scheduler",
    "num_steps": "num_inference_steps",
    "guidance_scale": "guidance_scale",
    "guidance_interval": "guidance_interval",
    "guidance_channels": "guidance_channels",
    "grid_averaging": "grid_averaging",
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

logger = logging.getLogger("moh_dit")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample: scheduler, steps, guidance scale, interval and channels, and grid averaging.

    Every field is checked when the spec is made (:class:`ConfigError` naming the expected form):

    - ``scheduler``: one of :data:`SCHEDULERS`, or ``None`` for the pipeline's current one;
    - ``num_inference_steps``: 1 .. 1000;
    - ``guidance_scale``: a finite number (1 = no guidance);
    - ``guidance_interval``: ``(first, last)`` training timesteps, inclusive, guided; ``None`` guides every step
      (an interval over every timestep is ``None`` too). Guidance inside an interval of noise levels only is
      Kynkaenniemi et al. 2024 (arXiv:2404.07724): at high noise it narrows each class's variety, at low noise
      it sharpens artefacts (docs/sampling.md);
    - ``guidance_channels``: guide only the first N channels (3 reproduces the DiT/MoH-DiT papers); ``None``: all;
    - ``grid_averaging``: at the steps with training timestep <= this, average the prediction over the patch
      grid's shifts (fainter patch seams); ``None``: nowhere.
    """

    scheduler: str | None = FAST_SCHEDULER
    num_inference_steps: int = FAST_STEPS
    guidance_scale: float = GRID_GUIDANCE
    guidance_interval: tuple[int, int] | None = None
    guidance_channels: int | None = None
    grid_averaging: int | None = None

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
        channels = self.guidance_channels
        if channels is not None and (not _is_int(channels) or channels < 1):
            raise ConfigError(f"guidance_channels must be an integer >= 1, or null for all, got {channels!r}")
        last = self.grid_averaging
        if last is not None and (not _is_int(last) or not 0 <= last < T):
            raise ConfigError(
                f"grid_averaging must be a timestep between 0 and {T - 1} (the steps at or below it average the "
                f"prediction over shifted patch grids; e.g. 100), or null for none; got {last!r}"
            )

    # ------------------------------------------------------------------------------------------------
    # Named protocols, changes
    # ------------------------------------------------------------------------------------------------
    @classmethod
    def protocol(cls, name: str, **changes: Any) -> SamplingSpec:
        """The scheduler and steps of a named protocol (:data:`PROTOCOLS`: ``dit``, ``fast``), plus ``changes``."""
        if name not in PROTOCOLS:
            raise ConfigError(f"unknown sampling protocol {name!r}; choose one of {', '.join(PROTOCOLS)}")
        scheduler, steps = PROTOCOLS[name]
        return cls(**{"scheduler": scheduler, "num_inference_steps": steps, **changes})

    def replace(self, **changes: Any) -> SamplingSpec:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def guided_at(self, t: Any) -> bool:
        """Whether guidance applies at training timestep ``t``."""
        return self.guidance_interval is None or self.guidance_interval[0] <= int(t) <= self.guidance_interval[1]

    def averaged_at(self, t: Any) -> bool:
        """Whether the prediction at training timestep ``t`` is averaged over shifted patch grids."""
        return self.grid_averaging is not None and int(t) <= self.grid_averaging

    # ------------------------------------------------------------------------------------------------
    # Words, tags and records
    # ------------------------------------------------------------------------------------------------
    def placement(self) -> str:
        """Where guidance applies and the patch grid is averaged: ``at timesteps 100-500, patch grids averaged at
        timesteps 0-100`` or ``at every step``."""
        where = "at timesteps {}-{}".format(*self.guidance_interval) if self.guidance_interval else "at every step"
        if self.grid_averaging is not None:
            where += f", patch grids averaged at timesteps 0-{self.grid_averaging}"
        return where

    def describe_guidance(self) -> str:
        """``guidance 4 at timesteps 100-500`` (and where grids are averaged), for logs, pages and cards."""
        channels = f" on the first {self.guidance_channels} channels" if self.guidance_channels else ""
        return f"guidance {self.guidance_scale:g}{channels} {self.placement()}"

    def describe(self) -> str:
        """Everything in words: ``dpm-solver, 25 steps, guidance 4 at timesteps 100-500``."""
        return f"{self.scheduler or 'the pipeline scheduler'}, {self.num_inference_steps} steps, {self.describe_guidance()}"

    def tag(self) -> str:
        """The part of a sample folder's name that says where guidance applies and the patch grid is averaged:
        ``-t100-500-avg100``, ``-t100-500``, ``-avg100`` or ``""`` (every step guided, nothing averaged)."""
        tag = "-t{}-{}".format(*self.guidance_interval) if self.guidance_interval else ""
        return tag + (f"-avg{self.grid_averaging}" if self.grid_averaging is not None else "")

    def record(self) -> dict[str, Any]:
        """The spec as manifests store it (a pipeline's ``sampling``). ``guidance_channels`` only when set, so a
        record is the same as the records written before it was a field."""
        record = {
            "guidance_scale": self.guidance_scale,
            "guidance_interval": list(self.guidance_interval) if self.guidance_interval else None,
            "scheduler": self.scheduler,
            "num_inference_steps": self.num_inference_steps,
            "grid_averaging": self.grid_averaging,
        }
        if self.guidance_channels is not None:
            record["guidance_channels"] = self.guidance_channels
        return record

    @classmethod
    def from_record(cls, record: dict | None) -> SamplingSpec | None:
        """A recorded spec (from a manifest or a run's config), or ``None`` for none; a damaged record is an
        :class:`ArtifactError`."""
        if not record:
            return None
        try:
            return cls(**record)
        except (TypeError, ConfigError) as err:
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

    # ------------------------------------------------------------------------------------------------
    # The command line
    # ------------------------------------------------------------------------------------------------
    @staticmethod
    def add_arguments(parser: Any, guidance: float | None, protocol: str) -> None:
        """The sampling options (``--protocol``, ``--scheduler``, ``--num-steps``, ``--cfg-scale``,
        ``--guidance-channels``, ``--guidance-interval``, ``--grid-averaging``) with their names, types and
        choices. ``guidance``: the default scale, or ``None`` for the model's recorded one (see :meth:`from_args`)."""
        described = ", ".join(f"{name} = {sched} {steps} steps" for name, (sched, steps) in PROTOCOLS.items())
        parser.add_argument(
            "--protocol",
            choices=list(PROTOCOLS),
            default=protocol,
            help=f"scheduler and steps unless --scheduler/--num-steps say otherwise ({described})",
        )
        parser.add_argument("--scheduler", choices=SCHEDULERS, default=None, help="default: the protocol's")
        parser.add_argument(
            "--num-steps", type=positive_int, default=None, help="sampling steps (default: the protocol's)"
        )
        parser.add_argument(
            "--cfg-scale",
            type=finite_float,
            default=guidance,
            help="classifier-free guidance scale (1 = off); default: "
            + (f"{guidance:g}" if guidance is not None else "the model's own, recorded with it"),
        )
        parser.add_argument(
            "--guidance-channels",
            type=positive_int,
            default=None,
            help="guide only the first N channels (3 reproduces the DiT/MoH-DiT papers' FIDs)",
        )
        SamplingSpec.add_placement_arguments(
            parser,
            "guide only the steps at training timesteps FIRST..LAST (e.g. 100 600; 0 999 = every step, as DiT); "
            "see docs/sampling.md",
            "at the steps with training timestep <= LAST, average the prediction over the patch grid's shifts "
            "(fainter patch seams; e.g. 100); off for none"
            + ("; default: the model's own" if guidance is None else "; default: off")
            + " (docs/sampling.md)",
        )

    @staticmethod
    def add_placement_arguments(parser: Any, interval_help: str, averaging_help: str) -> None:
        """``--guidance-interval FIRST LAST`` and ``--grid-averaging LAST|off`` (both default ``None``)."""
        parser.add_argument(
            "--guidance-interval",
            type=non_negative_int,
            nargs=2,
            metavar=("FIRST", "LAST"),
            default=None,
            help=interval_help,
        )
        parser.add_argument(
            "--grid-averaging", type=_grid_averaging_arg, default=None, metavar="LAST", help=averaging_help
        )

    @classmethod
    def from_args(cls, args: Any, recorded: SamplingSpec | None = None, log: bool = True) -> SamplingSpec:
        """The spec the options in ``args`` ask for. The scheduler and steps left open come from ``--protocol``.
        Guidance left open (``--cfg-scale`` unset) comes from the model's ``recorded`` spec (scale, interval,
        channels and grid averaging), else the package's grid guidance at every step; a ``--cfg-scale`` given
        alone guides every step, as DiT, without averaging; ``--guidance-interval``, ``--guidance-channels`` and
        ``--grid-averaging`` (``off`` included) always win. Logs the choice."""
        scheduler, steps = PROTOCOLS[args.protocol]
        interval, averaging, channels = args.guidance_interval, args.grid_averaging, args.guidance_channels
        if args.cfg_scale is not None:
            scale, why = args.cfg_scale, "--cfg-scale"
        elif recorded is not None:
            scale, why = recorded.guidance_scale, "the model's recorded preview guidance"
            interval = recorded.guidance_interval if interval is None else interval
            averaging = recorded.grid_averaging if averaging is None else averaging
            channels = recorded.guidance_channels if channels is None else channels
        else:
            scale, why = GRID_GUIDANCE, "no recorded guidance: the package's grid default"
        spec = cls(
            scheduler=args.scheduler or scheduler,
            num_inference_steps=args.num_steps or steps,
            guidance_scale=scale,
            guidance_interval=interval,
            guidance_channels=channels,
            grid_averaging=None if averaging == GRID_AVERAGING_OFF else averaging,
        )
        if log:
            logger.info("%s (%s)", spec.describe(), why)
        return spec


def _grid_averaging_arg(text: str) -> Any:
    """An argparse type: a training timestep for ``--grid-averaging``, or ``off``."""
    if text.strip().lower() in (GRID_AVERAGING_OFF, "none"):
        return GRID_AVERAGING_OFF
    try:
        return SamplingSpec(grid_averaging=int(text)).grid_averaging
    except ValueError:  # ConfigError is one too
        raise argparse.ArgumentTypeError(
            f"expected a training timestep between 0 and {TRAIN_TIMESTEPS - 1} (e.g. 100), or off; got {text!r}"
        ) from None
