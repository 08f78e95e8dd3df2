"""Training objectives: what the network learns to predict, how a training example is noised, the loss, and the
samplers that turn its predictions into images. One interface (:class:`moh_dit.objectives.base.Objective`), one
module per objective, one entry each in :data:`moh_dit.objectives.registry.OBJECTIVES`.

This package's ``__init__`` and :mod:`~moh_dit.objectives.registry` import no torch, so that command lines and
sampling specs can check names before torch is loaded; :func:`objective_from_record` imports the class.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from moh_dit.objectives.registry import DEFAULT_OBJECTIVE, OBJECTIVES, entry, objective_name

if TYPE_CHECKING:
    from moh_dit.objectives.base import Objective

__all__ = [
    "OBJECTIVES",
    "DEFAULT_OBJECTIVE",
    "entry",
    "objective_name",
    "objective_class",
    "objective_from_record",
    "objective_of",
]


def objective_class(name: str, record: dict[str, Any] | None = None) -> type[Objective]:
    """The class of objective ``name`` (``ddpm``, ``flow``); for an objective of several classes (a distillation's
    methods) the one ``record`` names, else its default."""
    module, cls = entry(name).variant(record)
    return getattr(importlib.import_module(module), cls)


def objective_from_record(record: dict[str, Any] | None, **training: Any) -> Objective:
    """The objective a model records (``MoHDiT.config.objective``; ``None``: DiT's DDPM, as every model of moh-dit
    0.3 and earlier), with ``training`` options (loss weighting, time sampling) where the caller trains it."""
    return objective_class(objective_name(record), record).from_record(record, **training)


def objective_of(model: Any, **training: Any) -> Objective:
    """The objective of a :class:`~moh_dit.model.network.MoHDiT` (its config's record and variance head)."""
    config = model.config
    return objective_from_record(config.get("objective"), learn_sigma=config.get("learn_sigma", True), **training)
