"""The table of distillation methods (``distill.method``): how a student learns from its teacher. No torch here, as
in :mod:`moh_dit.objectives.registry`, so that configs and ``--help`` check names before torch loads.

Every method is the ``distill`` objective (:data:`moh_dit.objectives.registry.OBJECTIVES`): a student of the average
velocity over an interval, sampled in one or a few steps, that records its teacher. What differs is the training
target; a method is one class (a subclass of ``moh_dit.objectives.distill.MeanFlowDistill``) and one entry here,
with the ``distill`` keys only it reads (a key of another method set in a config is an error).
docs/objective.md#distillation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moh_dit.errors import ConfigError

__all__ = [
    "MethodEntry",
    "METHODS",
    "DEFAULT_METHOD",
    "STUDENT_KEYS",
    "PROVENANCE_KEYS",
    "method_entry",
    "keys_of_other_methods",
    "identity_keys",
    "user_key",
]


@dataclass(frozen=True)
class MethodEntry:
    """One method: ``module``/``cls`` hold its class; ``keys`` are the ``distill`` keys only this method reads;
    ``summary`` says what it learns, in words; ``fp16``: whether float16 mixed precision is allowed. Of its keys,
    ``identity`` are what its student *is* (its target, its sampling grid: a resume that changes one is refused);
    ``provenance`` where something was loaded from (neither compared nor logged); the others say how it *trains* (a
    resume may change them: the change is logged and recorded in the run's manifest)."""

    module: str
    cls: str
    summary: str
    keys: tuple[str, ...] = ()
    fp16: bool = True  # DMD2 diverges in float16 (its authors', FastGen's finding)
    identity: tuple[str, ...] = ()
    provenance: tuple[str, ...] = ()


TRAJECTORY_KEYS = (
    "trajectories",
    "trajectory_count",
    "trajectory_sampler",
    "trajectory_steps",
    "trajectory_shard_size",
)
# the set of trajectories a student learns from is what it learns (its count, sampler and steps); where it is stored
# and in how many files is not
TRAJECTORY_IDENTITY = ("trajectory_count", "trajectory_sampler", "trajectory_steps")
# distribution matching's keys, DMD2's and rCM's alike: the fake score's rate, the GAN term, the grids and the VSD term
DMD_KEYS = ("fake_lr", "gan_weight", "gan_block", "gan_start", "dmd_steps", "dmd_input", "dmd_time", "real_guidance",
            "dmd_time_sampling", "vsd_weight", "dmd_midpoint", "gan_time", "real_guidance_later", "dmd_first_share",
            "real_guidance_end", "real_guidance_ramp", "fake_guidance", "fake_guidance_eval", "lead_model")  # fmt: skip
# DMD's regression on the teacher's trajectories (moh_dit/objectives/distill/regression.py): its weight, distance, start
REGRESSION_KEYS = ("regression", "regression_distance", "regression_feature_time", "regression_from")
# the real score's guidance is folded into what the generator learns, and the fake score's guidance into what it
# learns against; the grid's middle is how it samples
DMD_IDENTITY = ("real_guidance", "dmd_midpoint", "real_guidance_later", "real_guidance_end", "real_guidance_ramp",
                "fake_guidance", "fake_guidance_eval")  # fmt: skip
TRAJECTORY_PROVENANCE = ("trajectories", "trajectory_shard_size")
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
        "moh_dit.objectives.distill",
        "TrajectoryDistill",
        "the secant between two states of the teacher's own sampling trajectories (no derivative of the student)",
        TRAJECTORY_KEYS,
        identity=TRAJECTORY_IDENTITY,
        provenance=TRAJECTORY_PROVENANCE,
    ),
    # distribution matching (DMD2, arXiv:2405.14867; FastGen's dmd2.py): a generator against the teacher's score and a
    # fake score trained on its samples, a GAN term and a regression on the teacher's trajectories optional
    "dmd2": MethodEntry(
        "moh_dit.objectives.distill",
        "DMD2Distill",
        "a generator matching the teacher's distribution through a fake score (DMD2), one step or a few",
        ("fake_updates", "vsd_divergence", *REGRESSION_KEYS, *DMD_KEYS, *TRAJECTORY_KEYS),
        fp16=False,
        identity=(*DMD_IDENTITY, *TRAJECTORY_IDENTITY),
        provenance=(*TRAJECTORY_PROVENANCE, "lead_model"),  # the lead's weights are in the run's frozen models
    ),
    # trajectory distillation regularised by DMD2 in one run (rCM, arXiv:2510.08431): the secants' loss plus a weighted
    # VSD of the student's samples, the fake score on 1 of every student_updates + 1 steps
    "rcm": MethodEntry(
        "moh_dit.objectives.distill",
        "RCMDistill",
        "a flow map on the teacher's trajectories, regularised by DMD2's distribution matching in the same run (rCM)",
        ("student_updates", "vsd_start", *DMD_KEYS, *TRAJECTORY_KEYS),
        fp16=False,
        identity=(*DMD_IDENTITY, *TRAJECTORY_IDENTITY),
        provenance=TRAJECTORY_PROVENANCE,
    ),
    # consistency post-training with a small fixed step (CMT's second stage, arXiv:2509.24526; ECT, arXiv:2406.14548):
    # the student's jump from z_t against its own jump from one step further down the trajectory (no derivative)
    "ect": MethodEntry(
        "moh_dit.objectives.distill",
        "ECTDistill",
        "a flow map post-trained by consistency: its jump against its own from a small fixed step down the trajectory",
        ("ect_dt", "ect_step", "ect_dt_start", "ect_dt_every"),
    ),
}
# score identity distillation (SiD, arXiv:2404.04057; mingyuanzhou/SiD): DMD2's entry (its generator, fake score, grids,
# GAN term and keys) with the generator's loss an estimate of the Fisher divergence, differentiated through both
# scores, instead of VSD, and its alpha (not VSD's divergence: f-distill's weights are derived for VSD's gradient)
METHODS["sid"] = dataclasses.replace(
    METHODS["dmd2"],
    cls="SiDDistill",
    summary="a generator matching the teacher's distribution by SiD's score-identity loss through a fake score",
    keys=("sid_alpha", *(key for key in METHODS["dmd2"].keys if key != "vsd_divergence")),
)
# every method's: what the student is (its method, architecture, time split, head, and the teacher's guidance folded
# into its target; the teacher itself by its weights, in the run's frozen models) and where things came from (the
# teacher's and the guide's paths and formats, the student it started from: read at step 0 only)
STUDENT_KEYS = ("method", "student", "end_time_blocks", "head", "noise_until", "guidance_scale", "guidance_times")
PROVENANCE_KEYS = (
    "teacher",
    "teacher_format",
    "teacher_path",
    "teacher_num_heads",
    "guide",
    "guide_step",
    "guide_sigma_rel",
    "student_from",
)
# where the run's identity holds what a distill key sets (the model's objective record, the teacher beside it), for
# messages in the user's words
_IDENTITY_PATHS = {
    "model.objective.method": "distill.method",
    "model.objective.head": "distill.head",
    "model.objective.noise_until": "distill.noise_until",
    "model.objective.end_time_blocks": "distill.end_time_blocks",
    "model.end_time_blocks": "distill.end_time_blocks",
    "model.objective.real_guidance": "distill.real_guidance",
    "model.objective.real_guidance_later": "distill.real_guidance_later",
    "model.objective.real_guidance_end": "distill.real_guidance_end",
    "model.objective.real_guidance_ramp": "distill.real_guidance_ramp",
    "model.objective.fake_guidance": "distill.fake_guidance",
    "model.objective.fake_guidance_eval": "distill.fake_guidance_eval",
    "model.objective.dmd_midpoint": "distill.dmd_midpoint",
    "model.objective.guidance.scale": "distill.guidance_scale",
    "model.objective.guidance.times": "distill.guidance_times",
    "model.objective.guidance.guide": "distill.guide (its weights)",
    "model.objective.teacher.sha256": "distill.teacher (its weights)",
    "frozen.teacher.sha256": "distill.teacher (its weights)",
    "frozen.lead.sha256": "distill.lead_model (its weights)",
    "frozen.teacher.guidance.scale": "distill.guidance_scale",
    "frozen.teacher.guidance.times": "distill.guidance_times",
    "frozen.teacher.guidance.guide": "distill.guide (its weights)",
}
DEFAULT_METHOD = "meanflow"  # every student of moh-dit 0.5 and earlier


def method_entry(name: str | None) -> MethodEntry:
    """The entry of method ``name`` (``None``: the default); an unknown name is a :class:`ConfigError` listing the
    known ones."""
    name = DEFAULT_METHOD if name is None else name
    if name not in METHODS:
        raise ConfigError(f"unknown distill.method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def identity_keys(name: str | None) -> tuple[str, ...]:
    """The ``distill`` keys that are what a student of method ``name`` is, and those that say where things came
    from: neither is a setting a resume may change (the first is refused through the run's identity)."""
    entry = method_entry(name)
    return (*STUDENT_KEYS, *PROVENANCE_KEYS, *entry.identity, *entry.provenance)


def user_key(path: str) -> str:
    """The config key a path of the run's identity holds (``model.objective.guidance.scale`` ->
    ``distill.guidance_scale``), or the path itself."""
    return _IDENTITY_PATHS.get(path, path)


def keys_of_other_methods(name: str | None) -> set[str]:
    """The ``distill`` keys that other methods than ``name`` read and this one does not."""
    mine = set(method_entry(name).keys)
    return {key for entry in METHODS.values() for key in entry.keys} - mine
