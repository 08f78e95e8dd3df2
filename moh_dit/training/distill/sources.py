"""Where a trajectory distillation's trajectories come from (``distill.trajectories``): drawn online, a set the run
records into its own folder, or a set recorded before; and the plan of a set from a config and a teacher
(moh_dit/training/distill/trajectories.py has the sets themselves)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moh_dit.errors import ConfigError
from moh_dit.objectives.distill import generator_grids, sampler_intervals
from moh_dit.training.distill.trajectories import (
    FALLBACK_SAMPLER,
    MANIFEST,
    NOISE_STREAM,
    TRAJECTORY_SAMPLERS,
    OnlineTrajectories,
    StoredTrajectories,
    TrajectoryPlan,
    record_trajectories,
    trajectory_grid,
)

if TYPE_CHECKING:
    from moh_dit.data.training_data import TrainingData
    from moh_dit.training.config_sections import Config, DistillSection
    from moh_dit.training.distill.teacher import Teacher
    from moh_dit.training.frozen import FrozenModel

__all__ = ["ONLINE", "RUN_FOLDER", "plan_of", "trajectory_source", "teacher_velocity", "record_set", "warn_of_seed"]

logger = logging.getLogger("moh_dit.train")

ONLINE = "online"
RUN_FOLDER = "trajectories"  # a run's own set, inside its folder
DEFAULT_STEPS = 25  # a teacher that records no protocol (a checkpoint file): the fast protocols' 25


def plan_of(section: DistillSection, teacher: Teacher, seed: int) -> TrajectoryPlan:
    """The set ``section`` asks of ``teacher``: its recorded sampler where it takes a grid of times (else UniPC, a
    multistep solver of one evaluation per step as DPM-Solver++ is) and its recorded steps, unless the config names
    them; the grid with the student's sampling times; the teacher's label dropout as the unconditional share."""
    config = teacher.model.config
    if not config.num_classes:
        raise ConfigError("trajectory distillation draws class-conditional trajectories: the teacher has no classes")
    recorded_sampler, recorded_steps = teacher.sampling or (None, None)
    sampler = section.trajectory_sampler or (
        recorded_sampler if recorded_sampler in TRAJECTORY_SAMPLERS else FALLBACK_SAMPLER
    )
    steps = section.trajectory_steps or recorded_steps or DEFAULT_STEPS
    null = teacher.model.null_class_id
    return TrajectoryPlan(
        teacher=teacher.computes(),
        sampler=sampler,
        steps=steps,
        grid=trajectory_grid(steps, tuple(section.grid_steps), tuple(regression_times(section))),
        count=section.trajectory_count,
        shard_size=section.trajectory_shard_size,
        seed=seed,
        null_share=float(config.class_dropout_prob) if null is not None else 0.0,
        null_id=null,
        num_classes=config.num_classes,
        shape=[config.in_channels, config.sample_size, config.sample_size],
        noise_stream=NOISE_STREAM,  # apart from the evaluation images' noises at the run's seed
    )


def regression_times(section: DistillSection) -> list[float]:
    """The times below 1 DMD's regression starts from (``distill.regression_from: start``: the generator's grids'
    later start times), which its set of trajectories must hold."""
    if not section.regression or section.regression_from != "start":
        return []
    grids = generator_grids(tuple(section.dmd_steps), section.dmd_midpoint)
    return sorted({t for grid in grids.values() for t in grid if t < 1}, reverse=True)


def teacher_velocity(teacher: Teacher, precision: str, device: torch.device):
    """The teacher's guided velocity ``(z, t, labels)`` as a sampler calls it, in the run's precision."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def autocast():
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    def velocity(z: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return teacher.velocity(z, t, labels, None, autocast)

    return velocity


def record_set(folder: Path, plan: TrajectoryPlan, teacher: Teacher, precision: str, device: torch.device) -> dict:
    """Record (or finish) ``plan`` into ``folder`` on every process of the run (accelerate's state)."""
    from accelerate import PartialState

    state = PartialState()
    logger.info(
        "recording %d trajectories of the teacher into %s (%s, %d steps, their states kept at %d times: the steps' "
        "and the student's sampling times; %d process(es))",
        plan.count, folder, plan.sampler, plan.steps, len(plan.grid), state.num_processes,
    )  # fmt: skip
    return record_trajectories(
        folder,
        plan,
        teacher_velocity(teacher, precision, device),
        lambda: teacher.evaluations,
        device,
        state.process_index,
        state.num_processes,
        state.wait_for_everyone,
    )


def warn_of_seed(stored: StoredTrajectories, seed: int) -> None:
    """What a set's seed shares with a run at ``seed``: recorded at another seed, the teacher's samples (runs of
    several seeds on one set are not independent); at this seed from sampling's own image noises (a set recorded
    before the noise had a stream of its own), the inputs its evaluations during training score."""
    folder, recorded = stored.folder, stored.plan.seed
    if recorded != seed:
        logger.warning(
            "%s was recorded at seed %d, this run's train.seed is %d: it trains on that set's trajectories (runs of "
            "several seeds on one set share the teacher's samples, so they are not independent seeds)",
            folder, recorded, seed,
        )  # fmt: skip
    elif "noise_stream" not in stored.manifest["plan"]:
        logger.warning(
            "%s was recorded from sampling's own image noises at seed %s: the evaluations during training at that "
            "seed score inputs it holds (record a set afresh to keep them apart)",
            folder, recorded,
        )  # fmt: skip


def trajectory_source(config: Config, data: TrainingData, teacher: Teacher, device: torch.device) -> FrozenModel:
    """The run's trajectories (``distill.trajectories``): ``online``; unset, the set recorded into the run's folder
    (recorded now, or finished where a stopped run left it); else the folder's finished set, refused when it is
    another teacher's."""
    section = config.distill
    plan = plan_of(section, teacher, config.train.seed)
    precision = config.train.mixed_precision
    if section.trajectories == ONLINE:
        return OnlineTrajectories(plan, teacher_velocity(teacher, precision, device))
    if section.trajectories is None:
        folder = Path(config.train.output_dir) / RUN_FOLDER
        record_set(folder, plan, teacher, precision, device)
    else:
        folder = Path(section.trajectories)
        if not (folder / MANIFEST).is_file():
            raise ConfigError(
                f"distill.trajectories={folder}: no set of trajectories there; record one with moh-dit trajectories "
                f"--config <this run's config> distill.teacher={section.teacher} --out {folder}, or leave "
                f"distill.trajectories unset (the run records its own)"
            )
    stored = StoredTrajectories(folder, plan.teacher)
    warn_of_seed(stored, plan.seed)
    wanted = sorted({t for interval in sampler_intervals(tuple(section.grid_steps)) for t in interval}, reverse=True)
    sampling = f"the student's sampling times (distill.grid_steps={list(section.grid_steps)})"
    regression = "the regression's start times (distill.regression_from=start)"
    for times, why in ((wanted, sampling), (regression_times(section), regression)):
        missing = [t for t in times if not any(abs(t - s) < 1e-9 for s in stored.plan.grid)]
        if missing:
            raise ConfigError(f"{folder}'s trajectories have no state at {why}: {missing}; record a set with them")
    return stored
