"""The roles a run may have beside its student (:mod:`moh_dit.training.frozen`): whether a run wants each and how it is
loaded, and loading a run's frozen models. A new role is one entry in :data:`FROZEN_MODELS`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moh_dit.errors import ConfigError
from moh_dit.training.frozen import FrozenModel, FrozenModels

if TYPE_CHECKING:
    from moh_dit.data.training_data import TrainingData
    from moh_dit.model.network import MoHDiT
    from moh_dit.objectives.base import Objective
    from moh_dit.training.config_sections import Config

__all__ = ["FrozenEntry", "FROZEN_MODELS", "load_frozen_models"]


@dataclass(frozen=True)
class FrozenEntry:
    """One role: ``wanted(config, objective)`` says whether a run has it; ``load(config, data, student, device,
    loaded, recorded)`` makes it, checked against the data (and the student, for a role that ``needs_student``: loaded
    after the student is built; the others before, so that a teacher can start the student), with the roles loaded
    before it (``loaded``: a teacher's trajectories need the teacher) and what a resumed run recorded of it
    (``recorded``: its identity and provenance, or None)."""

    wanted: Callable[[Config, Objective], bool]
    load: Callable[
        [Config, TrainingData, MoHDiT | None, torch.device, dict[str, FrozenModel], dict | None], FrozenModel
    ]
    what: str  # in words, for errors
    needs_student: bool = False


def _wants_repa(config: Config, objective: Objective) -> bool:
    return bool(config.repa.encoder)


def _load_repa(
    config: Config, data: TrainingData, model: MoHDiT | None, device: torch.device, loaded, recorded
) -> FrozenModel:
    from moh_dit.training.repa import Alignment

    repa = config.repa
    if repa.depth > model.config.depth:
        raise ConfigError(f"repa.depth={repa.depth} counts blocks from 1 to the model's {model.config.depth}")
    resolution = repa.encoder_resolution or 224 * (config.data.image_size // 256)  # REPA's rule: 224 at 256 px
    return Alignment(
        repa.encoder,
        repa.encoder_weights,
        repa.encoder_module,
        resolution,
        model.num_tokens,
        config.data.image_size,
        device,
    )


def _load_teacher(
    config: Config, data: TrainingData, model: MoHDiT | None, device: torch.device, loaded, recorded
) -> FrozenModel:
    from moh_dit.training.distill import Teacher

    return Teacher.load(config.distill, data, device, recorded)


def _load_trajectories(
    config: Config, data: TrainingData, model, device: torch.device, loaded, recorded
) -> FrozenModel:
    from moh_dit.training.distill import trajectory_source

    if "teacher" not in loaded:
        raise ConfigError("trajectories are the teacher's: the run needs a teacher (distill.teacher)")
    return trajectory_source(config, data, loaded["teacher"], device)


def _load_lead(config: Config, data: TrainingData, model, device: torch.device, loaded, recorded) -> FrozenModel:
    from moh_dit.training.distill import FrozenLead

    return FrozenLead.load(config.distill, data, device)


# every role a run may have beside its student
FROZEN_MODELS: dict[str, FrozenEntry] = {
    "teacher": FrozenEntry(
        lambda config, objective: False, _load_teacher, "a distillation's teacher (distill.teacher)"
    ),
    # the teacher's sampling trajectories (trajectory distillation), after the teacher they are drawn from
    "trajectories": FrozenEntry(
        lambda config, objective: False, _load_trajectories, "the teacher's trajectories (distill.trajectories)"
    ),
    # a few-step model whose first steps are a DMD2/SiD generator's input at its later grid times
    "lead": FrozenEntry(lambda config, objective: False, _load_lead, "the lead model (distill.lead_model)"),
    "repa_encoder": FrozenEntry(_wants_repa, _load_repa, "REPA's encoders (repa.encoder)", needs_student=True),
}


def load_frozen_models(
    config: Config,
    objective: Objective | type[Objective],
    data: TrainingData,
    device: torch.device,
    student: MoHDiT | None = None,
    recorded: dict[str, dict] | None = None,
) -> FrozenModels:
    """The frozen models of a run: every role the config wants and every role ``objective`` declares, loaded, frozen
    and placed on ``device``: without ``student`` those loaded before it is built, with it those that need it;
    ``recorded``: what the checkpoint a run resumes from recorded of each role. A role the objective declares that no
    entry loads is a :class:`ConfigError`."""
    import dataclasses

    options = dataclasses.asdict(config.distill) if config is not None else {}
    needed = (
        objective.frozen_models_for(options) if hasattr(objective, "frozen_models_for") else objective.frozen_models
    )
    unknown = [role for role in needed if role not in FROZEN_MODELS]
    if unknown:
        raise ConfigError(f"the {objective.name} objective needs {unknown}: no loader for them in FROZEN_MODELS")
    models = {}
    for role, entry in FROZEN_MODELS.items():
        if entry.needs_student != (student is not None):
            continue
        if role in needed or entry.wanted(config, objective):
            frozen = entry.load(config, data, student, device, models, (recorded or {}).get(role))
            frozen.freeze(device)
            models[role] = frozen
    return FrozenModels(models)
