"""``MoHDiTPipeline``: class-conditional sampling with classifier-free guidance.

A diffusers ``DiffusionPipeline`` holding the transformer, a scheduler, an optional autoencoder (latent diffusion:
``AutoencoderKL``, ``AutoencoderDC``, ...; ``None`` for pixel space) and ``id2label`` in its saved config. The
transformer's objective (``moh_dit.objectives``: DiT's DDPM or flow matching) says which schedulers sample it, what
the network's time input is at each step, and what the scheduler takes from its output; the loop below is the same
for every objective. It differs from diffusers' ``DiTPipeline`` where that one breaks DiT's protocol: the null class is the model's own
``num_classes`` (not a hard-coded 1000), the learned variance channels reach ``DDPMScheduler.step``
(so ``variance_type="learned_range"`` works), and fast solvers receive only the noise channels.

    pipe = MoHDiTPipeline.from_pretrained("runs/fmnist/pipeline")
    images = pipe(["Sneaker", "Bag"], guidance_scale=4.0, num_inference_steps=250).images"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import DiffusionPipeline, ImagePipelineOutput, ModelMixin
from diffusers.schedulers.scheduling_utils import SchedulerMixin

# diffusers resolves a saved pipeline's scheduler as model_index.json names it
# ("moh_dit.objectives.flow_schedulers") and, for safety, only from modules already imported: importing it here
# is what lets MoHDiTPipeline.from_pretrained load a flow pipeline.
import moh_dit.objectives.flow_schedulers  # noqa: F401
from moh_dit.errors import NonFiniteSampleError
from moh_dit.manifests import read_manifest
from moh_dit.model.network import MoHDiT
from moh_dit.objectives import objective_of
from moh_dit.objectives.base import Objective
from moh_dit.objectives.registry import resolve_protocol
from moh_dit.sampling.caches import CachedNetwork, SamplingCache, prepared_cache
from moh_dit.sampling.checks import check_sampling
from moh_dit.sampling.guidance import StepEvaluation, guided_output
from moh_dit.sampling.guides import Guide, load_guide
from moh_dit.sampling.labels import resolve_class_labels
from moh_dit.sampling.leads import Lead, Turns, load_lead, warn_if_not_its_lead
from moh_dit.sampling.rules import make_rule
from moh_dit.sampling.spec import GRID_GUIDANCE, SamplingSpec
from moh_dit.vae import ImageSpace

logger = logging.getLogger(__name__)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Model-range images (N, C, H, W) in [-1, 1] -> uint8 (N, H, W, C), quantised as the ADM reference
    does: ``clamp(127.5 x + 128, 0, 255)`` then truncated."""
    arr = (images.float() * 127.5 + 128.0).clamp(0, 255).to(torch.uint8)
    return arr.permute(0, 2, 3, 1).cpu().numpy()


class MoHDiTPipeline(DiffusionPipeline):
    """Sample class-conditional images from a :class:`MoHDiT`.

    Args:
        transformer: the denoiser.
        scheduler: a diffusers scheduler (see :func:`make_scheduler`).
        vae: the autoencoder of latent models (any diffusers autoencoder, see :mod:`moh_dit.vae`), ``None`` for
            pixel-space models.
        id2label: class id -> name, saved with the pipeline.
    """

    model_cpu_offload_seq = "transformer->vae"
    _optional_components = ["vae"]

    def __init__(
        self,
        transformer: MoHDiT,
        scheduler: SchedulerMixin,
        vae: ModelMixin | None = None,
        id2label: dict | None = None,
        latent_space: bool | None = None,
    ) -> None:
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae)
        id2label = {int(k): str(v) for k, v in (id2label or {}).items()}
        if latent_space is None:  # pipelines saved before this was recorded: a VAE or non-image channels
            latent_space = vae is not None or transformer.config.in_channels not in (1, 3)
        self.register_to_config(id2label=id2label, latent_space=bool(latent_space))

    @classmethod
    def build(
        cls,
        transformer: MoHDiT,
        vae: ModelMixin | None = None,
        id2label: dict | None = None,
        scheduler: str | None = None,
        latent_space: bool | None = None,
    ) -> MoHDiTPipeline:
        """The one way moh-dit assembles a pipeline: a model (put in eval mode), an optional VAE, class
        names, and a scheduler by name for the model's objective (default: the scheduler of its published
        protocol: DiT's DDPM, SiT's SDE)."""
        objective = objective_of(transformer)
        name = scheduler or resolve_protocol("paper", objective.name)[0]
        return cls(transformer.eval(), objective.make_scheduler(name), vae, id2label, latent_space)

    @property
    def objective(self) -> Objective:
        """What the transformer was trained for (its config's record): which samplers apply and how."""
        return objective_of(self.transformer)

    def save(self, folder: str | os.PathLike, source: dict[str, Any], sampling: SamplingSpec | None = None) -> Path:
        """Save weights, manifest and model card atomically (see :func:`moh_dit.sampling.export.save_pipeline`)."""
        from moh_dit.sampling.export import save_pipeline

        return save_pipeline(self, folder, source, sampling)

    @staticmethod
    def manifest_of(folder: str | os.PathLike) -> dict | None:
        return read_manifest(folder, "pipeline")

    @property
    def preview_sampling(self) -> SamplingSpec:
        """How this model's run drew its previews, as recorded with its weights (``load_pipeline`` reads it):
        what ``sample.py`` and the demo start from; the package's grid defaults without a record."""
        return getattr(self, "recorded_sampling", None) or SamplingSpec()

    def set_preview_sampling(self, record: SamplingSpec | dict | None) -> None:
        """Adopt a recorded spec (a record is checked; ``None`` keeps the package defaults)."""
        self.recorded_sampling = record if isinstance(record, SamplingSpec) else SamplingSpec.from_record(record)

    @property
    def patch_pixels(self) -> int:
        """The side of one transformer patch in output pixels (the patch times the VAE's down-sampling)."""
        return self.transformer.config.patch_size * self.space.downsample_factor

    @property
    def id2label(self) -> dict[int, str]:
        return {int(k): v for k, v in (self.config.id2label or {}).items()}

    @property
    def labels(self) -> dict[str, int]:
        """Class name -> id."""
        return {v: k for k, v in self.id2label.items()}

    def get_label_ids(self, labels: int | str | Sequence[int | str]) -> list[int]:
        return resolve_class_labels(labels, self.transformer.config.num_classes, self.id2label)

    def replace_vae(self, vae: ModelMixin | None, spec: str, trained_with: dict | None = None) -> None:
        """Decode with ``vae`` instead of the pipeline's own, if it decodes this model's latents (see
        :func:`moh_dit.sampling.export.replace_vae`)."""
        from moh_dit.sampling.export import replace_vae

        replace_vae(self, vae, spec, trained_with)

    def with_scheduler(self, name: str) -> MoHDiTPipeline:
        """Swap in one of the objective's samplers (in place); returns the pipeline. A sampler of another objective
        is a :class:`ConfigError` naming the ones that apply."""
        self.scheduler = self.objective.make_scheduler(name)
        return self

    def use_sampling_scheduler(self, sampling: SamplingSpec) -> None:
        """Swap in ``sampling.sampler.scheduler`` when it names another sampler than the pipeline's (``None`` keeps
        it). Done before a sample set's manifest is written, so that its identity names the sampler that draws it."""
        wanted = sampling.sampler.scheduler
        if wanted is not None and wanted != self.objective.scheduler_name(self.scheduler):
            self.with_scheduler(wanted)

    # ------------------------------------------------------------------------------------------------
    # The guide, the lead and the cache a spec names
    # ------------------------------------------------------------------------------------------------
    def _kept(self, kind: str, key: tuple, make: Callable[[], Any]) -> Any:
        """What ``make`` returns, made on first use and kept under ``key`` (which names this transformer)."""
        kept = self.__dict__.setdefault(kind, {})
        if key not in kept:
            kept[key] = make()
        return kept[key]

    def guide_for(self, sampling: SamplingSpec) -> Guide | None:
        """The guide model ``sampling`` names (``None``: classifier-free guidance), loaded and checked on first use and
        kept for this transformer (:func:`moh_dit.sampling.guides.load_guide`)."""
        if sampling.guide is None:
            return None
        load = lambda: load_guide(sampling.guide, self.transformer, self.space.space)  # noqa: E731
        return self._kept("_guides", (id(self.transformer), sampling.guide), load)

    def lead_for(self, sampling: SamplingSpec) -> Lead | None:
        """The lead model ``sampling`` names for a hand-off (``None``: this model takes every step), loaded and checked
        on first use and kept for this transformer and scheduler (:func:`moh_dit.sampling.leads.load_lead`)."""
        name = self.objective.scheduler_name(self.scheduler)
        load = partial(load_lead, sampling.lead, self.transformer, self.space.space, self.scheduler, name)
        lead = self._kept("_leads", (id(self.transformer), name, sampling.lead), load) if sampling.lead else None
        said = partial(warn_if_not_its_lead, getattr(self, "trained_lead", None), lead, sampling.sampler.num_steps)
        self._kept("_lead_said", (id(self.transformer), sampling.lead, sampling.sampler.num_steps), said)  # once
        return lead

    def adopt_lead(self, lead: Lead) -> None:
        """Take ``lead``, loaded and checked already (a training run's frozen lead: the weights it trains after), where
        a spec names its spec at its scheduler, rather than load a second copy."""
        self._kept("_leads", (id(self.transformer), lead.scheduler_name, lead.spec), lambda: lead)

    def cache_for(self, sampling: SamplingSpec, guide: Guide | None = None) -> SamplingCache | None:
        """The sampling cache ``sampling`` names for this model (``None``: none), prepared once per transformer and
        spec (MagCache calibrates its ratios on the model: the same for every batch and process)."""
        if sampling.cache is None:
            return None
        key = (id(self.transformer), repr(sampling.record()), None if guide is None else guide.fingerprint)
        return self._kept("_caches", key, partial(prepared_cache, self, sampling, guide))

    # ------------------------------------------------------------------------------------------------
    # Sampling
    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(
        self,
        class_labels: int | str | Sequence[int | str] | None = None,
        guidance_scale: float = GRID_GUIDANCE,
        num_inference_steps: int = 250,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        num_images: int | None = None,
        guidance_channels: int | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        progress: bool = True,
        guidance_interval: Sequence[int] | None = None,
        grid_averaging: int | None = None,
        guidance_noise: Sequence[float] | None = None,
        time_shift: float = 1.0,
        sampling: SamplingSpec | None = None,
        guide: Guide | None = None,
    ):
        """Generate images.

        Args:
            class_labels: ids or names (one per image); ``None`` for unconditional models.
            guidance_scale: classifier-free guidance scale (1 = no guidance).
            num_inference_steps: number of sampling steps (250 is DiT's protocol).
            generator: torch generator(s) for the initial noise and the ancestral noise.
            latents: initial noise (N, C, H, W) instead of drawing it.
            num_images: batch size for unconditional models.
            guidance_channels: guide only the first this-many channels (3 reproduces the papers).
            guidance_interval: ``(first, last)`` training timesteps, inclusive: guide only the steps whose
                timestep lies inside, and take the conditional prediction alone elsewhere (one forward
                instead of two). ``None`` guides every step, as DiT does. Guidance at high noise narrows
                the classes' variety and at low noise sharpens artefacts; a middle interval avoids both
                (Kynkaenniemi et al. 2024, arXiv:2404.07724; docs/sampling.md).
            grid_averaging: a training timestep: every step at or below it averages the prediction over the
                patch grid's diagonal shifts (:func:`moh_dit.sampling.guidance.guided_output`; one forward of
                ``patch`` times the batch). At low noise this removes most of an undertrained model's patch seams at
                no cost in KID; at high noise the shifted copies are out of distribution (docs/sampling.md).
                ``None`` (default) averages nowhere.
            guidance_noise: ``(low, high)`` noise levels (noise std over signal std) guided instead of
                ``guidance_interval``: the same levels for every objective (docs/sampling.md).
            time_shift: flow models: shift the sampler's grid toward high noise (SD3's ``s -> shift s / (1 + (shift
                - 1) s)``); 1 (none) for DDPM models.
            sampling: a :class:`SamplingSpec` instead of the seven arguments above (its scheduler, when set,
                replaces the pipeline's).
            guide: autoguidance's guide model for the guide ``sampling`` names (default: loaded by
                :meth:`guide_for`); a :class:`~moh_dit.sampling.guides.Guide` of that spec.
            output_type: ``"pil"``, ``"np"`` (float in [0, 1], NHWC), ``"pt"`` (float in [-1, 1], NCHW),
                ``"uint8"`` (NHWC, ADM quantisation) or ``"latent"`` (the model's output before decoding).
        """
        transformer = self.transformer
        cfg = transformer.config
        if output_type not in ("pil", "np", "pt", "uint8", "latent"):
            raise ValueError(f"output_type must be pil, np, pt, uint8 or latent, got {output_type!r}")
        if sampling is None:  # the spec checks every value, once
            sampling = SamplingSpec.create(
                None,
                num_inference_steps,
                guidance_scale,
                guidance_interval,
                guidance_channels,
                grid_averaging,
                guidance_noise,
                time_shift,
            )
        else:
            self.use_sampling_scheduler(sampling)
        guide = self.check_sampling(sampling, decode=output_type != "latent", guide=guide)
        batch, labels = self._labels_and_batch(class_labels, num_images)

        device = self._execution_device
        shape = (batch, transformer.in_channels, cfg.sample_size, cfg.sample_size)
        if latents is None:
            latents = _randn(shape, generator, device)
        elif tuple(latents.shape) != shape:
            raise ValueError(f"latents must have shape {shape}, got {tuple(latents.shape)}")
        latents = latents.to(device=device, dtype=torch.float32)

        network = CachedNetwork(transformer, self.cache_for(sampling, guide))
        latents = self.denoise(latents, labels, sampling, generator, progress, network, guide, self.lead_for(sampling))

        if not torch.isfinite(latents).all():
            raise NonFiniteSampleError(
                "sampling produced NaN or infinite values: the weights are probably broken (a run stopped for a "
                "non-finite loss?) or the guidance scale is extreme"
            )
        result = latents if output_type == "latent" else self._images(latents, output_type)
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=result) if return_dict else (result,)

    def check_sampling(self, sampling: SamplingSpec, decode: bool = True, guide: Guide | None = None) -> Guide | None:
        """Whether ``sampling`` can draw from this pipeline's model, before anything is drawn or written (see
        :func:`moh_dit.sampling.checks.check_sampling`); returns the guide it names (``guide``, or the one
        :meth:`guide_for` loads)."""
        return check_sampling(self, sampling, decode, guide)

    def _labels_and_batch(
        self, class_labels: int | str | Sequence[int | str] | None, num_images: int | None
    ) -> tuple[int, torch.Tensor | None]:
        """The batch size and the label tensor (``None`` for an unconditional model), checked against the model."""
        transformer = self.transformer
        if transformer.config.num_classes > 0:
            if class_labels is None:
                raise ValueError("class_labels are required for a class-conditional model")
            label_ids = self.get_label_ids(class_labels)
            return len(label_ids), torch.tensor(label_ids, device=self._execution_device)
        if class_labels is not None:
            raise ValueError("this model is unconditional: pass num_images instead of class_labels")
        return num_images or 1, None

    def denoise(
        self,
        latents: torch.Tensor,
        labels: torch.Tensor | None,
        sampling: SamplingSpec,
        generator: torch.Generator | list[torch.Generator] | None = None,
        progress: bool = False,
        network: CachedNetwork | None = None,
        guide: Guide | None = None,
        lead: Lead | None = None,
    ) -> torch.Tensor:
        """The sampling loop: from noise ``latents`` to the model's output, guided as ``sampling`` says (away from
        ``guide``'s prediction where given). The objective puts the scheduler on its grid and says, at each call, the
        network's time input and the noise level (where guidance and grid averaging apply), and what the scheduler
        takes from the network's output. ``network`` runs the forwards (a sampling cache's; default: the
        transformer). ``lead``: a hand-off's lead model takes the grid's first steps, each through its own
        objective (:mod:`moh_dit.sampling.leads`)."""
        transformer, device, own = self.transformer, self._execution_device, self.objective
        sampler, guidance = sampling.sampler, sampling.guidance
        own.set_timesteps(self.scheduler, sampler.num_steps, sampler.time_shift, device)
        latents = latents * getattr(self.scheduler, "init_noise_sigma", 1.0)  # diffusers' flow schedulers have none
        steps = self.scheduler.timesteps
        # stochastic samplers draw their noise from the generator(s); deterministic ones take none
        step_kwargs = (
            {"generator": generator} if "generator" in inspect.signature(self.scheduler.step).parameters else {}
        )
        rule = make_rule(guidance.rule, guidance.options)  # a fresh one: APG's running average is this run's
        guide_net = None if guide is None else guide.model.to(transformer.device)
        # whose turn each step is: a hand-off's lead for its first steps, with its own scheduler on our grid, then ours
        turns = Turns((transformer, own, network, self.scheduler), lead, own, sampler, device)
        for index, t in enumerate(self.progress_bar(steps) if progress else steps):
            model, objective, net, scheduler = turns.at(index)
            model_in = objective.network_input(scheduler, latents, index, t)
            time, level = objective.step_time(scheduler, index, t)
            # by hand: diffusers' class-conditional DiTPipeline guides every step and has no interval option
            how = StepEvaluation(
                scale=guidance.scale if guidance.guided_at(level.sigma, level.timestep) else 1.0,
                channels=guidance.channels,
                rule=rule,
                step=index,
                average=sampler.averaged_at(level.sigma, level.timestep),
                guide=guide_net,
            )
            out = guided_output(model, model_in, time, labels, how, net)
            out = objective.scheduler_input(out, scheduler, transformer.in_channels, latents, index)
            latents = scheduler.step(out, t, latents, **step_kwargs).prev_sample
        return latents

    def _images(self, latents: torch.Tensor, output_type: str):
        """Decoded images in ``output_type`` (``pt``, ``uint8``, ``np`` or ``pil``)."""
        images = self.decode(latents)
        if not torch.isfinite(images).all():
            raise NonFiniteSampleError("the VAE decoded NaN or infinite values: its weights are probably broken")
        if output_type == "pt":
            return images
        if output_type == "uint8":
            return to_uint8(images)
        result = ((images.float() + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
        return self.numpy_to_pil(result) if output_type == "pil" else result

    @property
    def space(self) -> ImageSpace:
        """Pixels or the VAE's latents (see :class:`moh_dit.vae.ImageSpace`)."""
        return ImageSpace(self.vae)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images in [-1, 1] (identity in pixel space)."""
        return self.space.decode(latents)


def _randn(shape, generator, device) -> torch.Tensor:
    """Gaussian noise drawn on the CPU from the generator(s), so the same seed gives the same images on any
    device; a list of generators draws one image each."""
    if isinstance(generator, list):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for {shape[0]} images")
        return torch.cat([torch.randn((1, *shape[1:]), generator=g, device=g.device) for g in generator]).to(device)
    gen_device = generator.device if generator is not None else "cpu"
    return torch.randn(shape, generator=generator, device=gen_device).to(device)
