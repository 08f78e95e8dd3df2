"""Sampling schedulers by name, for the model's objective (diffusers' schedulers, configured by the objective:
``moh_dit.objectives``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffusers.schedulers.scheduling_utils import SchedulerMixin

from moh_dit.objectives import DEFAULT_OBJECTIVE, OBJECTIVES, objective_class

if TYPE_CHECKING:
    from moh_dit.objectives.base import Objective

__all__ = ["make_scheduler", "scheduler_name", "scheduler_objective"]


def make_scheduler(
    name: str | None = None, learn_sigma: bool = True, objective: Objective | None = None
) -> SchedulerMixin:
    """The scheduler of sampler ``name`` (default: the objective's published protocol's) for ``objective`` (default: the
    registry's default objective, DiT's DDPM, with or without ``learn_sigma``)."""
    if objective is None:
        objective = objective_class(DEFAULT_OBJECTIVE)(learn_sigma=learn_sigma)
    return objective.make_scheduler(name or objective.protocol("paper")[0])


def scheduler_name(scheduler: SchedulerMixin, objective: Objective | None = None) -> str | None:
    """The name of a scheduler ``objective`` (default: the registry's default objective) could have made (``None`` for
    another kind)."""
    return (objective or objective_class(DEFAULT_OBJECTIVE)()).scheduler_name(scheduler)


def scheduler_objective(scheduler: SchedulerMixin) -> str | None:
    """The objective whose sampler ``scheduler`` is (``None``: a scheduler of none of them, e.g. a user's own)."""
    for name in OBJECTIVES:
        if objective_class(name)().scheduler_name(scheduler) is not None:
            return name
    return None
