"""The import path of moh-dit 0.3 for DiT's objective, kept for one release (CHANGELOG.md): the objective lives in
``moh_dit.objectives.ddpm`` now, beside flow matching (``moh_dit.objectives.flow``)."""

from moh_dit.objectives.ddpm import (
    DDPM,
    DIT_SCHEDULE,
    DiffusionLosses,
    DiffusionObjective,
    discretized_gaussian_log_likelihood,
    make_train_scheduler,
    normal_kl,
)

__all__ = [
    "DDPM",
    "DIT_SCHEDULE",
    "DiffusionLosses",
    "DiffusionObjective",
    "discretized_gaussian_log_likelihood",
    "make_train_scheduler",
    "normal_kl",
]
