"""The sampling options of the command lines (``sample.py``, ``evaluate_fid.py``, ``moh-dit ema``, the benchmarks),
and the :class:`~moh_dit.sampling.spec.SamplingSpec` they ask for. Light (no torch import), so that ``--help``
answers at once.

    add_sampling_options(parser, guidance=None, protocol="fast")        # then, with the command's parsed args:
    spec = spec_from_args(args, recorded=recorded_sampling(model), objective=recorded_objective(model))
"""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any

from moh_dit.argtypes import finite_float, non_negative_int, positive_int
from moh_dit.objectives.registry import (
    ALL_PROTOCOLS,
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    check_sampler,
    objective_name,
    resolve_protocol,
    sampling_guidance,
)
from moh_dit.sampling import caches, rules
from moh_dit.sampling.spec import GRID_AVERAGING_OFF, GRID_GUIDANCE, SCHEDULERS, TRAIN_TIMESTEPS, SamplingSpec

__all__ = ["add_sampling_options", "add_placement_options", "spec_from_args"]

logger = logging.getLogger("moh_dit")


def add_sampling_options(parser: Any, guidance: float | None, protocol: str) -> None:
    """The sampling options (``--protocol``, ``--scheduler``, ``--num-steps``, ``--time-shift``, ``--cfg-scale``,
    ``--guidance-channels``, ``--guidance-interval``, ``--guidance-noise``, ``--grid-averaging``) with their names,
    types and choices. ``guidance``: the default scale, or ``None`` for the model's recorded one; ``protocol``: the
    protocol used when ``--protocol`` is not given (see :func:`spec_from_args`)."""
    described = "; ".join(
        f"{objective}: " + ", ".join(f"{name} = {sched} {steps}" for name, (sched, steps) in found.protocols.items())
        for objective, found in OBJECTIVES.items()
    )
    parser.add_argument(
        "--protocol",
        choices=list(ALL_PROTOCOLS),
        default=None,
        help=f"scheduler and steps unless --scheduler/--num-steps say otherwise; paper = the published protocol of "
        f"the model's objective ({described}); default: {protocol}, with a sampler the model offers",
    )
    parser.set_defaults(default_protocol=protocol)
    parser.add_argument(
        "--scheduler", choices=SCHEDULERS, default=None, help="default: the protocol's (it must sample the model)"
    )
    parser.add_argument(
        "--num-steps", type=positive_int, default=None, help="sampling steps (default: the protocol's)"
    )
    parser.add_argument(
        "--time-shift",
        type=finite_float,
        default=None,
        help="flow models: shift the grid toward high noise, s -> S s / (1 + (S - 1) s) (SD3's 3; default: the "
        "model's own, else 1 = none)",
    )
    parser.add_argument(
        "--cfg-scale",
        type=finite_float,
        default=None,
        help="classifier-free guidance scale (1 = off); default: "
        + (f"{guidance:g}" if guidance is not None else "the model's own, recorded with it")
        + " (a MeanFlow model, guided in training: 1)",
    )
    parser.set_defaults(default_guidance=guidance)
    parser.add_argument(
        "--guidance-channels",
        type=positive_int,
        default=None,
        help="guide only the first N channels (3 reproduces the DiT/MoH-DiT/SiT papers' FIDs)",
    )
    add_placement_options(
        parser,
        "guide only the steps at DDPM timesteps FIRST..LAST of DiT's schedule (e.g. 100 600; 0 999 = every step, "
        "as DiT); a flow model at the same noise levels; see docs/sampling.md",
        "at the steps with DDPM timestep <= LAST (a flow model: at the same noise levels), average the prediction "
        "over the patch grid's shifts (fainter patch seams; e.g. 100); off for none"
        + ("; default: the model's own" if guidance is None else "; default: off")
        + " (docs/sampling.md)",
    )
    parser.add_argument(
        "--guidance-rule",
        choices=list(rules.RULES),
        default=None,
        help="how the two predictions mix: "
        + ", ".join(f"{name} ({rule.title})" for name, rule in rules.RULES.items())
        + f"; default {rules.DEFAULT_RULE} (docs/sampling.md#guidance-rules)",
    )
    parser.add_argument(
        "--rule-option",
        type=_rule_option_arg,
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help=f"an option of the rule, repeatable (none: off, where an option may be off): {rules.options_help()} "
        "(defaults in docs/sampling.md)",
    )
    parser.add_argument(
        "--guide-model",
        default=None,
        metavar="PATH",
        help="autoguidance: guide away from this weaker model's conditional prediction (a run, checkpoint, pipeline or "
        "transformer folder of the same data and objective) instead of the unconditional one",
    )
    parser.add_argument(
        "--guide-step", type=positive_int, default=None, help="with --guide-model RUN: its checkpoint at this step"
    )
    parser.add_argument(
        "--guide-sigma-rel",
        type=finite_float,
        default=None,
        help="with --guide-model RUN: an EMA of this relative width rebuilt from its post-hoc snapshots",
    )
    parser.add_argument(
        "--lead-model",
        default=None,
        metavar="PATH",
        help="a hand-off: this model (a run, checkpoint, pipeline or transformer folder sampled by the same scheduler) "
        "takes the grid's first --lead-steps steps and the model the rest, e.g. the first jump of the student a "
        "two-step distilled generator started from (docs/sampling.md#hand-off); none: drop a recorded one",
    )
    parser.add_argument(
        "--lead-steps", type=positive_int, default=None, help="with --lead-model: the steps it takes first (1)"
    )
    parser.add_argument(
        "--cache",
        choices=[*caches.CACHES, "none"],
        default=None,
        help="a diffusers sampling cache that skips part of the network at some steps: "
        + ", ".join(f"{name} ({cache.title})" for name, cache in caches.CACHES.items())
        + "; none: no cache even where the model records one (docs/sampling.md#caches)",
    )
    parser.add_argument(
        "--cache-option",
        type=_rule_option_arg,
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help=f"an option of the cache, repeatable: {caches.options_help()}",
    )
    parser.add_argument(
        "--guidance-noise",
        type=_noise_level_arg,
        nargs=2,
        metavar=("LOW", "HIGH"),
        default=None,
        help="guide only the steps at noise levels LOW..HIGH (noise std over signal std, the same for every "
        "objective; HIGH may be inf), instead of --guidance-interval; e.g. 0.28 5.42",
    )


def add_placement_options(parser: Any, interval_help: str, averaging_help: str) -> None:
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


def spec_from_args(
    args: Any,
    recorded: SamplingSpec | None = None,
    log: bool = True,
    objective: str | dict | None = DEFAULT_OBJECTIVE,
) -> SamplingSpec:
    """The spec the options in ``args`` ask for, for a model of ``objective`` (its name, or the record its config
    holds: the record also says which samplers its path allows). The scheduler and steps left open come from
    ``--protocol`` (resolved for the objective: ``paper`` is its published protocol); a protocol the user did not
    give falls back to a sampler the model offers, one the user gave and the model cannot take is an error. Guidance
    left open (``--cfg-scale`` unset) comes from the model's ``recorded`` spec, else the objective's (MeanFlow, or
    guidance folded into training: 1), else the command's default (``add_sampling_options``' ``guidance``), else the
    package's grid guidance at every step. Each option given overrides its own field of the recorded sampling and
    only that: ``--cfg-scale`` alone keeps the recorded interval or noise range, channels, rule, guide and grid
    averaging; ``--guidance-interval``, ``--guidance-noise``, ``--guidance-channels``, ``--grid-averaging``
    (``off`` included) and ``--time-shift`` replace theirs. A cache (``--cache``, its ``--cache-option`` s) is the model's recorded one unless given
    (``none``: no cache); so is a hand-off's lead (``--lead-model``, ``--lead-steps``; ``none``: none). Logs the choice. ``objective=None`` checks the options before the model is known (a
    protocol of any objective); with an objective, a scheduler it does not offer is a :class:`ConfigError`."""
    given = getattr(args, "protocol", None) is not None
    protocol = args.protocol if given else getattr(args, "default_protocol", "fast")
    name = None
    if objective is None:
        owners = [o for o, e in OBJECTIVES.items() if protocol in e.protocols]
        scheduler, steps = resolve_protocol(protocol, owners[0] if owners else DEFAULT_OBJECTIVE)
    else:
        record = objective if isinstance(objective, dict) else {"name": objective}
        name = objective_name(record)
        scheduler, steps = resolve_protocol(protocol, name, record, given=given and args.scheduler is None)
        if args.scheduler is not None:
            check_sampler(args.scheduler, name, record)
    interval, averaging, channels = args.guidance_interval, args.grid_averaging, args.guidance_channels
    noise = getattr(args, "guidance_noise", None)
    shift = getattr(args, "time_shift", None)
    if shift is None:
        shift = recorded.sampler.time_shift if recorded is not None else 1.0
    placed = interval is not None or noise is not None  # a placement given wins over the recorded one
    rule, options = getattr(args, "guidance_rule", None), dict(getattr(args, "rule_option", None) or [])
    cache, cache_options = getattr(args, "cache", None), dict(getattr(args, "cache_option", None) or [])
    if cache is None and recorded is not None and recorded.cache is not None:  # the model's own cache, options added
        cache, cache_options = recorded.cache.name, recorded.cache.settings | cache_options
    cache = None if cache == "none" else cache
    lead = dict(lead_model=getattr(args, "lead_model", None), lead_steps=getattr(args, "lead_steps", None))
    if lead["lead_model"] is None and recorded is not None and recorded.lead is not None:  # the model's own hand-off
        lead = dict(lead_model=recorded.lead.model, lead_steps=lead["lead_steps"] or recorded.lead.steps)
    lead["lead_model"] = None if lead["lead_model"] == "none" else lead["lead_model"]
    guide = dict(guide=getattr(args, "guide_model", None), guide_step=getattr(args, "guide_step", None))
    guide["guide_sigma_rel"] = getattr(args, "guide_sigma_rel", None)
    # a model whose objective guides in training (MeanFlow), or that was trained with folded guidance, samples
    # unguided unless asked
    own = sampling_guidance(name, record) if name is not None else None
    if args.cfg_scale is not None:
        scale, why = args.cfg_scale, "--cfg-scale"
    elif recorded is None and own is not None:
        scale, why = own, "the objective's: guided in training"
    elif recorded is None and getattr(args, "default_guidance", None) is not None:
        scale, why = args.default_guidance, "the command's default"
    elif recorded is not None:
        scale, why = recorded.guidance.scale, "the model's recorded preview guidance"
    else:
        scale, why = GRID_GUIDANCE, "no recorded guidance: the package's grid default"
    if recorded is not None:  # each option given overrides its own field of the recorded sampling, and only that
        if not placed:
            interval, noise = recorded.guidance.interval, recorded.guidance.noise
        averaging = recorded.sampler.grid_averaging if averaging is None else averaging
        channels = recorded.guidance.channels if channels is None else channels
        if rule is None:
            rule, options = recorded.guidance.rule, recorded.guidance.options | options
        if guide["guide"] is None and recorded.guide is not None:
            guide = dict(
                guide=recorded.guide.model, guide_step=recorded.guide.step, guide_sigma_rel=recorded.guide.sigma_rel
            )
    spec = SamplingSpec.create(
        scheduler=args.scheduler or scheduler,
        num_inference_steps=args.num_steps or steps,
        guidance_scale=scale,
        guidance_interval=interval,
        guidance_channels=channels,
        grid_averaging=None if averaging == GRID_AVERAGING_OFF else averaging,
        guidance_noise=noise,
        time_shift=shift,
        guidance_rule=rule or "cfg",
        rule_options=options,
        cache=cache,
        cache_options=cache_options or None,
        **guide,
        **lead,
    )
    if log:
        logger.info("%s (%s)", spec.describe(), why)
        if own is not None and args.cfg_scale is not None and args.cfg_scale != 1.0:  # said once, where it is chosen
            logger.warning(
                "this model has guidance folded into its training (it samples at scale 1): --cfg-scale %g guides it "
                "again on top, at two network evaluations per step where it applies",
                args.cfg_scale,
            )
    return spec


def _rule_option_arg(text: str) -> tuple[str, float | None]:
    """An argparse type: ``KEY=VALUE`` with a number (or ``none``) as the value (a rule's or a cache's option)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. eta=0), got {text!r}")
    if value.strip().lower() == "none":
        return key.strip(), None
    try:
        return key.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the value of {key} must be a number or none, got {value!r}") from None


def _noise_level_arg(text: str) -> float:
    """An argparse type: a noise level >= 0, or ``inf``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a noise level >= 0 (or inf), got {text!r}")
    return value


def _grid_averaging_arg(text: str) -> Any:
    """An argparse type: a training timestep for ``--grid-averaging``, or ``off``."""
    if text.strip().lower() in (GRID_AVERAGING_OFF, "none"):
        return GRID_AVERAGING_OFF
    try:
        return SamplingSpec.create(grid_averaging=int(text)).sampler.grid_averaging
    except ValueError:  # ConfigError is one too
        raise argparse.ArgumentTypeError(
            f"expected a training timestep between 0 and {TRAIN_TIMESTEPS - 1} (e.g. 100), or off; got {text!r}"
        ) from None
