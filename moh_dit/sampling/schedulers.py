"""Sampling schedulers for DiT's training schedule, by name (diffusers' schedulers, configured)."""

from __future__ import annotations

from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    UniPCMultistepScheduler,
)
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from moh_dit.diffusion import DIT_SCHEDULE
from moh_dit.sampling.spec import SCHEDULERS

__all__ = ["make_scheduler", "scheduler_name"]


def make_scheduler(name: str = "ddpm", learn_sigma: bool = True) -> SchedulerMixin:
    """Sampling schedulers for DiT's training schedule.

    ``ddpm`` is DiT's protocol: ancestral sampling with the learned variance on linspace-respaced steps.
    The others use only the noise prediction: ``ddim`` (eta 0), ``dpm-solver`` (DPM-Solver++ 2M),
    ``dpm-solver-sde`` (its stochastic SDE variant) and ``unipc`` (UniPC, bh2).
    """
    if name == "ddpm":
        return DDPMScheduler(
            **DIT_SCHEDULE,
            variance_type="learned_range" if learn_sigma else "fixed_small",
            clip_sample=False,
            timestep_spacing="linspace",
            prediction_type="epsilon",
        )
    if name == "ddim":
        return DDIMScheduler(
            **DIT_SCHEDULE,
            clip_sample=False,
            set_alpha_to_one=False,
            prediction_type="epsilon",
            timestep_spacing="linspace",
        )
    # the second-order multistep solvers share everything but the algorithm
    multistep = dict(
        **DIT_SCHEDULE,
        solver_order=2,
        prediction_type="epsilon",
        timestep_spacing="linspace",
        lower_order_final=True,
    )
    if name == "dpm-solver":
        return DPMSolverMultistepScheduler(**multistep, algorithm_type="dpmsolver++")
    if name == "dpm-solver-sde":
        return DPMSolverMultistepScheduler(**multistep, algorithm_type="sde-dpmsolver++")
    if name == "unipc":
        return UniPCMultistepScheduler(**multistep)
    raise ValueError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULERS)}")


def scheduler_name(scheduler: SchedulerMixin) -> str | None:
    """The name in :data:`SCHEDULERS` of a scheduler :func:`make_scheduler` could have made (``None`` for
    another kind)."""
    if isinstance(scheduler, DPMSolverMultistepScheduler):
        algorithm = scheduler.config.algorithm_type
        return {"dpmsolver++": "dpm-solver", "sde-dpmsolver++": "dpm-solver-sde"}.get(algorithm)
    kinds = {DDPMScheduler: "ddpm", DDIMScheduler: "ddim", UniPCMultistepScheduler: "unipc"}
    return kinds.get(type(scheduler))
