"""What a pipeline can sample, checked before anything is drawn or written (for a ``MoHDiTPipeline``): the scheduler samples the model's
objective, the guided channels exist, classifier-free guidance has a null class, latents have a VAE, and the guide
model a spec names loads and can guide. Apart from ``pipeline.py`` so the sampling loop stays one readable module."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moh_dit.errors import ConfigError
from moh_dit.objectives.base import Objective
from moh_dit.sampling.schedulers import scheduler_objective
from moh_dit.sampling.spec import TRAIN_TIMESTEPS, SamplingSpec

if TYPE_CHECKING:  # the pipeline is typed by diffusers' base class: pipeline.py imports this module
    from diffusers import DiffusionPipeline
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

    from moh_dit.sampling.guides import Guide


def check_sampling(
    pipe: DiffusionPipeline, sampling: SamplingSpec, decode: bool = True, guide: Guide | None = None
) -> Guide | None:
    """Whether ``sampling`` can draw from ``pipe``'s model: its scheduler samples the model's objective, the guided
    channels exist, guidance has a null class to guide with (or a guide), (``decode``) latents have a VAE to decode
    them, and a hand-off's lead can take the first steps. Each failure is one :class:`ConfigError`. Returns the guide the spec names: ``guide`` when given (it must be
    the one the spec names), else the one ``pipe.guide_for`` loads and checks."""
    transformer = pipe.transformer
    check_scheduler(pipe.scheduler, pipe.objective)
    if decode and pipe.vae is None and pipe.config.get("latent_space", False):
        raise ConfigError(
            f"this model generates {transformer.in_channels}-channel latents and the pipeline has no VAE to decode "
            f"them: pass the VAE it was trained with (--vae / vae=...), or output_type='latent'"
        )
    channels = sampling.guidance.channels
    if channels is not None and not 1 <= channels <= transformer.in_channels:
        raise ConfigError(
            f"guidance_channels={channels}: this model has {transformer.in_channels} channel(s); give a number "
            f"between 1 and {transformer.in_channels}, or none for all"
        )
    conditional = transformer.config.num_classes > 0
    cfg = sampling.guide is None and sampling.guidance.scale != 1.0
    if conditional and cfg and transformer.null_class_id is None:
        raise ConfigError(
            "this model was trained without label dropout: it has no null class, use guidance_scale=1 (or a guide "
            "model: autoguidance needs none)"
        )
    pipe.lead_for(sampling)  # a lead that cannot take the first steps stops here, before anything is drawn
    if guide is None:
        return pipe.guide_for(sampling)
    if guide.spec != sampling.guide:
        raise ConfigError(f"the guide given ({guide.spec}) is not the one the sampling spec names ({sampling.guide})")
    return guide


def check_scheduler(scheduler: SchedulerMixin, objective: Objective) -> None:
    """The scheduler must sample the transformer's objective: a sampler of another objective (a pipeline assembled
    by hand) would run without an error and make noise."""
    if scheduler.config.num_train_timesteps != TRAIN_TIMESTEPS:
        raise ConfigError(f"the scheduler must have {TRAIN_TIMESTEPS} training timesteps, as moh-dit's objectives")
    owner = scheduler_objective(scheduler)
    if owner is not None and objective.scheduler_name(scheduler) is None:
        raise ConfigError(
            f"the pipeline's {type(scheduler).__name__} samples {owner} models; this is a {objective.name} "
            f"model ({objective.describe()}): choose one of {', '.join(objective.samplers)} (with_scheduler)"
        )
