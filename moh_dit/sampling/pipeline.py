"""``MoHDiTPipeline``: class-conditional sampling with classifier-free guidance.

A diffusers ``DiffusionPipeline`` holding the transformer, a scheduler, an optional ``AutoencoderKL``
(latent diffusion; ``None`` for pixel space) and ``id2label`` in its saved config. It differs from
diffusers' ``DiTPipeline`` where that one breaks DiT's protocol: the null class is the model's own
``num_classes`` (not a hard-coded 1000), the learned variance channels reach ``DDPMScheduler.step``
(so ``variance_type="learned_range"`` works), and fast solvers receive only the noise channels.

    pipe = MoHDiTPipeline.from_pretrained("runs/fmnist/pipeline")
    images = pipe(["Sneaker", "Bag"], guidance_scale=4.0, num_inference_steps=250).images"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    DiffusionPipeline,
    ImagePipelineOutput,
)
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from moh_dit.errors import ArtifactError, ConfigError, NonFiniteSampleError
from moh_dit.files import replace_folder
from moh_dit.manifests import fingerprint_module, format_differences, read_manifest, short, write_manifest
from moh_dit.model.network import MoHDiT
from moh_dit.sampling.card import write_card
from moh_dit.sampling.options import (
    FAST_SCHEDULER,
    FAST_STEPS,
    GRID_GUIDANCE,
    SCHEDULERS,
    check_grid_averaging,
    check_guidance_interval,
)
from moh_dit.sampling.schedulers import make_scheduler
from moh_dit.seeding import index_generator
from moh_dit.vae import latent_space, latent_space_differences

logger = logging.getLogger(__name__)


def sampling_record(
    guidance_scale: float = GRID_GUIDANCE,
    guidance_interval: Optional[Sequence[int]] = None,
    scheduler: str = FAST_SCHEDULER,
    num_inference_steps: int = FAST_STEPS,
    grid_averaging: Optional[int] = None,
) -> dict[str, Any]:
    """How a model is meant to be looked at (its run's preview grids), as a pipeline's manifest records it
    under ``sampling``; ``sample.py`` and the demo start from it."""
    interval = check_guidance_interval(guidance_interval)
    grid_averaging = check_grid_averaging(grid_averaging)
    if not math.isfinite(guidance_scale) or scheduler not in SCHEDULERS or num_inference_steps < 1:
        raise ConfigError(
            f"not a sampling setting: guidance {guidance_scale}, scheduler {scheduler!r}, {num_inference_steps} steps"
        )
    return {
        "guidance_scale": float(guidance_scale),
        "guidance_interval": list(interval) if interval else None,
        "scheduler": scheduler,
        "num_inference_steps": int(num_inference_steps),
        "grid_averaging": grid_averaging,
    }


def check_sampling_record(record: Optional[dict]) -> Optional[dict]:
    """A recorded ``sampling`` (from a manifest or a run's config) in :func:`sampling_record`'s form, or
    ``None``; a damaged one is an :class:`ArtifactError`."""
    if not record:
        return None
    try:
        return sampling_record(**record)
    except (TypeError, ConfigError) as err:
        raise ArtifactError(f"the model's recorded sampling {record!r} is not valid ({err})") from None


def guided_at(t: Union[int, torch.Tensor], interval: Optional[Sequence[int]]) -> bool:
    """Whether guidance applies at timestep ``t``: everywhere without an interval, else inside it."""
    if interval is None:
        return True
    return interval[0] <= int(t) <= interval[1]


def grid_shifts(patch: int) -> list[int]:
    """The diagonal shifts ``(s, s)`` of the input that grid averaging runs the denoiser on: one for each
    offset of the patch grid (0 .. patch - 1 pixels), each as the roll that moves the content least
    (``-patch / 2 < s <= patch / 2``): ``[0, 1, 2, -1]`` for patch 4, ``[0, 1]`` for patch 2."""
    return [k - patch if k > patch // 2 else k for k in range(patch)]


def resolve_class_labels(
    labels: Union[int, str, Sequence[Union[int, str]]], num_classes: int, id2label: Optional[dict[int, str]] = None
) -> list[int]:
    """Class ids or names (case-insensitive; a single one too) -> ids, with clear errors."""
    if isinstance(labels, (int, str, np.integer)):
        labels = [labels]
    if isinstance(labels, torch.Tensor):
        labels = labels.tolist()
    id2label = id2label or {}
    exact = {v: k for k, v in id2label.items()}
    folded: dict[str, list[int]] = {}
    for k, v in id2label.items():
        folded.setdefault(v.lower(), []).append(k)
    ids = []
    for label in labels:
        if isinstance(label, str) and not label.strip().lstrip("-").isdigit():
            key = label.strip()
            if key in exact:
                ids.append(exact[key])
                continue
            matches = folded.get(key.lower(), [])
            if len(matches) > 1:  # e.g. ImageNet's "Cardigan" (a dog) and "cardigan" (a sweater)
                options = ", ".join(f"{id2label[i]!r} = {i}" for i in matches)
                raise ValueError(f"class name {label!r} is ambiguous ({options}): use the exact name or the id")
            if not matches:
                close = difflib.get_close_matches(key.lower(), list(folded), n=3, cutoff=0.6)
                hint = f"; did you mean {', '.join(repr(id2label[folded[c][0]]) for c in close)}?" if close else ""
                shown = ", ".join(repr(v) for v in list(id2label.values())[:12])
                more = f" ... ({len(id2label)} in all)" if len(id2label) > 12 else ""
                known = f"known classes: {shown}{more}" if id2label else "this model has no class names"
                raise ValueError(f"unknown class name {label!r}{hint} ({known})")
            ids.append(matches[0])
            continue
        idx = int(label)
        if not 0 <= idx < num_classes:
            raise ValueError(f"class id {idx} is out of range: this model has classes 0..{num_classes - 1}")
        ids.append(idx)
    return ids


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
        vae: ``AutoencoderKL`` for latent models, ``None`` for pixel-space models.
        id2label: class id -> name, saved with the pipeline.
    """

    model_cpu_offload_seq = "transformer->vae"
    _optional_components = ["vae"]

    def __init__(
        self,
        transformer: MoHDiT,
        scheduler: SchedulerMixin,
        vae: Optional[AutoencoderKL] = None,
        id2label: Optional[dict] = None,
        latent_space: Optional[bool] = None,
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
        vae: Optional[AutoencoderKL] = None,
        id2label: Optional[dict] = None,
        scheduler: str = "ddpm",
        latent_space: Optional[bool] = None,
    ) -> "MoHDiTPipeline":
        """The one way moh-dit assembles a pipeline: a model (put in eval mode), an optional VAE, class
        names, and a scheduler by name for the model's variance type (DiT's DDPM by default)."""
        return cls(
            transformer.eval(), make_scheduler(scheduler, transformer.config.learn_sigma), vae, id2label, latent_space
        )

    def save(self, folder: str | os.PathLike, source: dict[str, Any], sampling: Optional[dict] = None) -> Path:
        """``save_pretrained`` (safetensors), a manifest of what the weights are (fingerprints) and where they
        came from (``source``: run, step, EMA or model weights, training settings, conversion), how they are
        meant to be sampled (``sampling``, see :func:`sampling_record`; default: :attr:`preview_sampling`),
        and a model card (``README.md``, see ``moh_dit.sampling.card``). Written into a temporary
        folder and renamed, so the folder is the old or the new pipeline, never half of each."""
        folder = Path(folder)
        tmp = folder.with_name(f".tmp-{folder.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        self.save_pretrained(tmp, safe_serialization=True)
        manifest = write_manifest(
            tmp,
            "pipeline",
            source=source,
            transformer_sha256=fingerprint_module(self.transformer),
            vae_sha256=fingerprint_module(self.vae) if self.vae is not None else None,
            latent_space=self.config.latent_space,
            id2label={str(k): v for k, v in self.id2label.items()},
            sampling=sampling or self.preview_sampling,
        )
        write_card(tmp, self, manifest)  # README.md: what it is, how it was made, how to use it
        replace_folder(tmp, folder)
        return folder

    @staticmethod
    def manifest_of(folder: str | os.PathLike) -> Optional[dict]:
        return read_manifest(folder, "pipeline")

    @property
    def preview_sampling(self) -> dict[str, Any]:
        """The guidance (scale and interval), scheduler and steps this model's run drew its previews with,
        as recorded with its weights (``load_pipeline`` reads it); the package's grid defaults for a model
        without a record."""
        return getattr(self, "recorded_sampling", None) or sampling_record()

    def set_preview_sampling(self, record: Optional[dict]) -> None:
        """Adopt a recorded ``sampling`` (checked; ``None`` keeps the package defaults)."""
        self.recorded_sampling = check_sampling_record(record)

    @property
    def patch_pixels(self) -> int:
        """The side of one transformer patch in output pixels (the patch times the VAE's down-sampling)."""
        patch = self.transformer.config.patch_size
        if self.vae is None:
            return patch
        return patch * latent_space(self.vae.config)["downsample_factor"]

    @property
    def id2label(self) -> dict[int, str]:
        return {int(k): v for k, v in (self.config.id2label or {}).items()}

    @property
    def labels(self) -> dict[str, int]:
        """Class name -> id."""
        return {v: k for k, v in self.id2label.items()}

    def get_label_ids(self, labels: Union[int, str, Sequence[Union[int, str]]]) -> list[int]:
        return resolve_class_labels(labels, self.transformer.config.num_classes, self.id2label)

    def replace_vae(self, vae: Optional[AutoencoderKL], spec: str, trained_with: Optional[dict] = None) -> None:
        """Decode with ``vae`` (``None``: no VAE) instead of the pipeline's own. It must decode the latents
        this model makes: the same number of channels and, when the VAE the model was trained with is known
        (the pipeline's own, or ``trained_with``: a record with its ``scaling_factor``, ``downsample_factor``
        and ``sha256``), the same scaling factor and downsampling (otherwise the images come out at the wrong
        scale or size without any error). Other weights of the same latent space (DiT's ft-EMA against
        ft-MSE decoders) are a legitimate choice; the log says so, and sample manifests record the VAE's
        fingerprint."""
        if vae is not None:
            channels = self.transformer.config.in_channels
            if not self.config.get("latent_space", False):
                raise ConfigError(
                    f"this model works in pixel space ({channels} channels): --vae {spec} does not apply"
                )
            if vae.config.latent_channels != channels:
                raise ArtifactError(
                    f"VAE {spec} makes {vae.config.latent_channels}-channel latents but this model works on "
                    f"{channels}-channel latents: pass the VAE it was trained with"
                )
            if self.vae is not None:
                trained_with = dict(latent_space(self.vae.config), sha256=fingerprint_module(self.vae))
            if trained_with is not None:
                diffs = latent_space_differences(trained_with, latent_space(vae.config))
                if diffs:
                    raise ArtifactError(
                        f"VAE {spec} is not in the latent space this model was trained in "
                        f"({format_differences(diffs)}): its images would come out at the wrong scale or size; "
                        f"pass a VAE with the same numbers"
                    )
                before, after = trained_with.get("sha256"), fingerprint_module(vae)
                if before != after:
                    logger.info(
                        "decoding with VAE %s instead of the one the model was trained with (fingerprint %s -> %s; "
                        "same scaling factor and downsampling)",
                        spec,
                        short(before),
                        short(after),
                    )
        self.register_modules(vae=vae)

    def with_scheduler(self, name: str) -> "MoHDiTPipeline":
        """Swap in one of :data:`SCHEDULERS` (in place); returns the pipeline."""
        self.scheduler = make_scheduler(name, self.transformer.config.learn_sigma)
        return self

    # ------------------------------------------------------------------------------------------------
    # One denoising evaluation with guidance
    # ------------------------------------------------------------------------------------------------
    def guided_model_output(
        self,
        latents: torch.Tensor,
        t: torch.Tensor,
        labels: Optional[torch.Tensor],
        guidance_scale: float,
        guidance_channels: Optional[int] = None,
        grid_average: bool = False,
    ) -> torch.Tensor:
        """Model output for ``latents`` at timestep ``t``, guided towards ``labels``.

        Conditional and unconditional halves run in one batched forward. Guidance mixes the noise
        prediction ``eps_u + s (eps_c - eps_u)`` on the first ``guidance_channels`` channels (all by
        default; 3 reproduces the reference code); the variance channels come from the conditional half.

        ``grid_average``: run the denoiser on copies of the input rolled diagonally by each of
        :func:`grid_shifts`, roll each prediction back and average them. The transformer predicts every
        patch from its own token, so where it is imprecise its errors meet at the patch grid's lines as
        faint seams; each copy puts its grid's lines elsewhere on the image, and the average leaves no
        line stronger than the rest. The copies run in the same batched forward.
        """
        if not grid_average:
            return self._guided_forward(latents, t, labels, guidance_scale, guidance_channels)
        shifts = grid_shifts(self.transformer.config.patch_size)
        copies = torch.cat([torch.roll(latents, (s, s), dims=(2, 3)) for s in shifts])  # (S*N, C, H, W)
        repeat = None if labels is None else labels.repeat(len(shifts))
        out = self._guided_forward(
            copies, t if t.ndim == 0 else t.repeat(len(shifts)), repeat, guidance_scale, guidance_channels
        )
        back = [torch.roll(o, (-s, -s), dims=(2, 3)) for o, s in zip(out.chunk(len(shifts)), shifts)]
        return torch.stack(back).mean(dim=0)  # (N, C', H, W)

    def _guided_forward(
        self,
        latents: torch.Tensor,
        t: torch.Tensor,
        labels: Optional[torch.Tensor],
        guidance_scale: float,
        guidance_channels: Optional[int],
    ) -> torch.Tensor:
        """One batched forward of the conditional and unconditional halves, mixed (see above)."""
        transformer = self.transformer
        c = transformer.in_channels
        do_cfg = guidance_scale != 1.0 and labels is not None
        model_in = torch.cat([latents, latents]) if do_cfg else latents
        timesteps = t.expand(model_in.shape[0]) if t.ndim == 0 else t
        y = None
        if labels is not None:
            y = torch.cat([labels, torch.full_like(labels, transformer.null_class_id)]) if do_cfg else labels
        out = transformer(model_in.to(transformer.dtype), timesteps, y).sample.float()
        if not do_cfg:
            return out
        cond, uncond = out.chunk(2)
        g = c if guidance_channels is None else guidance_channels
        eps_c, eps_u = cond[:, :c], uncond[:, :c]
        guided = eps_c.clone()
        guided[:, :g] = eps_u[:, :g] + guidance_scale * (eps_c[:, :g] - eps_u[:, :g])
        return torch.cat([guided, cond[:, c:]], dim=1)

    # ------------------------------------------------------------------------------------------------
    # Sampling
    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(
        self,
        class_labels: Union[int, str, Sequence[Union[int, str]], None] = None,
        guidance_scale: float = GRID_GUIDANCE,
        num_inference_steps: int = 250,
        generator: Optional[Union[torch.Generator, list[torch.Generator]]] = None,
        latents: Optional[torch.Tensor] = None,
        num_images: Optional[int] = None,
        guidance_channels: Optional[int] = None,
        output_type: str = "pil",
        return_dict: bool = True,
        progress: bool = True,
        guidance_interval: Optional[Sequence[int]] = None,
        grid_averaging: Optional[int] = None,
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
                patch grid's diagonal shifts (see :meth:`guided_model_output`; one forward of ``patch`` times
                the batch). At low noise this removes most of an undertrained model's patch seams at no cost
                in KID; at high noise the shifted copies are out of distribution (docs/sampling.md).
                ``None`` (default) averages nowhere.
            output_type: ``"pil"``, ``"np"`` (float in [0, 1], NHWC), ``"pt"`` (float in [-1, 1], NCHW),
                ``"uint8"`` (NHWC, ADM quantisation) or ``"latent"`` (the model's output before decoding).
        """
        transformer = self.transformer
        cfg = transformer.config
        if output_type not in ("pil", "np", "pt", "uint8", "latent"):
            raise ValueError(f"output_type must be pil, np, pt, uint8 or latent, got {output_type!r}")
        if not math.isfinite(guidance_scale):
            raise ConfigError(f"guidance_scale must be a finite number, got {guidance_scale}")
        max_steps = self.scheduler.config.num_train_timesteps
        if not isinstance(num_inference_steps, int) or not 1 <= num_inference_steps <= max_steps:
            raise ConfigError(
                f"num_inference_steps must be an integer between 1 and {max_steps}, got {num_inference_steps!r}"
            )
        if output_type != "latent" and self.vae is None and self.config.get("latent_space", False):
            raise ConfigError(
                f"this model generates {transformer.in_channels}-channel latents and the pipeline has no VAE to decode "
                f"them: pass the VAE it was trained with (--vae / vae=...), or output_type='latent'"
            )
        if cfg.num_classes > 0:
            if class_labels is None:
                raise ValueError("class_labels are required for a class-conditional model")
            label_ids = self.get_label_ids(class_labels)
            batch = len(label_ids)
            labels = torch.tensor(label_ids, device=self._execution_device)
            if guidance_scale != 1.0 and transformer.null_class_id is None:
                raise ValueError(
                    "this model was trained without label dropout: it has no null class, use guidance_scale=1"
                )
        else:
            if class_labels is not None:
                raise ValueError("this model is unconditional: pass num_images instead of class_labels")
            batch, labels = num_images or 1, None
        if guidance_channels is not None and not 1 <= guidance_channels <= transformer.in_channels:
            raise ValueError(f"guidance_channels must be between 1 and {transformer.in_channels}")
        guidance_interval = check_guidance_interval(guidance_interval, max_steps)
        grid_averaging = check_grid_averaging(grid_averaging, max_steps)

        device = self._execution_device
        shape = (batch, transformer.in_channels, cfg.sample_size, cfg.sample_size)
        if latents is None:
            latents = _randn(shape, generator, device)
        elif tuple(latents.shape) != shape:
            raise ValueError(f"latents must have shape {shape}, got {tuple(latents.shape)}")
        latents = latents.to(device=device, dtype=torch.float32)

        self.scheduler.set_timesteps(num_inference_steps, device=device)
        latents = latents * self.scheduler.init_noise_sigma
        keep_variance = isinstance(self.scheduler, DDPMScheduler) and self.scheduler.config.variance_type in (
            "learned",
            "learned_range",
        )
        steps = self.scheduler.timesteps
        # stochastic samplers draw their noise from the generator(s); deterministic ones take none
        step_kwargs = (
            {"generator": generator} if "generator" in inspect.signature(self.scheduler.step).parameters else {}
        )
        for t in self.progress_bar(steps) if progress else steps:
            model_in = self.scheduler.scale_model_input(latents, t)
            # by hand: diffusers' class-conditional DiTPipeline guides every step and has no interval option
            scale = guidance_scale if guided_at(t, guidance_interval) else 1.0
            average = grid_averaging is not None and int(t) <= grid_averaging
            out = self.guided_model_output(model_in, t, labels, scale, guidance_channels, average)
            if not keep_variance:
                out = out[:, : transformer.in_channels]  # fast solvers take the noise prediction only
            latents = self.scheduler.step(out, t, latents, **step_kwargs).prev_sample

        if not torch.isfinite(latents).all():
            raise NonFiniteSampleError(
                "sampling produced NaN or infinite values: the weights are probably broken (a run stopped for a "
                "non-finite loss?) or the guidance scale is extreme"
            )
        if output_type == "latent":
            self.maybe_free_model_hooks()
            return ImagePipelineOutput(images=latents) if return_dict else (latents,)
        images = self.decode(latents)
        if not torch.isfinite(images).all():
            raise NonFiniteSampleError("the VAE decoded NaN or infinite values: its weights are probably broken")
        if output_type == "pt":
            result = images
        elif output_type == "uint8":
            result = to_uint8(images)
        else:
            result = ((images.float() + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
            if output_type == "pil":
                result = self.numpy_to_pil(result)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (result,)
        return ImagePipelineOutput(images=result)

    def sample_grid(
        self,
        class_labels: Sequence[Union[int, str]],
        per_class: int,
        seed: int,
        guidance_scale: float,
        num_inference_steps: int,
        guidance_channels: Optional[int] = None,
        batch_size: int = 64,
        guidance_interval: Optional[Sequence[int]] = None,
        grid_averaging: Optional[int] = None,
    ) -> tuple[np.ndarray, Optional[list[str]]]:
        """``per_class`` uint8 images of every requested class, one row per class, for previews and
        ``sample.py``; image ``i`` draws its noise from ``(seed, i)``. Returns the images and row names."""
        conditional = self.transformer.config.num_classes > 0
        ids = self.get_label_ids(class_labels) if conditional else [None]
        labels = [c for c in ids for _ in range(per_class)]
        out = []
        for b in range(0, len(labels), batch_size):
            chunk = labels[b : b + batch_size]
            gens = [index_generator(seed, b + j) for j in range(len(chunk))]
            kwargs = dict(class_labels=chunk) if conditional else dict(num_images=len(chunk))
            out.append(
                self(
                    **kwargs,
                    guidance_scale=guidance_scale if conditional else 1.0,
                    num_inference_steps=num_inference_steps,
                    generator=gens,
                    guidance_channels=guidance_channels,
                    output_type="uint8",
                    progress=False,
                    guidance_interval=guidance_interval,
                    grid_averaging=grid_averaging,
                ).images
            )
        names = [self.id2label.get(c, str(c)) for c in ids] if conditional else None
        return np.concatenate(out), names

    def save_grid(
        self,
        path: str | os.PathLike,
        per_class: int,
        seed: int,
        guidance_scale: float,
        num_inference_steps: int,
        max_classes: Optional[int] = None,
        guidance_interval: Optional[Sequence[int]] = None,
        grid_averaging: Optional[int] = None,
    ) -> Path:
        """A labelled PNG grid of the first ``max_classes`` classes (training previews)."""
        from moh_dit.images import make_grid

        classes = list(
            range(min(self.transformer.config.num_classes, max_classes or self.transformer.config.num_classes))
        )
        images, names = self.sample_grid(
            classes,
            per_class,
            seed,
            guidance_scale,
            num_inference_steps,
            guidance_interval=guidance_interval,
            grid_averaging=grid_averaging,
        )
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        make_grid(images, ncols=per_class, row_labels=names).save(path)
        return path

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images in [-1, 1] (identity in pixel space)."""
        if self.vae is None:
            return latents
        scaled = latents / self.vae.config.scaling_factor
        return self.vae.decode(scaled.to(self.vae.dtype)).sample.float()


def _randn(shape, generator, device) -> torch.Tensor:
    """Gaussian noise drawn on the CPU from the generator(s), so the same seed gives the same images on any
    device; a list of generators draws one image each."""
    if isinstance(generator, list):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for {shape[0]} images")
        return torch.cat([torch.randn((1, *shape[1:]), generator=g, device=g.device) for g in generator]).to(device)
    gen_device = generator.device if generator is not None else "cpu"
    return torch.randn(shape, generator=generator, device=gen_device).to(device)
