"""A distillation's lead model: a frozen few-step model whose first steps make a multi-step generator's input at its
later grid times (``distill.dmd_input: lead``, ``distill.lead_model``), so that the generator's later steps train on
what they will see when it is sampled in a hand-off after that lead (``--lead-model``; moh_dit/sampling/leads.py).

It is a :class:`~moh_dit.training.frozen.FrozenModel` of role ``lead``: never trained, never in DDP, the optimizer,
the EMA or a checkpoint's weights; its identity (weights fingerprint, objective) is in the run's record, and a resume
beside other weights is refused. Its forwards are counted with the generator's as those of its input
(:meth:`~moh_dit.objectives.distill.generator.GridGenerator.simulated_forwards`: at the generator's size), not as
the teacher's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.manifests import fingerprint_module
from moh_dit.objectives import objective_of
from moh_dit.training.frozen import FrozenModel

if TYPE_CHECKING:
    from moh_dit.data.training_data import TrainingData
    from moh_dit.sampling.leads import Lead
    from moh_dit.training.config_sections import DistillSection

__all__ = ["FrozenLead", "LEAD_SAMPLER"]

LEAD_SAMPLER = "meanflow"  # a DMD2/SiD generator's sampler: the lead must step with a scheduler of its kind


class FrozenLead(FrozenModel):
    """The lead model beside a generator (see the module docstring); :meth:`first_steps` is its part."""

    role = "lead"

    def __init__(self, lead: Lead) -> None:
        self.lead = lead

    @classmethod
    def load(cls, section: DistillSection, data: TrainingData, device: torch.device) -> FrozenLead:
        """The lead ``section.lead_model`` names, checked against ``data`` as a teacher is and against the generator's
        sampler (a model that cannot step with it cannot lead it): one :class:`ConfigError` otherwise."""
        from moh_dit.sampling.leads import Lead
        from moh_dit.sampling.spec_parts import LeadSpec
        from moh_dit.training.distill.teacher import check_fits, load_folder

        try:
            loaded = load_folder(section.lead_model)
        except ArtifactError as err:  # the key the path came from, with what is wrong with it
            raise ConfigError(f"distill.lead_model={section.lead_model}: {err}") from None
        check_fits(loaded, data, "the lead model")
        objective = objective_of(loaded.model)
        if LEAD_SAMPLER not in objective.samplers:
            raise ConfigError(
                f"the lead model {loaded.source} cannot take a generator's first steps: it is not sampled by "
                f"{LEAD_SAMPLER} steps ({objective.describe()}); give a flow map or a DMD2/SiD generator"
            )
        model = loaded.model.to(device).eval()
        spec = LeadSpec(str(section.lead_model), 1)
        return cls(Lead(model, objective, spec, loaded.source, fingerprint_module(model), LEAD_SAMPLER))

    def modules(self) -> list[torch.nn.Module]:
        return [self.lead.model]

    def identity(self) -> dict[str, Any]:
        return {"sha256": self.lead.fingerprint, "objective": self.lead.objective.record()}

    def provenance(self) -> dict[str, Any]:
        return {"weights": self.lead.source}

    def describe(self) -> str:
        return f"the lead {self.lead.source} ({self.lead.objective.describe()})"

    def first_steps(self, grid, noise, labels, grid_steps, steps, drop, autocast) -> torch.Tensor:
        """The lead's first steps (:meth:`moh_dit.sampling.leads.Lead.first_steps`)."""
        return self.lead.first_steps(grid, noise, labels, grid_steps, steps, drop, autocast)
