"""What a pipeline can sample, checked before anything is drawn or written (for a ``MoHDiTPipeline``): the scheduler samples the model's
objective, the guided channels exist, classifier-free guidance has a null class, latents have a VAE, and a named
guide model is the one attached. Apart from ``pipeline.py`` so the sampling loop stays one readable module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moh_dit.errors import ConfigError
from moh_dit.model.network import MoHDiT
from moh_dit.objectives.base import Objective
from moh_dit.sampling.schedulers import scheduler_objective
from moh_dit.sampling.spec import TRAIN_TIMESTEPS, SamplingSpec

if TYPE_CHECKING:  # the pipeline is typed by diffusers' base class: pipeline.py imports this module
    from diffusers import DiffusionPipeline
    from diffusers.schedulers.scheduling_utils import SchedulerMixin


def check_sampling(pipe: DiffusionPipeline, sampling: SamplingSpec, decode: bool = True) -> None:
    """Whether ``sampling`` can draw from ``pipe``'s model: its scheduler samples the model's objective, the guided
    channels exist, guidance has a null class to guide with, a named guide is attached, and (``decode``) latents
    have a VAE to decode them. Each failure is one :class:`ConfigError`."""
    transformer = pipe.transformer
    check_scheduler(pipe.scheduler, pipe.objective)
    if decode and pipe.vae is None and pipe.config.get("latent_space", False):
        raise ConfigError(
            f"this model generates {transformer.in_channels}-channel latents and the pipeline has no VAE to decode "
            f"them: pass the VAE it was trained with (--vae / vae=...), or output_type='latent'"
        )
    channels = sampling.guidance_channels
    if channels is not None and not 1 <= channels <= transformer.in_channels:
        raise ConfigError(
            f"guidance_channels={channels}: this model has {transformer.in_channels} channel(s); give a number "
            f"between 1 and {transformer.in_channels}, or none for all"
        )
    conditional = transformer.config.num_classes > 0
    cfg = sampling.guide is None and sampling.guidance_scale != 1.0
    if conditional and cfg and transformer.null_class_id is None:
        raise ConfigError(
            "this model was trained without label dropout: it has no null class, use guidance_scale=1 (or a guide "
            "model: autoguidance needs none)"
        )
    attached_guide(pipe, sampling)


def attached_guide(pipe: DiffusionPipeline, sampling: SamplingSpec) -> MoHDiT | None:
    """The guide model ``sampling`` names (``None`` for classifier-free guidance); see :func:`attached_guide_entry`."""
    entry = attached_guide_entry(pipe, sampling)
    return None if entry is None else entry.model


def attached_guide_entry(pipe: DiffusionPipeline, sampling: SamplingSpec) -> Any:
    """What ``moh_dit.sampling.guides.attach_guide`` attached for the guide ``sampling`` names (``None`` for
    classifier-free guidance); a guide that is not attached, or another one, is a :class:`ConfigError`."""
    if sampling.guide is None:
        return None
    attached = getattr(pipe, "guide", None)
    if attached is None or attached.record != sampling.guide_record():
        raise ConfigError(
            f"the guide {sampling.guide} is not attached to this pipeline: moh_dit.sampling.guides.attach_guide("
            f"pipe, sampling) loads and checks it"
        )
    return attached


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
