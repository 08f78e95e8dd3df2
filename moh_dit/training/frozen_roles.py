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
    """One role: ``wanted(config, objective)`` says whether a run has it; ``load(config, data, model, device)`` makes
    it (checked against the data and the student before any step)."""

    wanted: Callable[[Config, Objective], bool]
    load: Callable[[Config, TrainingData, MoHDiT, torch.device], FrozenModel]
    what: str  # in words, for errors


def _wants_repa(config: Config, objective: Objective) -> bool:
    return bool(config.repa.encoder)


def _load_repa(config: Config, data: TrainingData, model: MoHDiT, device: torch.device) -> FrozenModel:
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


# every role a run may have beside its student
FROZEN_MODELS: dict[str, FrozenEntry] = {
    "repa_encoder": FrozenEntry(_wants_repa, _load_repa, "REPA's encoders (repa.encoder)"),
}


def load_frozen_models(
    config: Config, objective: Objective, data: TrainingData, model: MoHDiT, device: torch.device
) -> FrozenModels:
    """The frozen models of a run: every role the config wants and every role ``objective`` declares, loaded, frozen
    and placed on ``device``; a role the objective declares that no entry loads is a :class:`ConfigError`."""
    unknown = [role for role in objective.frozen_models if role not in FROZEN_MODELS]
    if unknown:
        raise ConfigError(f"the {objective.name} objective needs {unknown}: no loader for them in FROZEN_MODELS")
    models = {}
    for role, entry in FROZEN_MODELS.items():
        if role in objective.frozen_models or entry.wanted(config, objective):
            frozen = entry.load(config, data, model, device)
            frozen.freeze(device)
            models[role] = frozen
    return FrozenModels(models)
