"""What a pipeline folder is, apart from the denoising loop: saving it (weights, manifest, model card, all
or nothing) and the policy for replacing its VAE with another decoder of the same latent space.

The functions take a :class:`~moh_dit.sampling.pipeline.MoHDiTPipeline` (its ``save`` and ``replace_vae`` call
them); they are typed with diffusers' base class so that this module does not import the one that imports it."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moh_dit.errors import ArtifactError, ConfigError
from moh_dit.files import atomic_folder
from moh_dit.manifests import fingerprint_module, format_differences, short, write_manifest
from moh_dit.sampling.card import QUALITY_CURVE_FILE, draw_quality_curve, write_card
from moh_dit.sampling.spec import SamplingSpec
from moh_dit.vae import latent_space_differences, latent_space_of

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline

__all__ = ["save_pipeline", "replace_vae"]

logger = logging.getLogger(__name__)


def save_pipeline(
    pipe: DiffusionPipeline,
    folder: str | os.PathLike,
    source: dict[str, Any],
    sampling: SamplingSpec | None = None,
) -> Path:
    """``save_pretrained`` (safetensors), a manifest of what the weights are (fingerprints) and where they
    came from (``source``: run, step, EMA or model weights, training settings, conversion), how they are
    meant to be sampled (``sampling``; default: the pipeline's ``preview_sampling``), and a model card
    (``README.md``, see ``moh_dit.sampling.card``). Written into a temporary folder and renamed, so the folder
    is the old or the new pipeline, never half of each."""
    folder = Path(folder)
    with atomic_folder(folder, "the pipeline") as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        manifest = write_manifest(
            tmp,
            "pipeline",
            source=source,
            transformer_sha256=fingerprint_module(pipe.transformer),
            vae_sha256=pipe.space.fingerprint(),
            latent_space=pipe.config.latent_space,
            id2label={str(k): v for k, v in pipe.id2label.items()},
            sampling=(sampling or pipe.preview_sampling).record(),
        )
        draw_quality_curve(source.get("training") or {}, tmp / QUALITY_CURVE_FILE)  # when it trained with evaluations
        write_card(tmp, pipe, manifest)  # README.md: what it is, how it was made, how to use it
    return folder


def replace_vae(
    pipe: DiffusionPipeline, vae: torch.nn.Module | None, spec: str, trained_with: dict | None = None
) -> None:
    """Decode with ``vae`` (``None``: no VAE) instead of the pipeline's own. It must decode the latents this
    model makes: the same number of channels and, when the autoencoder the model was trained with is known (the
    pipeline's own, or ``trained_with``: its :func:`moh_dit.vae.vae_record`), the same latent space: kind, scale,
    shift, per-channel statistics and downsampling (otherwise the images come out at the wrong scale, offset or
    size without any error). Other weights of the same latent space (DiT's ft-EMA against ft-MSE decoders)
    are a legitimate choice; the log says so, and sample manifests record the VAE's fingerprint."""
    if vae is not None:
        channels = pipe.transformer.config.in_channels
        if not pipe.config.get("latent_space", False):
            raise ConfigError(f"this model works in pixel space ({channels} channels): --vae {spec} does not apply")
        if vae.config.latent_channels != channels:
            raise ArtifactError(
                f"VAE {spec} makes {vae.config.latent_channels}-channel latents but this model works on "
                f"{channels}-channel latents: pass the VAE it was trained with"
            )
        if pipe.vae is not None:
            trained_with = dict(latent_space_of(pipe.vae), sha256=fingerprint_module(pipe.vae))
        if trained_with is not None:
            diffs = latent_space_differences(trained_with, latent_space_of(vae))
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
                    "same latent space)",
                    spec,
                    short(before),
                    short(after),
                )
    pipe.register_modules(vae=vae)
