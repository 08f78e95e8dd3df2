"""The table of distillation methods (``distill.method``): how a student learns from its teacher. No torch here, as
in :mod:`moh_dit.objectives.registry`, so that configs and ``--help`` check names before torch loads.

Every method is the ``distill`` objective (:data:`moh_dit.objectives.registry.OBJECTIVES`): a student of the average
velocity over an interval, sampled in one or a few steps, that records its teacher. What differs is the training
target; a method is one class (a subclass of ``moh_dit.objectives.distill.MeanFlowDistill``) and one entry here,
with the ``distill`` keys only it reads (a key of another method set in a config is an error).
docs/objective.md#distillation.
"""

from __future__ import annotations

from dataclasses import dataclass

from moh_dit.errors import ConfigError

__all__ = ["MethodEntry", "METHODS", "DEFAULT_METHOD", "method_entry", "keys_of_other_methods"]


@dataclass(frozen=True)
class MethodEntry:
    """One method: ``module``/``cls`` hold its class; ``keys`` are the ``distill`` keys only this method reads;
    ``summary`` says what it learns, in words; ``fp16``: whether float16 mixed precision is allowed."""

    module: str
    cls: str
    summary: str
    keys: tuple[str, ...] = ()
    fp16: bool = True  # DMD2 diverges in float16 (its authors', FastGen's finding)


TRAJECTORY_KEYS = (
    "trajectories",
    "trajectory_count",
    "trajectory_sampler",
    "trajectory_steps",
    "trajectory_shard_size",
)
# the interval coverage (distill.r_time_*, grid_share, grid_steps) is every method's: it chooses the (t, r) trained
METHODS: dict[str, MethodEntry] = {
    # MeanFlow's identity with the teacher's velocity as the target (NVlabs/FastGen's MeanFlow with use_cd) and the
    # references' stabilisers: tangent warm-up, FastGen's opt_grad loss, a tangent clamp, a flow-matching anchor
    "meanflow": MethodEntry(
        "moh_dit.objectives.distill",
        "MeanFlowDistill",
        "MeanFlow's identity with the teacher's guided velocity as the target (a derivative of the student)",
        (
            "derivative",
            "fd_eps",
            "loss",
            "spatial_invariance",
            "tangent_clamp",
            "tangent_warmup",
            "anchor",
        ),
    ),
    # the teacher's own sampler run from noise, its states kept: the student regresses the secant between two states
    # of one trajectory (CMT, arXiv:2509.24526; flow-map distillation, arXiv:2505.18825): no derivative of the student
    "trajectory": MethodEntry(
        "moh_dit.objectives.trajectory",
        "TrajectoryDistill",
        "the secant between two states of the teacher's own sampling trajectories (no derivative of the student)",
        TRAJECTORY_KEYS,
    ),
    # distribution matching (DMD2, arXiv:2405.14867; FastGen's dmd2.py): a generator against the teacher's score and a
    # fake score trained on its samples, a GAN term and a regression on the teacher's trajectories optional
    "dmd2": MethodEntry(
        "moh_dit.objectives.dmd2",
        "DMD2Distill",
        "a generator matching the teacher's distribution through a fake score (DMD2), one step or a few",
        (
            "fake_updates",
            "fake_lr",
            "gan_weight",
            "gan_block",
            "regression",
            "dmd_steps",
            "dmd_input",
            "dmd_time",
            "real_guidance",
            "vsd_weight",
            "gan_start",
            "dmd_midpoint",
            *TRAJECTORY_KEYS,
        ),
        fp16=False,
    ),
}
DEFAULT_METHOD = "meanflow"  # every student of moh-dit 0.5 and earlier


def method_entry(name: str | None) -> MethodEntry:
    """The entry of method ``name`` (``None``: the default); an unknown name is a :class:`ConfigError` listing the
    known ones."""
    name = DEFAULT_METHOD if name is None else name
    if name not in METHODS:
        raise ConfigError(f"unknown distill.method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def keys_of_other_methods(name: str | None) -> set[str]:
    """The ``distill`` keys that other methods than ``name`` read and this one does not."""
    mine = set(method_entry(name).keys)
    return {key for entry in METHODS.values() for key in entry.keys} - mine
