"""The autoencoder of latent diffusion: loading one (hub id or folder), the numbers that define its latent space and how
two differ, its posterior, and the normalisation that maps its latents to the model's.

Any diffusers autoencoder with ``encode`` and ``decode`` works: ``AutoencoderKL`` (SD, SDXL, SD3, Flux: a Gaussian
posterior), ``AutoencoderDC`` (deep compression, deterministic), and others diffusers has by class name
(``AutoencoderTiny``, ...). The latent space of a run is defined by the autoencoder's weights and these numbers:

- ``kind``: the diffusers class;
- ``scaling_factor`` and ``shift_factor`` (SD3 / Flux): ``z = (latent - shift) * scale``;
- ``latents_mean`` / ``latents_std`` per channel (SDXL-style configs): ``z = (latent - mean) * scale / std``;
- ``downsample_factor`` (pixels per latent along a side) and ``latent_channels``.

Records made before the shift and the per-channel statistics existed hold only the scale: the others read as
"not applied", which is what those versions did.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moh_dit.errors import ArtifactError, ConfigError, DataError, blame_the_file
from moh_dit.manifests import (
    fingerprint_module,
    format_differences,
)

# what a record that predates a key means by its absence (moh-dit 0.3 recorded only the first three numbers)
SPACE_DEFAULTS: dict[str, Any] = {
    "kind": "AutoencoderKL",
    "shift_factor": None,
    "latents_mean": None,
    "latents_std": None,
}
SPACE_KEYS = (
    "kind",
    "scaling_factor",
    "shift_factor",
    "latents_mean",
    "latents_std",
    "downsample_factor",
    "latent_channels",
)


# ----------------------------------------------------------------------------------------------------
# Where an autoencoder comes from
# ----------------------------------------------------------------------------------------------------
def _looks_like_path(spec: str) -> bool:
    """A hub id is ``name`` or ``namespace/name`` (optionally ``:subfolder``); anything absolute, relative (``./``,
    ``../``, ``~``) or deeper is a path on disk."""
    spec = spec.split(":", 1)[0]
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)


def resolve_vae_spec(spec: str | None) -> str | None:
    """``none`` -> ``None``; an existing local folder -> its absolute path (so a record stays valid from any
    working directory); a hub id (``namespace/name``, or ``namespace/name:vae`` for a pipeline repository's
    autoencoder sub-folder) -> as given. A path that does not exist is an error, not a hub lookup."""
    if spec is None or str(spec).strip().lower() in ("", "none"):
        return None
    path = Path(str(spec)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DataError(f"VAE path {path} is not a folder (expected a diffusers autoencoder folder)")
        return str(path.resolve())
    if _looks_like_path(str(spec)):
        raise DataError(f"VAE folder {spec} does not exist")
    return str(spec)


def _check_autoencoder(model: Any, where: str) -> Any:
    if not (hasattr(model, "encode") and hasattr(model, "decode") and "latent_channels" in model.config):
        raise DataError(
            f"{where} holds a {type(model).__name__}, not an autoencoder (encode, decode, latent_channels)"
        )
    return model


def load_vae(
    spec: str | None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    local_only: bool = False,
):
    """``none`` -> None; a local folder (an autoencoder, or a pipeline with a ``vae/`` sub-folder) or a hub id such
    as ``stabilityai/sd-vae-ft-ema``, ``mit-han-lab/dc-ae-f32c32-in-1.0-diffusers`` or
    ``stabilityai/stable-diffusion-3.5-medium:vae`` -> the autoencoder (the class its config names, through
    diffusers' ``AutoModel``) in eval mode. Hub ids are looked up in the local cache first, so an offline machine
    that has it cached does not wait on the network; ``local_only`` never goes to the network."""
    from diffusers import AutoModel

    resolved = resolve_vae_spec(spec)
    if resolved is None:
        return None
    path = Path(resolved)
    repo, _, subfolder = (resolved, "", "") if path.is_dir() else resolved.partition(":")

    def unreadable(err: BaseException) -> DataError:
        where = (
            "the folder is not a readable diffusers autoencoder"
            if path.is_dir()
            else (
                f"it is not cached locally and could not be fetched from the hub; if you are offline, download it "
                f"elsewhere (`hf download {repo}`) and pass the local folder"
            )
        )
        return DataError(f"could not load VAE {resolved}: {where} ({str(err).splitlines()[0]})")

    with blame_the_file(unreadable, (OSError, ValueError)):
        if path.is_dir():
            sub = "vae" if not (path / "config.json").exists() and (path / "vae" / "config.json").exists() else None
            vae = AutoModel.from_pretrained(str(path), subfolder=sub, torch_dtype=dtype, use_safetensors=True)
        else:
            kwargs = dict(subfolder=subfolder or None, torch_dtype=dtype)
            try:
                vae = AutoModel.from_pretrained(repo, local_files_only=True, **kwargs)
            except (OSError, ValueError):
                if local_only:
                    raise
                vae = AutoModel.from_pretrained(repo, **kwargs)
    return _check_autoencoder(vae, resolved).to(device).eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------------
# The latent space
# ----------------------------------------------------------------------------------------------------
def _floats(values: Sequence[float] | None) -> list[float] | None:
    return None if values is None else [float(v) for v in values]


def _downsample_factor(config: Mapping[str, Any]) -> int:
    """Pixels per latent along each side, from the config: diffusers' own rule, 2 ** (levels - 1), over the
    encoder's levels (``block_out_channels`` for AutoencoderKL, ``encoder_block_out_channels`` for AutoencoderDC
    and AutoencoderTiny)."""
    for key in ("block_out_channels", "encoder_block_out_channels"):
        if config.get(key):
            return 2 ** (len(config[key]) - 1)
    raise ArtifactError(
        "the autoencoder's config names no encoder levels (block_out_channels): its downsampling is unknown"
    )


def latent_space(config: Mapping[str, Any], kind: str | None = None) -> dict[str, Any]:
    """The numbers that decide how an autoencoder maps images to the model's latents and back, besides its weights,
    from its config (``vae.config``, or the ``config.json`` it was saved with, whose ``_class_name`` is the kind)."""
    kind = kind or config.get("_class_name") or "AutoencoderKL"
    default_scale = 0.18215 if kind == "AutoencoderKL" else 1.0  # the classes' own defaults
    space = {
        "kind": kind,
        "scaling_factor": float(config.get("scaling_factor", default_scale)),
        "shift_factor": None if config.get("shift_factor") is None else float(config["shift_factor"]),
        "latents_mean": _floats(config.get("latents_mean")),
        "latents_std": _floats(config.get("latents_std")),
        "downsample_factor": _downsample_factor(config),
        "latent_channels": int(config.get("latent_channels", 4)),
    }
    LatentNormalization.of(space)  # an autoencoder whose numbers contradict each other stops here
    return space


def latent_space_of(vae) -> dict[str, Any]:
    """:func:`latent_space` of a loaded autoencoder (its class is the kind)."""
    return latent_space(vae.config, type(vae).__name__)


def space_of(record: Mapping[str, Any]) -> dict[str, Any]:
    """A latent-space record with every key, those it predates read as not applied (:data:`SPACE_DEFAULTS`)."""
    return {k: record.get(k, SPACE_DEFAULTS.get(k)) for k in SPACE_KEYS}


def latent_space_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, recorded, current)`` for every latent-space number that differs. A record that predates the kind,
    the shift or the per-channel statistics means "AutoencoderKL, none applied"; the scale, downsampling and
    channels are compared where the record holds them."""
    mine, theirs = space_of(recorded), space_of(current)
    return [
        (k, mine[k], theirs[k])
        for k in SPACE_KEYS
        if (k in SPACE_DEFAULTS or recorded.get(k) is not None) and mine[k] != theirs[k]
    ]


@dataclass(frozen=True)
class LatentNormalization:
    """How the autoencoder's latents become the model's and back: ``z = (latent - offset) * scale / std``, where
    the offset is the scalar ``shift_factor`` or the per-channel ``latents_mean`` (with ``latents_std``), and
    decoding inverts it. Without a shift or statistics it is the scale alone, computed exactly as before they
    existed (so older runs give the same numbers bit for bit)."""

    scale: float = 1.0
    shift: float | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @classmethod
    def of(cls, space: Mapping[str, Any] | None) -> LatentNormalization:
        """The normalisation of a latent-space record (``None``: pixel space, the identity)."""
        if space is None:
            return cls()
        space = space_of(space)
        mean, std = space["latents_mean"], space["latents_std"]
        if (mean is None) != (std is None):
            raise ConfigError("an autoencoder config gives latents_mean without latents_std (or the reverse)")
        if mean is not None and space["shift_factor"] is not None:
            raise ConfigError(
                "an autoencoder config gives both shift_factor and latents_mean: which to subtract is ambiguous"
            )
        if mean is not None and not len(mean) == len(std) == space["latent_channels"]:
            raise ConfigError(
                f"latents_mean / latents_std have {len(mean)} / {len(std)} values for {space['latent_channels']} channels"
            )
        return cls(
            float(space["scaling_factor"]),
            space["shift_factor"],
            None if mean is None else tuple(mean),
            None if std is None else tuple(std),
        )

    def describe(self) -> str:
        """The map from the autoencoder's latents x to the model's z, as a formula."""
        if self.mean is not None:
            return f"z = (x - latents_mean) * {self.scale:g} / latents_std, per channel"
        if self.shift is not None:
            return f"z = (x - {self.shift:g}) * {self.scale:g}"
        return f"z = x * {self.scale:g}"

    def _per_channel(self, values: tuple[float, ...], z: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=z.dtype, device=z.device).reshape(1, -1, 1, 1)

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The autoencoder's latents (N, c, h, w) -> the model's."""
        if self.mean is not None:
            return (
                (latents - self._per_channel(self.mean, latents)) * self.scale / self._per_channel(self.std, latents)
            )
        if self.shift is not None:
            return (latents - self.shift) * self.scale
        return latents * self.scale

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """The model's latents -> the autoencoder's (what its decoder takes)."""
        if self.mean is not None:
            return z * self._per_channel(self.std, z) / self.scale + self._per_channel(self.mean, z)
        if self.shift is not None:
            return z / self.scale + self.shift
        return z / self.scale


def vae_record(vae, spec: str | None) -> dict:
    """What identifies an autoencoder for latents and pipelines: where it came from, its weights fingerprint, and
    the numbers that define the latent space (:func:`latent_space`)."""
    return {
        "spec": resolve_vae_spec(spec) if spec else None,
        "sha256": fingerprint_module(vae),
        **latent_space_of(vae),
    }


def check_vae(vae, spec: str | None, record: dict, what: str) -> None:
    """Stop when ``vae`` is not the autoencoder described by ``record`` (weights or any latent-space number)."""
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


# ----------------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def encode_posterior(vae, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Images in [-1, 1] (N, C, H, W) -> the posterior's mean and std (N, c, h, w), not normalised; the std is
    ``None`` for a deterministic encoder (AutoencoderDC, AutoencoderTiny), whose latent is the mean."""
    out = vae.encode(images.to(vae.dtype))
    dist = getattr(out, "latent_dist", None)
    if dist is not None:
        return dist.mean.float(), dist.std.float()
    latent = getattr(out, "latent", None)
    latent = getattr(out, "latents", None) if latent is None else latent
    if latent is None:
        raise DataError(f"{type(vae).__name__}.encode returned neither a posterior nor latents")
    return latent.float(), None


def sample_posterior(
    mean: torch.Tensor,
    std: torch.Tensor | None,
    normalization: LatentNormalization,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """A fresh draw from N(mean, std^2) (the mean itself for a deterministic encoder), normalised as the model
    sees it."""
    if std is None:
        return normalization.normalize(mean)
    eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return normalization.normalize(mean + std * eps)


class ImageSpace:
    """The space the transformer works in: pixels (``vae=None``) or an autoencoder's latents. One interface for what
    differs between the two, instead of a branch on the VAE at every use: the model's clean input from images,
    images from the model's output, the pixels one latent covers, and the autoencoder's fingerprint."""

    def __init__(self, vae=None) -> None:
        self.vae = vae
        self.space = None if vae is None else latent_space_of(vae)
        self.normalization = LatentNormalization.of(self.space)

    @property
    def is_latent(self) -> bool:
        return self.vae is not None

    @property
    def scaling_factor(self) -> float:
        return self.normalization.scale

    @property
    def downsample_factor(self) -> int:
        """Pixels per latent along each side (1 in pixel space)."""
        return 1 if self.space is None else self.space["downsample_factor"]

    def fingerprint(self) -> str | None:
        """The autoencoder's weights fingerprint (``None`` in pixel space)."""
        return None if self.vae is None else fingerprint_module(self.vae)

    def encode(self, images: torch.Tensor, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """Images in [-1, 1] on ``device`` -> the model's clean input: the images, or a draw from the autoencoder's
        posterior (noise from ``generator``, on the CPU, so a draw is the same on any device), normalised."""
        if self.vae is None:
            return images
        mean, std = encode_posterior(self.vae, images)
        if std is None:
            return self.normalization.normalize(mean)
        eps = torch.randn(mean.shape, generator=generator).to(device)
        return self.normalization.normalize(mean + std * eps)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output -> images in [-1, 1] (the identity in pixel space)."""
        if self.vae is None:
            return x
        return self.vae.decode(self.normalization.denormalize(x).to(self.vae.dtype)).sample.float()
