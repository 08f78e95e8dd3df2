"""The VAE of latent diffusion: loading a diffusers ``AutoencoderKL`` (hub id or folder), the numbers that
define its latent space (channels, scaling factor, downsampling) and how two differ, and the posterior
the training data is encoded to.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL

from moh_dit.errors import ArtifactError, DataError, blame_the_file
from moh_dit.manifests import (
    fingerprint_module,
    format_differences,
)


# ----------------------------------------------------------------------------------------------------
# The VAE
# ----------------------------------------------------------------------------------------------------
def _looks_like_path(spec: str) -> bool:
    """A hub id is ``name`` or ``namespace/name``; anything absolute, relative (``./``, ``../``, ``~``) or
    deeper is a path on disk."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)


def resolve_vae_spec(spec: str | None) -> str | None:
    """``none`` -> ``None``; an existing local folder -> its absolute path (so a record stays valid from any
    working directory); a hub id -> as given. A path that does not exist is an error, not a hub lookup."""
    if spec is None or str(spec).strip().lower() in ("", "none"):
        return None
    path = Path(str(spec)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DataError(f"VAE path {path} is not a folder (expected a diffusers AutoencoderKL folder)")
        return str(path.resolve())
    if _looks_like_path(str(spec)):
        raise DataError(f"VAE folder {spec} does not exist")
    return str(spec)


def load_vae(
    spec: str | None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    local_only: bool = False,
):
    """``none`` -> None; a local folder (a VAE, or a pipeline with a ``vae/`` sub-folder) or a hub id such
    as ``stabilityai/sd-vae-ft-ema`` -> an ``AutoencoderKL`` in eval mode. Hub ids are looked up in the local
    cache first, so an offline machine that has the VAE cached does not wait on the network;
    ``local_only`` never goes to the network."""
    resolved = resolve_vae_spec(spec)
    if resolved is None:
        return None
    path = Path(resolved)

    def unreadable(err: BaseException) -> DataError:
        where = (
            "the folder is not a readable AutoencoderKL"
            if path.is_dir()
            else (
                f"it is not cached locally and could not be fetched from the hub; if you are offline, download it "
                f"elsewhere (`hf download {resolved}`) and pass the local folder"
            )
        )
        return DataError(f"could not load VAE {resolved}: {where} ({str(err).splitlines()[0]})")

    with blame_the_file(unreadable, (OSError, ValueError)):
        if path.is_dir():
            sub = "vae" if not (path / "config.json").exists() and (path / "vae" / "config.json").exists() else None
            vae = AutoencoderKL.from_pretrained(path, subfolder=sub, torch_dtype=dtype, use_safetensors=True)
        else:
            try:
                vae = AutoencoderKL.from_pretrained(resolved, torch_dtype=dtype, local_files_only=True)
            except (OSError, ValueError):
                if local_only:
                    raise
                vae = AutoencoderKL.from_pretrained(resolved, torch_dtype=dtype)
    return vae.to(device).eval().requires_grad_(False)


def latent_space(config: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers that decide how a VAE maps images to latents and back, besides its weights, from its
    config (``AutoencoderKL.config``, or the ``config.json`` it was saved with)."""
    return {
        "scaling_factor": float(config.get("scaling_factor", 0.18215)),
        "downsample_factor": 2 ** (len(config["block_out_channels"]) - 1),  # diffusers' VAE scale factor
        "latent_channels": int(config.get("latent_channels", 4)),
    }


def latent_space_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, recorded, current)`` for every latent-space number that differs; numbers the record does not
    hold are not compared."""
    return [
        (k, recorded.get(k), current[k])
        for k in ("scaling_factor", "downsample_factor", "latent_channels")
        if recorded.get(k) is not None and recorded.get(k) != current[k]
    ]


def vae_record(vae: AutoencoderKL, spec: str | None) -> dict:
    """What identifies a VAE for latents and pipelines: where it came from, its weights fingerprint, and
    the numbers that change the latent space (scaling factor, downsampling, channels)."""
    return {
        "spec": resolve_vae_spec(spec) if spec else None,
        "sha256": fingerprint_module(vae),
        **latent_space(vae.config),
    }


def check_vae(vae: AutoencoderKL, spec: str | None, record: dict, what: str) -> None:
    """Stop when ``vae`` is not the VAE described by ``record`` (weights, scaling factor, downsampling)."""
    mine = vae_record(vae, spec)
    diffs = (
        [("sha256", record["sha256"], mine["sha256"])] if record.get("sha256") not in (None, mine["sha256"]) else []
    )
    diffs += latent_space_differences(record, mine)
    if diffs:
        raise ArtifactError(
            f"VAE {mine['spec']} is not the VAE {what} was made with ({format_differences(diffs)}); "
            f"use the recorded VAE {record.get('spec')}"
        )


@torch.no_grad()
def encode_posterior(vae: AutoencoderKL, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Images in [-1, 1] (N, C, H, W) -> posterior mean and std (N, c, h, w), unscaled."""
    dist = vae.encode(images.to(vae.dtype)).latent_dist
    return dist.mean.float(), dist.std.float()


def sample_posterior(
    mean: torch.Tensor, std: torch.Tensor, scaling_factor: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A fresh draw from N(mean, std^2), times the VAE's scaling factor."""
    eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return (mean + std * eps) * scaling_factor


class ImageSpace:
    """The space the transformer works in: pixels (``vae=None``) or a VAE's latents. One interface for what
    differs between the two, instead of a branch on the VAE at every use: the model's clean input from
    images, images from the model's output, the pixels one latent covers, and the VAE's fingerprint."""

    def __init__(self, vae: AutoencoderKL | None = None) -> None:
        self.vae = vae

    @property
    def is_latent(self) -> bool:
        return self.vae is not None

    @property
    def scaling_factor(self) -> float:
        return 1.0 if self.vae is None else float(self.vae.config.scaling_factor)

    @property
    def downsample_factor(self) -> int:
        """Pixels per latent along each side (1 in pixel space)."""
        return 1 if self.vae is None else latent_space(self.vae.config)["downsample_factor"]

    def fingerprint(self) -> str | None:
        """The VAE's weights fingerprint (``None`` in pixel space)."""
        return None if self.vae is None else fingerprint_module(self.vae)

    def encode(self, images: torch.Tensor, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """Images in [-1, 1] on ``device`` -> the model's clean input: the images, or a draw from the VAE's
        posterior (noise from ``generator``, on the CPU, so a draw is the same on any device) times its
        scaling factor."""
        if self.vae is None:
            return images
        mean, std = encode_posterior(self.vae, images)
        eps = torch.randn(mean.shape, generator=generator).to(device)
        return (mean + std * eps) * self.scaling_factor

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output -> images in [-1, 1] (the identity in pixel space)."""
        if self.vae is None:
            return x
        return self.vae.decode((x / self.scaling_factor).to(self.vae.dtype)).sample.float()
