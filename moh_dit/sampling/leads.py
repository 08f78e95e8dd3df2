"""A hand-off: another model (the lead) takes the sampling grid's first steps, and the pipeline's own model takes the
rest from where the lead stopped.

Experts of different noise levels are an old idea (eDiff-I's ensemble of expert denoisers, arXiv:2211.01324; SDXL's
base model handing its latents to the refiner, arXiv:2307.01952). For a two-step distilled generator it is also a
measured one: the first jump of the student a DMD2 or SiD run started from, followed by the finished student's second
jump, keeps more of the teacher's variety than the student's own two jumps (docs/results.md, "Where the two-step
students' variety goes"). Both models walk the same scheduler: each step is evaluated by the model whose turn it is,
through that model's own objective (its time input and what the scheduler takes from its output) and stepped by that
model's own scheduler put on the main model's grid (a DMD2 generator's renoises between steps, an ECT student's jumps
deterministically), so the lead may be a model of another objective or method as long as it samples with a scheduler
of the same kind. The main model's scheduler then starts at the step where the lead stopped (``set_begin_index``, as
diffusers' SDXL refiner starts mid-grid). A spec names the lead
(:class:`~moh_dit.sampling.spec_parts.LeadSpec`: a path and its number of steps); the pipeline loads and checks it on
first use (``MoHDiTPipeline.lead_for``). diffusers' pipelines have the same hand-off only for SDXL (``denoising_end``
and ``denoising_start`` across two pipelines); ours is one spec of one pipeline, so that sample sets, their manifests
and the study's scoring treat it as any other way to sample.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from moh_dit.errors import ConfigError
from moh_dit.manifests import fingerprint_module
from moh_dit.model.network import MoHDiT
from moh_dit.objectives import objective_of
from moh_dit.objectives.base import Objective
from moh_dit.sampling.guidance import guided_output
from moh_dit.sampling.guides import image_differences
from moh_dit.sampling.sources import load_transformer, source_vae_record
from moh_dit.sampling.spec_parts import LeadSpec

__all__ = ["Lead", "Turns", "load_lead", "begin_at", "warn_if_not_its_lead"]

logger = logging.getLogger("moh_dit.sampling")


@dataclass
class Lead:
    """The lead model of a hand-off, its objective (how its steps are evaluated), the spec that names it, where its
    weights came from and their fingerprint."""

    model: MoHDiT
    objective: Objective
    spec: LeadSpec
    source: str
    fingerprint: str
    scheduler_name: str

    def scheduler_on(self, grid: Objective, steps: int, time_shift: float, device: Any) -> Any:
        """The lead's own scheduler (the one it samples with alone), put on the main model's grid: ``grid``, the main
        model's objective, places it as it places its own."""
        scheduler = self.objective.make_scheduler(self.scheduler_name)
        grid.set_timesteps(scheduler, steps, time_shift, device)
        return scheduler

    def identity(self) -> dict[str, Any]:
        """What a sample set's identity keeps of its lead: the weights (by fingerprint) and the steps they take."""
        return {"transformer_sha256": self.fingerprint, "steps": self.spec.steps}

    @torch.no_grad()
    def first_steps(
        self,
        grid: Objective,
        noise: torch.Tensor,
        labels: torch.Tensor | None,
        grid_steps: int,
        steps: int,
        drop: torch.Tensor | None = None,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
    ) -> torch.Tensor:
        """The lead's first ``steps`` steps from pure ``noise`` on ``grid``'s grid of ``grid_steps`` steps (unshifted
        beyond what ``grid`` shifts), unguided, as it takes them in a hand-off sampled at scale 1: the state the main
        model's later steps start from. A distillation that trains those later steps on it (``distill.dmd_input:
        lead``) calls it with its own objective as ``grid``; ``drop`` marks the rows whose label is the null class."""
        if drop is not None and labels is not None and bool(drop.any()):  # those rows' label: the null class
            if self.model.null_class_id is None:
                raise ConfigError(f"the lead model {self.source} was trained without label dropout: it cannot take the "
                                  "rows trained without their label")  # fmt: skip
            labels = torch.where(drop.bool(), self.model.null_class_id, labels)
        scheduler = self.scheduler_on(grid, grid_steps, 1.0, noise.device)
        latents = noise
        for index, t in enumerate(scheduler.timesteps[:steps]):
            model_in = self.objective.network_input(scheduler, latents, index, t)
            time, _ = self.objective.step_time(scheduler, index, t)
            with autocast():  # unguided: the conditional prediction alone, as a hand-off at scale 1 evaluates it
                out = guided_output(self.model, model_in, time, labels)
            out = self.objective.scheduler_input(out, scheduler, self.model.in_channels, latents, index)
            latents = scheduler.step(out, t, latents).prev_sample
        return latents


def load_lead(spec: LeadSpec, main: MoHDiT, main_space: dict | None, scheduler: Any, scheduler_name: str) -> Lead:
    """The lead ``spec`` names, checked against the ``main`` model (of latent space ``main_space``, sampled by
    ``scheduler``, whose name is ``scheduler_name``), on its device and in its dtype: one :class:`ConfigError` naming
    every difference that keeps the lead from starting the main model's images."""
    model, source = load_transformer(spec.model)
    objective = objective_of(model)
    wrong = image_differences(main, model, main_space, source_vae_record(source))
    if objective.scheduler_name(scheduler) != scheduler_name:
        wrong.append(
            f"it is not sampled by the main model's scheduler {scheduler_name} (its objective: {objective.describe()})"
        )
    if getattr(scheduler, "order", 1) != 1:  # Heun's steps are pairs of calls: no point between them to hand over at
        wrong.append(f"the scheduler {scheduler_name} evaluates the network {scheduler.order} times a step")
    if wrong:
        raise ConfigError(
            f"the lead model {source.path} cannot take the first steps of this model: {'; '.join(wrong)}"
        )
    # torch's own cast, as the guide's (diffusers' ModelMixin.to warns about an empty keep-in-fp32 list)
    model = torch.nn.Module.to(model, device=main.device, dtype=main.dtype).eval()
    return Lead(model, objective, spec, str(source.path), fingerprint_module(model), scheduler_name)


class Turns:
    """Who evaluates and steps each step of one sampling run: ``lead`` (its model run directly, since a cache never
    takes a lead; its objective; its own scheduler on the main model's grid, which ``grid``, the main objective, places)
    for its first steps, then ``main`` (model, objective, network, scheduler), whose scheduler starts where the lead's
    stopped. Without a lead, ``main`` at every step."""

    def __init__(self, main: tuple, lead: Lead | None, grid: Objective, sampler: Any, device: Any) -> None:
        self.main, self.lead, self.led = main, None, 0
        if lead is not None:
            scheduler = lead.scheduler_on(grid, sampler.num_steps, sampler.time_shift, device)
            self.lead, self.led = (lead.model, lead.objective, None, scheduler), lead.spec.steps
            begin_at(main[3], self.led)

    def at(self, index: int) -> tuple:
        """``(model, objective, network, scheduler)`` of step ``index``."""
        return self.lead if index < self.led else self.main


def begin_at(scheduler: Any, index: int) -> None:
    """Let ``scheduler``, on its grid, take its first step at ``index``: the schedulers that count their steps
    (diffusers' flow and multistep schedulers, moh-dit's) start there; DDPM and DDIM read the step from the timestep."""
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(index)


def warn_if_not_its_lead(trained: dict | None, lead: Lead | None, steps: int) -> None:
    """A generator whose later steps were trained on a lead's first step (``trained``: that lead's recorded model and
    weights fingerprint; ``distill.dmd_input: lead``) sampled at several steps without that lead, or with another, is
    said in one warning: its later steps then see inputs they were not trained on. Not refused (it is a choice)."""
    if not trained or steps < 2 or (lead is not None and lead.fingerprint == trained.get("sha256")):
        return
    said = "without it" if lead is None else f"with another lead ({lead.source}, weights {lead.fingerprint[:12]})"
    logger.warning(
        "this generator's later steps were trained on the first step of %s (weights %s); sampled %s, they see inputs "
        "they were not trained on: pass --lead-model %s (lead_model in a spec)",
        trained.get("model"), str(trained.get("sha256"))[:12], said, trained.get("model"),
    )  # fmt: skip
