"""The table of objectives: where each lives, the samplers it offers, and its named sampling protocols. No torch
here: ``--help``, argument choices and :class:`moh_dit.sampling.spec.SamplingSpec` read it before torch loads.

Adding an objective is one module with a subclass of :class:`moh_dit.objectives.base.Objective` and one entry in
:data:`OBJECTIVES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moh_dit.errors import ConfigError
from moh_dit.objectives.distill.methods import DEFAULT_METHOD, METHODS, PROVENANCE_KEYS, STUDENT_KEYS

__all__ = [
    "ObjectiveEntry",
    "OBJECTIVES",
    "DEFAULT_OBJECTIVE",
    "ALL_SAMPLERS",
    "ALL_PROTOCOLS",
    "PAPER_PROTOCOL",
    "entry",
    "objective_name",
    "resolve_protocol",
    "objectives_of_sampler",
    "check_sampler",
    "offered_samplers",
    "LOSS_NAMES",
    "sampling_guidance",
]


@dataclass(frozen=True)
class ObjectiveEntry:
    """One objective: ``module``/``cls`` hold it; ``samplers`` are the scheduler names it can sample with;
    ``protocols`` name (scheduler, steps) settings; ``paper`` is the protocol of the published numbers.
    ``record_keys`` are the training config's keys (``section.key``) that go into the model's record (what the
    weights are: the path, the network's conventions); ``training_keys`` those that only shape training (loss
    weighting, time sampling). A key of another objective set in a config is an error. ``sampler_limits`` narrows
    the samplers by what a model records: ``{record key: {value: samplers that apply}}``."""

    module: str
    cls: str
    samplers: tuple[str, ...]
    protocols: dict[str, tuple[str, int]] = field(default_factory=dict)
    paper: str = "fast"
    summary: str = ""
    record_keys: tuple[str, ...] = ()
    training_keys: tuple[str, ...] = ()
    sampler_limits: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    sampler_limits_why: str = ""
    loss_name: str = "loss"  # the objective's loss in logs and metrics.jsonl
    # the guidance scale a model of this objective samples with where nobody chose one (None: the command's default,
    # CFG 4 for grids, 1.5 for evaluations); MeanFlow's guidance is folded into training: 1
    sampling_guidance: float | None = None
    # an objective of several classes (a distillation's methods): the record key that names the class, the table of
    # its classes (each with ``module`` and ``cls``: moh_dit.objectives.distill.methods.METHODS) and its default
    variant_key: str | None = None
    variants: dict[str, Any] = field(default_factory=dict)
    default_variant: str | None = None
    # config sections beyond ``objective`` that configure it (a distillation's ``distill``), and of their keys those
    # that are what a model *is* or where something came from (its variants add their own ``identity`` and
    # ``provenance``): the others are how it trains, which a resume may change (logged and recorded)
    sections: tuple[str, ...] = ()
    fixed_keys: tuple[str, ...] = ()

    def not_settings(self, record: dict[str, Any] | None) -> set[str]:
        """The keys of :attr:`sections` that are no setting of a model of ``record``: what it is, where things came
        from, and the keys only other variants read."""
        keys = set(self.fixed_keys)
        if self.variant_key is not None:
            chosen = self._variant_name(record)
            mine = self.variants[chosen]
            keys |= {*mine.identity, *mine.provenance}
            keys |= {k for name, v in self.variants.items() if name != chosen for k in v.keys} - set(mine.keys)
        return keys

    def variant(self, record: dict[str, Any] | None) -> tuple[str, str]:
        """``(module, class)`` of a model of this objective with ``record`` (the variant it names, else the
        default)."""
        if self.variant_key is None:
            return self.module, self.cls
        chosen = self._variant_name(record)
        return self.variants[chosen].module, self.variants[chosen].cls

    def _variant_name(self, record: dict[str, Any] | None) -> str:
        chosen = (record or {}).get(self.variant_key) or self.default_variant
        if chosen not in self.variants:
            raise ConfigError(
                f"unknown {self.variant_key} {chosen!r} of the {self.cls} objective; choose one of "
                f"{', '.join(self.variants)}"
            )
        return chosen

    def training_keys_of(self, record: dict[str, Any] | None) -> tuple[str, ...]:
        """The training keys a model of ``record`` is trained with: all of them, less those only other variants
        read (each variant's ``keys``, in the section of its ``variant_key``)."""
        if self.variant_key is None:
            return self.training_keys
        section = next(d.split(".")[0] for d in self.record_keys if d.split(".")[1] == self.variant_key)
        chosen = self._variant_name(record)
        mine = {f"{section}.{key}" for key in self.variants[chosen].keys}
        others = {f"{section}.{key}" for variant in self.variants.values() for key in variant.keys} - mine
        return tuple(key for key in self.training_keys if key not in others)


# guidance folded into training (moh_dit.objectives.folded_guidance): what the model records, what shapes training
FOLDED_RECORD = ("objective.guidance_scale", "objective.guidance_mix", "objective.guidance_times")
FOLDED_TRAINING = ("objective.guidance_warmup", "objective.guidance_source")

# a distillation's training keys (the interval coverage every method reads, then each method's own: distill_methods)
DISTILL_TRAINING_KEYS = (
    "r_time_sampling",
    "r_time_mean",
    "r_time_std",
    "grid_share",
    "grid_steps",
    *dict.fromkeys(key for method in METHODS.values() for key in method.keys),
)

OBJECTIVES: dict[str, ObjectiveEntry] = {
    # DiT's: noise prediction with a learned variance on DiT's 1000-step schedule. "dit" is DiT's FID protocol
    # (DDPM, 250 steps); "fast" the sampler study's choice (benchmarks/results/v7/samplers_cpu.md).
    "ddpm": ObjectiveEntry(
        "moh_dit.objectives.ddpm",
        "DDPM",
        ("ddpm", "ddim", "dpm-solver", "dpm-solver-sde", "unipc"),
        {"dit": ("ddpm", 250), "fast": ("dpm-solver", 25)},
        paper="dit",
        summary="DiT's DDPM: noise prediction, learned variance, 1000 steps",
        record_keys=FOLDED_RECORD,
        training_keys=("train.snr_gamma", *FOLDED_TRAINING),
        loss_name="diffusion_loss",
    ),
    # SiT's: velocity along a straight (or cosine) path from data to noise. "sit-sde" is SiT's FID protocol
    # (Euler-Maruyama, 250 steps, noise-free last step); "sit-ode" the fixed-step ODE of REPA's sampler (Heun,
    # 50 steps; SiT's own ODE protocol is adaptive dopri5); "fast" DPM-Solver++ 25 steps in flow mode, as for DDPM
    # (on the Fashion-MNIST flow twin Euler's 25 steps scored as well, within one seed's intervals:
    # docs/results.md#ddpm-against-flow-matching).
    "flow": ObjectiveEntry(
        "moh_dit.objectives.flow",
        "Flow",
        ("euler", "heun", "dpm-solver", "unipc", "sde"),
        # "lightningdit": LightningDiT's Euler over 250 grid points, 249 steps (its time shift and guidance are
        # recorded with a converted checkpoint: moh_dit.interop.sit.own_sampling)
        {"sit-sde": ("sde", 250), "sit-ode": ("heun", 50), "fast": ("dpm-solver", 25), "lightningdit": ("euler", 249)},
        paper="sit-sde",
        summary="flow matching (SiT): velocity (or x) prediction on a linear or GVP path",
        record_keys=("objective.path", "objective.convention", "objective.prediction", *FOLDED_RECORD),
        training_keys=(
            "objective.time_sampling",
            "objective.time_mean",
            "objective.time_std",
            "objective.cosine_loss",
            *FOLDED_TRAINING,
        ),
        sampler_limits={"path": {"gvp": ("euler", "heun", "sde")}},
        sampler_limits_why="DPM-Solver++ and UniPC take x0 = x - s v, which holds on the linear path only",
        loss_name="flow_loss",
    ),
    # MeanFlow (Geng et al. 2025): the average velocity over an interval, sampled in one step or a few. "one-step"
    # is the paper's headline protocol (1 evaluation), "two-step" its best (2 evaluations, the grid 1 -> 0.5 -> 0).
    # Guidance is part of training (recorded), so its models sample unguided unless asked.
    "meanflow": ObjectiveEntry(
        "moh_dit.objectives.meanflow",
        "MeanFlow",
        ("meanflow",),
        {"one-step": ("meanflow", 1), "two-step": ("meanflow", 2), "fast": ("meanflow", 1)},
        paper="one-step",
        summary="MeanFlow: average-velocity prediction, one or a few sampling steps",
        record_keys=FOLDED_RECORD,
        training_keys=(
            "objective.time_sampling",
            "objective.time_mean",
            "objective.time_std",
            "objective.equal_times",
            "objective.adaptive_power",
            "objective.adaptive_eps",
            "objective.jvp_autocast",
            *FOLDED_TRAINING,
        ),
        loss_name="meanflow_loss",
        sampling_guidance=1.0,
    ),
    # MeanFlow distilled from a trained model of any objective (moh_dit.objectives.distill): the teacher's velocity as
    # the target, its guidance folded in; sampled as MeanFlow, in one step or a few ("four-step": DMF's best numbers).
    "distill": ObjectiveEntry(
        "moh_dit.objectives.distill",
        "MeanFlowDistill",
        ("meanflow",),
        {
            "one-step": ("meanflow", 1),
            "two-step": ("meanflow", 2),
            "four-step": ("meanflow", 4),
            "fast": ("meanflow", 1),
        },
        paper="one-step",
        summary="a student distilled from a trained model (by its velocity, trajectories or distribution, its guidance "
        "folded in): one or a few steps",
        record_keys=("distill.end_time_blocks", "distill.method"),
        training_keys=(
            "objective.time_sampling",
            "objective.time_mean",
            "objective.time_std",
            "objective.equal_times",
            "objective.adaptive_power",
            "objective.adaptive_eps",
            "objective.jvp_autocast",
            *(f"distill.{key}" for key in DISTILL_TRAINING_KEYS),
        ),
        loss_name="distill_loss",
        sampling_guidance=1.0,
        variant_key="method",
        variants=METHODS,
        default_variant=DEFAULT_METHOD,
        sections=("distill",),
        fixed_keys=(*STUDENT_KEYS, *PROVENANCE_KEYS),
    ),
}
DEFAULT_OBJECTIVE = "ddpm"  # a model or run that records none: every model of moh-dit 0.3 and earlier
PAPER_PROTOCOL = "paper"  # the protocol of the published numbers of the model's objective (dit, sit-sde, one-step)
ALL_SAMPLERS = tuple(dict.fromkeys(s for e in OBJECTIVES.values() for s in e.samplers))
# every objective's loss key in metrics.jsonl (runs of moh-dit 0.4 and earlier logged every objective's as the first)
LOSS_NAMES = tuple(dict.fromkeys(["diffusion_loss", *(e.loss_name for e in OBJECTIVES.values())]))
ALL_PROTOCOLS = (PAPER_PROTOCOL, *dict.fromkeys(p for e in OBJECTIVES.values() for p in e.protocols))


def entry(name: str) -> ObjectiveEntry:
    """The table entry of objective ``name``; an unknown name is a :class:`ConfigError` listing the known ones."""
    if name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def objective_name(record: dict[str, Any] | None) -> str:
    """The objective a record names (``None`` or a record without a name: DDPM)."""
    name = (record or {}).get("name", DEFAULT_OBJECTIVE)
    entry(name)
    return name


def objectives_of_sampler(sampler: str) -> list[str]:
    """The objectives that offer ``sampler``."""
    return [name for name, e in OBJECTIVES.items() if sampler in e.samplers]


def offered_samplers(objective: str, record: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The samplers of ``objective`` that apply to a model of that ``record`` (its path, ...: ``sampler_limits``)."""
    found = entry(objective)
    offered = found.samplers
    for key, limits in found.sampler_limits.items():
        allowed = limits.get((record or {}).get(key))
        if allowed is not None:
            offered = tuple(s for s in offered if s in allowed)
    return offered


def resolve_protocol(
    protocol: str, objective: str, record: dict[str, Any] | None = None, given: bool = True
) -> tuple[str, int]:
    """``(scheduler, steps)`` of a named protocol for a model of ``objective``; ``paper`` is the objective's own.
    A protocol another objective defines is a :class:`ConfigError` that names this objective's protocols. Where the
    model's ``record`` rules out the protocol's sampler (DPM-Solver++ on the GVP path), a protocol the user
    ``given`` is a :class:`ConfigError`, and a default one takes the first sampler that applies, at the same steps."""
    found = entry(objective)
    name = found.paper if protocol == PAPER_PROTOCOL else protocol
    if name not in found.protocols:
        others = [o for o, e in OBJECTIVES.items() if name in e.protocols]
        owner = f" is a protocol of {', '.join(others)} models" if others else " is not a protocol"
        raise ConfigError(
            f"{name!r}{owner}; this is a {objective} model: choose one of "
            f"{', '.join([PAPER_PROTOCOL, *found.protocols])} (paper = {found.paper})"
        )
    scheduler, steps = found.protocols[name]
    offered = offered_samplers(objective, record)
    if scheduler in offered:
        return scheduler, steps
    if given:
        check_sampler(scheduler, objective, record)
    return offered[0], steps


def check_sampler(sampler: str, objective: str, record: dict[str, Any] | None = None) -> None:
    """A scheduler name the model's objective (and its ``record``: the path, ...) does not offer is a
    :class:`ConfigError` that says what it does."""
    found = entry(objective)
    if sampler not in found.samplers:
        owners = objectives_of_sampler(sampler)
        what = f"samples {' and '.join(owners)} models" if owners else "is not a sampler"
        raise ConfigError(
            f"scheduler {sampler!r} {what}; this is a {objective} model ({found.summary}): choose one of "
            f"{', '.join(found.samplers)}"
        )
    offered = offered_samplers(objective, record)
    if sampler not in offered:
        where = ", ".join(f"{key}={record.get(key)}" for key in found.sampler_limits if key in (record or {}))
        raise ConfigError(
            f"scheduler {sampler!r} does not apply to this {objective} model ({where}; {found.sampler_limits_why}): "
            f"choose one of {', '.join(offered)}"
        )


def sampling_guidance(name: str, record: dict[str, Any] | None = None) -> float | None:
    """The guidance scale a model samples with where nobody chose one: its objective's (MeanFlow: 1), or 1 for a model
    trained with guidance folded in (a record with ``guidance_scale`` != 1 or ``guidance_mix`` > 0); ``None``: the
    command's default."""
    own = entry(name).sampling_guidance
    record = record or {}
    folded = record.get("guidance_scale", 1.0) != 1.0 or record.get("guidance_mix", 0.0) > 0
    return own if own is not None else (1.0 if folded else None)
