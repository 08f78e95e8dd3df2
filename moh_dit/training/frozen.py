"""Models beside the student: networks a run uses but never trains (REPA's encoders; a distillation's teacher; later a
reward or representation model).

Each is a :class:`FrozenModel` under a role name. Training loads and places them
(``moh_dit.training.frozen_roles.load_frozen_models``, from its table ``FROZEN_MODELS``: which roles the run's config or
its objective asks for, and how each is loaded), puts them in eval mode with their parameters frozen, and hands them to the objective's ``forward_losses`` and to the trainer's
losses; they are never wrapped for DDP, never in the optimizer, the EMA, the post-hoc snapshots or a checkpoint's
weights. Their identity (what they are and a fingerprint of their weights) is recorded in the run's identity and in
every checkpoint, so that a resume beside another model, or without one the run was trained beside, is refused in one
line.

An objective declares the roles it needs (``Objective.frozen_models``); a new role is a subclass of
:class:`FrozenModel` and one entry in ``FROZEN_MODELS``: whether a run wants it and how it loads
(docs/development.md#add-a-model-beside-the-student).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from moh_dit.errors import ConfigError
from moh_dit.manifests import without_retired_keys

__all__ = ["FrozenModel", "FrozenModels", "check_resume_beside", "recorded_frozen"]


class FrozenModel:
    """A model a run uses without training it. Subclasses hold their networks in :meth:`modules` and say what they
    are in :meth:`identity` (a JSON-able record with a weights fingerprint)."""

    role: str = "frozen"
    evaluations: int = 0  # rows of the network evaluations it made in this process (a teacher counts its own)

    def modules(self) -> list[torch.nn.Module]:
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        raise NotImplementedError

    def provenance(self) -> dict[str, Any]:
        """Where it was loaded from (its folder or file): recorded beside the identity, never compared."""
        return {}

    def describe(self) -> str:
        return self.role

    def initial_student(self, config: Any, data: Any) -> tuple[torch.nn.Module, dict] | None:
        """The student a run starts from this model (a teacher's student from its weights), with a report of what it
        took; ``None``: the student is built as the config says."""
        return None

    def freeze(self, device: torch.device | str) -> None:
        """On ``device``, in eval mode (no dropout, fixed norms), every parameter without gradient."""
        for module in self.modules():
            module.to(device).eval().requires_grad_(False)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for module in self.modules():
            yield from module.parameters()


class FrozenModels(Mapping[str, FrozenModel]):
    """The run's frozen models by role (an empty mapping when it has none)."""

    def __init__(self, models: Mapping[str, FrozenModel] | None = None) -> None:
        self._models = dict(models or {})

    def __getitem__(self, role: str) -> FrozenModel:
        if role not in self._models:
            raise KeyError(
                f"this run has no {role!r} model beside the student (it has {sorted(self._models) or 'none'})"
            )
        return self._models[role]

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def with_models(self, other: Mapping[str, FrozenModel]) -> FrozenModels:
        """These and ``other``'s models (a role in both is an error)."""
        both = sorted(set(self._models) & set(other))
        if both:
            raise ValueError(f"frozen models {both} loaded twice")
        return FrozenModels({**self._models, **other})

    def evaluations(self) -> int:
        """The rows of network evaluations the frozen models made in this process so far (a distillation's cost)."""
        return sum(model.evaluations for model in self._models.values())

    def identity(self) -> dict[str, dict[str, Any]]:
        """Each role's identity (what a run and its checkpoints record)."""
        return {role: model.identity() for role, model in self._models.items()}

    def provenance(self) -> dict[str, dict[str, Any]]:
        """Each role's provenance (where it was loaded from; recorded, not compared)."""
        return {role: model.provenance() for role, model in self._models.items()}

    def check_apart(self, *modules: torch.nn.Module) -> None:
        """No parameter of a frozen model is one of ``modules``' (the student, its EMA copy), nor trainable."""
        theirs = {id(p) for model in self._models.values() for p in model.parameters()}
        shared = [m for m in modules for p in m.parameters() if id(p) in theirs]
        if shared or any(p.requires_grad for model in self._models.values() for p in model.parameters()):
            raise RuntimeError("a frozen model shares parameters with the student or is trainable")


def check_resume_beside(checkpoint: Any, recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> None:
    """A resume beside other frozen models than the checkpoint was trained beside stops in one line. A checkpoint that
    predates the record (``recorded`` is ``None``) is not checked."""
    if recorded is None:
        return
    recorded = without_retired_keys(recorded, current)  # a checkpoint of an earlier moh-dit: its teacher's path too
    if dict(recorded) == dict(current):
        return
    roles = sorted(set(recorded) | set(current))
    wrong = [r for r in roles if recorded.get(r) != current.get(r)]
    said = "; ".join(
        f"{role}: {_short(recorded.get(role))} in the checkpoint, {_short(current.get(role))} now" for role in wrong
    )
    raise ConfigError(
        f"{checkpoint} was trained beside other frozen models ({said}): resume with the ones it was trained beside, or "
        f"start a new run"
    )


def _short(identity: Mapping[str, Any] | None) -> str:
    if identity is None:
        return "none"
    weights = identity.get("sha256")
    name = identity.get("name") or identity.get("source") or "weights"
    return f"{name} {weights[:12]}" if isinstance(weights, str) else str(name)


def recorded_frozen(checkpoint: Any) -> dict[str, dict[str, Any]] | None:
    """What the checkpoint a run resumes from recorded of its frozen models, by role: ``{"identity", "provenance"}``
    (``None``: a new run, or a checkpoint that records none)."""
    if checkpoint is None:
        return None
    import json
    from pathlib import Path

    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    identity, provenance = state.get("frozen") or {}, state.get("frozen_provenance") or {}
    return {role: {"identity": identity[role], "provenance": provenance.get(role)} for role in identity} or None
